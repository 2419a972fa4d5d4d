"""The console's last hour (`serving.telemetry.history`): latency counts a bucket, percentiles
within a bucket's width of the exact ones, intervals on the clock, and the workers of one
server sharing theirs so that any of them shows the whole server's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from serving.telemetry.history import RATIO, TrafficHistory


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_interval_gives_its_rate_and_percentiles_within_a_bucket_of_the_exact_ones():
    clock = Clock(1_000_003.0)  # 3 s into an interval: intervals end on multiples of 10 s
    history = TrafficHistory(interval_s=10.0, clock=clock)
    latencies = np.random.default_rng(0).lognormal(np.log(0.002), 0.6, 500)
    for seconds in latencies:
        history.observe(float(seconds))
    assert history.points() == []  # the interval has not ended
    clock.now = 1_000_011.0
    [point] = history.points()
    assert point.t == 1_000_010.0 and point.qps == pytest.approx(50.0)
    for got, q in ((point.p50_ms, 50), (point.p99_ms, 99)):
        exact = np.percentile(latencies, q) * 1e3
        assert exact / RATIO <= got <= exact * RATIO, (q, got, exact)


def test_an_idle_stretch_shows_as_empty_intervals():
    clock = Clock(100.0)
    history = TrafficHistory(interval_s=10.0, clock=clock)
    history.observe(0.001)
    clock.now = 141.0
    points = history.points()
    assert [p.t for p in points] == [110.0, 120.0, 130.0, 140.0]
    assert points[0].qps == 0.1 and [p.qps for p in points[1:]] == [0.0] * 3 and points[1].p50_ms is None


def test_workers_sharing_their_histories_each_show_the_whole_servers(tmp_path):
    """Two workers' calls in the same intervals: either one's points count both (rates added,
    percentiles over the calls of both), once each has written its interval."""
    interval = 0.5
    first, second = TrafficHistory(interval_s=interval), TrafficHistory(interval_s=interval)
    first.share(tmp_path, "worker-0")
    second.share(tmp_path, "worker-1")
    try:
        start = time.time()
        while time.time() - start < 3 * interval:
            first.observe(0.001)  # fast calls on one worker,
            second.observe(0.100)  # slow ones on the other, as many
            time.sleep(0.01)
        time.sleep(2 * interval)  # each writes the intervals that ended
        calls: dict[float, int] = {}
        for end, counts in [*first._ring, *second._ring]:
            calls[end] = calls.get(end, 0) + int(counts.sum())
        for mine in (first, second):
            busy = [p for p in mine.points() if p.qps]
            assert len(busy) >= 2, busy
            for point in busy:
                assert point.qps == calls[point.t] / interval  # both workers' calls
                assert 90 <= point.p99_ms <= 110  # the slow worker's calls, seen from either
    finally:
        first.stop()
        second.stop()


def test_a_file_being_replaced_or_damaged_is_passed_over(tmp_path):
    history = TrafficHistory(interval_s=10.0)
    history.share(tmp_path, "worker-0")
    try:
        (tmp_path / "worker-1.npz").write_bytes(b"not a file of counts")
        (tmp_path / "worker-2.tmp.npz").write_bytes(b"")
        history.observe(0.001)
        assert isinstance(history.points(), list)
    finally:
        history.stop()
