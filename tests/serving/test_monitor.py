"""RecallMonitor keeps figures of the live pair only, whatever finishes after a reload."""

from __future__ import annotations

import threading
import time

import pytest

from serving.monitoring.monitor import MonitorConfig, RecallMonitor
from serving.search.engine import load_pair
from serving.telemetry.metrics import ServiceMetrics

pytestmark = pytest.mark.slow


def gauges(metrics: ServiceMetrics) -> dict[tuple, float]:
    return {
        (sample.name, *sorted(sample.labels.values())): sample.value
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name in ("simsearch_recall_at_k", "simsearch_ann_recall_at_k")
    }


def test_figures_of_a_pair_swapped_out_meanwhile_are_dropped(demo_run):
    old, new = load_pair(demo_run / "index"), load_pair(demo_run / "index")
    metrics = ServiceMetrics()
    monitor = RecallMonitor(MonitorConfig(ks=(1,)), metrics)
    monitor.reset(old)
    monitor.record_labelled(old.serial, "a", ["a"])
    assert monitor.figures() == {"traffic": {1: 1.0}}

    def probe_spanning_a_reload():
        monitor.reset(new)
        return {1: 0.9}

    assert monitor.run_probe(probe_spanning_a_reload) is None
    # Late records of the old pair: an in-flight answer, feedback on it, a sampled query.
    monitor.record_labelled(old.serial, "a", ["a"])
    assert monitor.record_feedback(old.serial, ["x"], ["x"]) is False
    monitor.check_ann(old.serial, old.vectors[0], [0], set())
    assert monitor.figures() == {} and monitor.ann_values() == {} and gauges(metrics) == {}

    monitor.record_labelled(new.serial, "a", ["b"])
    assert monitor.record_feedback(new.serial, ["x", "y"], ["x"]) is True
    monitor.check_ann(new.serial, new.vectors[0], [0], set())
    assert monitor.run_probe(lambda: {1: 0.5}) == {1: 0.5}
    assert monitor.figures() == {"probe": {1: 0.5}, "traffic": {1: 0.0}, "feedback": {1: 1.0}}
    assert set(monitor.ann_values()) == {1}
    assert gauges(metrics)[("simsearch_recall_at_k", "1", "probe")] == 0.5


def counting_probe(result: dict[int, float] | None = None) -> tuple[list[str], object]:
    """A probe that notes the thread of each round it runs."""
    rounds: list[str] = []

    def probe():
        rounds.append(threading.current_thread().name)
        return result

    return rounds, probe


def test_probe_interval_zero_switches_probe_rounds_off():
    assert not MonitorConfig(probe_interval_s=0).probes and MonitorConfig().probes
    with pytest.raises(ValueError, match="probe_interval_s must be ≥ 0"):
        MonitorConfig(probe_interval_s=-1)
    monitor = RecallMonitor(MonitorConfig(probe_interval_s=0), ServiceMetrics())
    rounds, probe = counting_probe()
    threads_before = set(threading.enumerate())
    monitor.start(probe)
    try:
        # start() starts its threads before it returns: a probe thread would be alive or have run.
        started = {t.name for t in set(threading.enumerate()) - threads_before}
        assert "probe" not in started and "ann-fidelity" in started
        assert rounds == []
    finally:
        monitor.stop()


def test_scheduled_probe_rounds_run_at_once_then_every_interval():
    metrics = ServiceMetrics()
    monitor = RecallMonitor(MonitorConfig(ks=(1,), probe_interval_s=0.01), metrics)
    rounds, probe = counting_probe({1: 0.75})
    monitor.start(probe)
    try:
        deadline = time.monotonic() + 60  # a bound on a hang: rounds come every 10 ms
        while len(rounds) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        monitor.stop()
    assert len(rounds) >= 3 and set(rounds) == {"probe"}
    assert monitor.figures() == {"probe": {1: 0.75}}  # published (the live pair unset: None is None)
