"""bench_serving: every ratio uses the ceilings of its own round, the ceiling runs what the
server would from the same flags, and each h2load figure counts its own run only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.bench_serving import paired_ratios
from benchmarks.harness import (
    MODES,
    ROOT,
    Ceiling,
    _accepts,
    free_port,
    grpc_body,
    h2load,
    serve_flags,
    start,
    stop,
)
from serving.__main__ import server_config


def ceiling(b1: float, b32: float, b8: float, concurrent: float, streams8: float | None = None) -> dict:
    batch = {1: {"qps": b1, "qps_with_decode": 90.0, "latency_with_decode_ms": 10.0}}
    batch[8] = {"qps": b8, "qps_with_decode": b8, "latency_with_decode_ms": 0.0}
    batch[32] = {"qps": b32, "qps_with_decode": b32 / 2, "latency_with_decode_ms": 0.0}
    streams = {8: {"qps": streams8}} if streams8 else {}
    return {"batches": batch, "concurrent": {"qps": concurrent}, "streams": streams}


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


def test_batch_streams_in_process_are_a_ceiling_too():
    # Batches of 8 two at once beat one at a time (180 vs 160) and everything else (1,000).
    ceilings = [ceiling(50, 200, 160, 250, streams8=180), ceiling(50, 200, 160, 250, streams8=1000)]
    rounds = {mode: [[level(100, mean_batch=8.2)]] * 2 for mode in MODES}
    on = paired_ratios(rounds, ceilings)["on"][32]
    assert on["vs_same_batch"] == [100 / 180, 100 / 1000]
    assert on["vs_best"] == [100 / 250, 100 / 1000]


CPUS = os.cpu_count() or 1


@pytest.mark.parametrize(
    ("flags", "threads", "runs_off", "runs_on"),
    [
        ((), CPUS, CPUS, 2),
        (("--workers", "3"), 3, 3, 2),
        (("--max-queue", "9", "--workers=5", "--batch-streams", "3"), 5, 5, 3),
        (("--workers", "3", "--intra-op-threads", "2"), 3, 1, 1),  # every run on one 2-thread session
    ],
)
def test_the_ceiling_reads_the_servers_own_flags(tmp_path, flags, threads, runs_off, runs_on):
    (tmp_path / "index").mkdir()  # the server checks its index root exists
    unbatched = server_config(serve_flags(tmp_path, "off", flags))
    batched = server_config(serve_flags(tmp_path, "on", flags))
    assert unbatched.runtime.worker_threads == threads
    assert (unbatched.runs_at_once, batched.runs_at_once) == (runs_off, runs_on)
    assert unbatched.index_root == str(tmp_path / "index") and unbatched.batching.max_batch_size == 32


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--intra-op-threads", "1"), ("--batch-streams", "1")])
def test_the_ceiling_loads_the_pairs_the_servers_would(demo_run, flags):
    batched = server_config(serve_flags(demo_run, "on", flags))
    unbatched = server_config(serve_flags(demo_run, "off", flags))
    ceiling = Ceiling(batched, unbatched, demo_run / "train" / "splits" / "test.csv", repeats=1)
    cpus = min(CPUS, 8)  # ORT's default intra-op threads
    shared = unbatched.runs_at_once > 1 and cpus > 1
    assert (ceiling.unbatched_embedder.side_by_side_session is not None) == shared
    shared = batched.runs_at_once > 1 and cpus > 1
    assert (ceiling.embedder.side_by_side_session is not None) == shared
    assert ceiling.index.ntotal > 0 and ceiling.streams == batched.batching.batch_streams
    loaded_once = batched.runs_at_once == unbatched.runs_at_once
    assert (ceiling.unbatched_embedder is ceiling.embedder) == loaded_once
    assert ceiling.measure_concurrent(2, seconds=0.2)["qps"] > 0
    streams = ceiling.measure_streams(4, seconds=0.2)
    assert streams["threads"] == batched.batching.batch_streams and streams["qps"] > 0


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load comes with `make setup` (nghttp2-client)")
def test_h2load_figures_count_only_their_own_run(tmp_path):
    # The benchmark warms each level up with a run logged to the same file as the measured one.
    port = free_port()
    floor = start([sys.executable, "-m", "benchmarks.grpc_floor", "--port", str(port)], lambda: _accepts(port))
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


def run_ab(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.ab_serving", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_ab_serving_refuses_what_it_cannot_compare(tmp_path):
    cases = [
        (["--config", "a="], "at least two"),
        (["--config", "a=", "--config", "a=--batch-streams 1"], "names must differ"),
        (["--config", "nameless", "--config", "b="], "NAME=FLAGS"),
        (["--config", "a=", "--config", "b=", "--run", str(tmp_path)], "has no index/"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: run_ab(*case[0]), cases))
    for (args, message), done in zip(cases, results, strict=True):
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load comes with `make setup` (nghttp2-client)")
def test_ab_serving_compares_servers_that_differ_only_in_their_flags(demo_run, tmp_path):
    report = tmp_path / "ab.json"
    done = run_ab(
        *("--run", str(demo_run), "--rounds", "1", "--levels", "8", "--seconds", "1", "--json", str(report)),
        *("--config", "on=", "--config", "off=--no-batching"),
    )
    assert done.returncode == 0, done.stderr
    rounds = json.loads(report.read_text())["rounds"]
    ((on,),), ((off,),) = rounds["on"], rounds["off"]
    assert on["queries"] > 0 and off["queries"] > 0 and on["errors"] == off["errors"] == 0
    assert on["mean_batch"] > 1.0 and off["mean_batch"] == 1.0  # each server ran its own flags
    assert "| off | 8 |" in done.stdout and "(ahead in " in done.stdout
