"""bench_serving's arithmetic: every ratio it reports uses the ceilings of its own round."""

from __future__ import annotations

import os

import pytest

from benchmarks.bench_serving import MODES, paired_ratios, unbatched_threads


def ceiling(b32: float, b8: float, concurrent: float, concurrent_1t: float) -> dict:
    batch = {1: {"qps": 100.0, "qps_with_decode": 90.0, "latency_with_decode_ms": 10.0}}
    batch[8] = {"qps": b8, "qps_with_decode": b8, "latency_with_decode_ms": 0.0}
    batch[32] = {"qps": b32, "qps_with_decode": b32 / 2, "latency_with_decode_ms": 0.0}
    return {"batches": batch, "concurrent": {"qps": concurrent}, "concurrent_1t": {"qps": concurrent_1t}}


def level(qps: float, mean_batch: float = 1.0) -> list[dict]:
    return [{"concurrency": 32, "qps": qps, "p50_ms": 12.0, "mean_batch": mean_batch}]


def test_each_round_is_divided_by_its_own_ceilings():
    # The machine doubled its speed between the rounds: so did the server and every ceiling.
    ceilings = [ceiling(200, 160, 180, 250), ceiling(400, 320, 360, 500)]
    rounds = {
        "on": [level(100, mean_batch=7.6), level(200, mean_batch=8.4)],
        "off": [level(90), level(180)],
        "off-1t": [level(125), level(250)],
    }
    ratios = paired_ratios(rounds, ceilings)
    assert set(ratios) == set(MODES)
    on, off, one_thread = (ratios[m][32] for m in ("on", "off", "off-1t"))
    assert on["vs_b32"] == [0.5, 0.5]
    assert on["vs_b32_with_decode"] == [1.0, 1.0]
    assert on["vs_same_batch"] == [100 / 160, 200 / 320]  # the batch size it formed, rounded
    assert off["vs_same_batch"] == [0.5, 0.5]  # single queries, threads at once, same session
    assert one_thread["vs_same_batch"] == [0.5, 0.5]  # ... on a single-threaded session
    assert one_thread["vs_best"] == [0.5, 0.5] and on["vs_best"] == [0.4, 0.4]  # best: 250, 500
    assert on["added_p50_ms"] == [2.0, 2.0]


@pytest.mark.parametrize(
    ("flags", "threads"),
    [((), os.cpu_count()), (("--workers", "3"), 3), (("--max-queue", "9", "--workers", "5"), 5)],
)
def test_the_unbatched_ceiling_runs_as_many_threads_as_the_server(flags, threads):
    assert unbatched_threads(flags) == threads
