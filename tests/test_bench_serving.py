"""bench_serving's arithmetic: every ratio it reports uses the ceilings of its own round."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from benchmarks.bench_serving import (
    MODES,
    ROOT,
    _accepts,
    free_port,
    grpc_body,
    h2load,
    paired_ratios,
    start,
    stop,
    unbatched_threads,
)


def ceiling(b1: float, b32: float, b8: float, concurrent: float) -> dict:
    batch = {1: {"qps": b1, "qps_with_decode": 90.0, "latency_with_decode_ms": 10.0}}
    batch[8] = {"qps": b8, "qps_with_decode": b8, "latency_with_decode_ms": 0.0}
    batch[32] = {"qps": b32, "qps_with_decode": b32 / 2, "latency_with_decode_ms": 0.0}
    return {"batches": batch, "concurrent": {"qps": concurrent}}


def level(qps: float, mean_batch: float = 1.0, concurrency: int = 32) -> dict:
    return {"concurrency": concurrency, "qps": qps, "p50_ms": 12.0, "mean_batch": mean_batch}


def test_each_round_is_divided_by_its_own_ceilings():
    # The machine doubled its speed between the rounds: so did the server and every ceiling.
    ceilings = [ceiling(50, 200, 160, 250), ceiling(100, 400, 320, 500)]
    rounds = {
        "on": [[level(40, concurrency=1), level(100, mean_batch=7.6)], [level(80, concurrency=1), level(200, 8.4)]],
        "off": [[level(25, concurrency=1), level(125)], [level(50, concurrency=1), level(250)]],
    }
    ratios = paired_ratios(rounds, ceilings)
    assert set(ratios) == set(MODES)
    on, off = ratios["on"][32], ratios["off"][32]
    assert on["vs_b32"] == [0.5, 0.5]
    assert on["vs_b32_with_decode"] == [1.0, 1.0]
    assert on["vs_same_batch"] == [100 / 160, 200 / 320]  # the batch size it formed, rounded
    assert off["vs_same_batch"] == [0.5, 0.5]  # single queries, threads at once, single-threaded
    assert ratios["off"][1]["vs_same_batch"] == [0.5, 0.5]  # alone: one query at a time, batch 1
    assert off["vs_best"] == [0.5, 0.5] and on["vs_best"] == [0.4, 0.4]  # best: 250, 500
    assert on["added_p50_ms"] == [2.0, 2.0]


@pytest.mark.parametrize(
    ("flags", "threads"),
    [((), os.cpu_count()), (("--workers", "3"), 3), (("--max-queue", "9", "--workers", "5"), 5)],
)
def test_the_unbatched_ceiling_runs_as_many_threads_as_the_server(flags, threads):
    assert unbatched_threads(flags) == threads


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load comes with `make setup` (nghttp2-client)")
def test_h2load_figures_count_only_their_own_run(tmp_path):
    # The benchmark warms each level up with a run logged to the same file as the measured one.
    port = free_port()
    floor = start(
        [sys.executable, str(ROOT / "benchmarks" / "grpc_floor.py"), "--port", str(port)], lambda: _accepts(port)
    )
    try:
        body = tmp_path / "search.grpc"
        body.write_bytes(grpc_body(b"not decoded by the floor server"))
        log = tmp_path / "h2load.log"
        first = h2load(port, body, 2, 1, log)
        second = h2load(port, body, 2, 1, log)
    finally:
        stop(floor)
    assert first["queries"] == first["http_ok"] > 0
    assert second["queries"] == second["http_ok"] > 0  # not first's rows as well
