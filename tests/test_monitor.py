"""RecallMonitor keeps figures of the live pair only, whatever finishes after a reload."""

from __future__ import annotations

import pytest

from serving.engine import load_pair
from serving.metrics import ServiceMetrics
from serving.monitor import MonitorConfig, RecallMonitor

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
    monitor.record_labelled(old, "a", ["a"])
    assert monitor.figures() == {"traffic": {1: 1.0}}

    def probe_spanning_a_reload():
        monitor.reset(new)
        return {1: 0.9}

    assert monitor.run_probe(probe_spanning_a_reload) is None
    # Late records of the old pair: an in-flight answer, feedback on it, a sampled query.
    monitor.record_labelled(old, "a", ["a"])
    assert monitor.record_feedback(old, ["x"], ["x"]) is False
    monitor.check_ann(old, old.index.reconstruct(0), [0], set())
    assert monitor.figures() == {} and monitor.ann_values() == {} and gauges(metrics) == {}

    monitor.record_labelled(new, "a", ["b"])
    assert monitor.record_feedback(new, ["x", "y"], ["x"]) is True
    monitor.check_ann(new, new.index.reconstruct(0), [0], set())
    assert monitor.run_probe(lambda: {1: 0.5}) == {1: 0.5}
    assert monitor.figures() == {"probe": {1: 0.5}, "traffic": {1: 0.0}, "feedback": {1: 1.0}}
    assert set(monitor.ann_values()) == {1}
    assert gauges(metrics)[("simsearch_recall_at_k", "1", "probe")] == 0.5
