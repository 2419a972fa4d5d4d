"""Batches embedded in several ONNX Runtime runs: how many rows a run takes, and that the
answers do not change with it."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.data.catalog import read_catalog
from core.data.preprocess import load_batch
from index.embedder import CPU, CUDA, OnnxEmbedder, measures_run_rows
from serving.config import ServerConfig
from serving.search.engine import load_pair
from serving.search.query_embedder import OverBudget, QueryEmbedder, fastest_run_rows
from serving.server import SearchApp
from tests.support.server import SearchServer, config, event_loop


def timed_runs(per_run_s: float, per_row_squared_s: float = 0.0):
    """A `run` that takes `per_run_s` plus `per_row_squared_s` × rows² (a cost per row that
    grows with the run, as when a large run's activations spill out of the caches), and the
    row counts it was called with."""
    calls: list[int] = []

    def run(rows: np.ndarray) -> None:
        calls.append(len(rows))
        time.sleep(per_run_s + per_row_squared_s * len(rows) ** 2)

    return run, calls


def test_the_whole_batch_in_one_run_when_every_run_costs_the_same():
    run, _ = timed_runs(0.003)
    best, seconds = fastest_run_rows(run, np.zeros((8, 1)), budget_s=0.5)
    assert best is None
    assert set(seconds) == {1, 2, 4, 8}
    assert seconds[8] < seconds[2] < seconds[1]


def test_smaller_runs_when_a_large_run_costs_more_a_row():
    # A pass over 8 rows in runs of r: 8/r × (4.8 + 0.3 r²) ms: 40.8, 24, 19.2 (r = 4) and 24 ms.
    run, _ = timed_runs(0.0048, 0.0003)
    best, seconds = fastest_run_rows(run, np.zeros((8, 1)), budget_s=0.5)
    assert best == 4
    assert seconds[4] < seconds[8]
    # Splitting gains ~20% there: not enough when the split must gain half.
    assert fastest_run_rows(run, np.zeros((8, 1)), budget_s=0.5, min_gain=0.5)[0] is None


@pytest.mark.parametrize(("budget_s", "rounds"), [(0.0, 1), (60.0, 5)])
def test_rounds_are_bounded_by_the_budget(budget_s, rounds):
    run, calls = timed_runs(0.0)
    fastest_run_rows(run, np.zeros((8, 1)), budget_s=budget_s)
    per_pass = {1: 8, 2: 4, 4: 2, 8: 1}
    assert len(calls) == sum(per_pass.values()) * (1 + rounds)  # a warm-up pass, then the rounds
    assert fastest_run_rows(run, np.zeros((1, 1)))[0] is None  # one row: nothing to split


def test_the_measurement_stops_at_its_deadline_first_runs_included():
    """A machine so busy that even the unmeasured first runs take long: the deadline ends them."""
    run, calls = timed_runs(0.01)
    steps: list[str] = []
    started = time.monotonic()
    with pytest.raises(OverBudget):
        fastest_run_rows(run, np.zeros((64, 1)), budget_s=60, deadline=started + 0.2, progress=steps.append)
    assert time.monotonic() - started < 0.2 + 0.1  # one run past it at most
    assert len(calls) < 64  # not even the first pass, 64 runs of one row, was finished
    assert steps == ["first runs of 1 rows (1 of 12)"]  # 7 candidates, then up to 5 rounds


def test_an_over_budget_measurement_keeps_whole_batches_and_says_so(demo_run, caplog):
    embedder = QueryEmbedder(demo_run / "model", provider="cpu", intra_op_threads=2, runs_at_once=2)
    embedder.run_rows = embedder.side_by_side_run_rows = 3
    steps: list[str] = []
    with caplog.at_level("INFO", logger="serving.search.query_embedder"):
        embedder.tune_run_rows(2048, 1024, total_budget_s=0.05, progress=steps.append)
    assert (embedder.run_rows, embedder.side_by_side_run_rows) == (None, None)  # whole batches, as --run-rows 0
    assert "measuring rows per ONNX Runtime run took over 0.05 s" in caplog.text and "--run-rows" in caplog.text
    assert steps and steps[0] == "measuring batch sizes: session 1 of 2, first runs of 1 rows (1 of 17)"
    # Within budget, the steps run through both sessions to their last round.
    steps.clear()
    embedder.tune_run_rows(8, 4, budget_s=0.0, total_budget_s=60, progress=steps.append)
    assert steps[-1] == "measuring batch sizes: session 2 of 2, timing round 1 (4 of 8)"


def noting_rows(session) -> list[int]:
    """The rows of every run the session makes from now on (its real `run`, noted)."""
    rows: list[int] = []
    run = session.run

    def noted(outputs, feed):
        rows.append(len(next(iter(feed.values()))))
        return run(outputs, feed)

    session.run = noted
    return rows


def test_only_cpu_sessions_have_their_run_size_measured():
    assert measures_run_rows([CPU])
    assert not measures_run_rows([CUDA, CPU])  # a GPU wants the whole batch in one run


@pytest.fixture(scope="module")
def images(demo_run):
    paths = read_catalog(demo_run / "train" / "splits" / "test.csv").paths[:7]
    return load_batch(list(paths), OnnxEmbedder(demo_run / "model", provider="cpu").contract)


def test_a_batch_in_several_runs_embeds_as_in_one(demo_run, images):
    embedder = QueryEmbedder(demo_run / "model", provider="cpu", intra_op_threads=2, runs_at_once=2)
    whole, whole_beside = embedder.embed(images), embedder.embed(images, side_by_side=True)
    runs = {"full": noting_rows(embedder.session), "beside": noting_rows(embedder.side_by_side_session)}
    embedder.run_rows, embedder.side_by_side_run_rows = 3, 2
    np.testing.assert_allclose(embedder.embed(images), whole, atol=1e-5)
    np.testing.assert_allclose(embedder.embed(images, side_by_side=True), whole_beside, atol=1e-5)
    assert runs == {"full": [3, 3, 1], "beside": [2, 2, 2, 1]}


def test_rows_per_run_are_measured_set_or_whole_at_load(demo_run, images, caplog):
    index_root = demo_run / "index"
    pair = load_pair(index_root, provider="cpu", intra_op_threads=2, runs_at_once=2, run_rows=3, batch_rows=8)
    assert (pair.embedder.run_rows, pair.embedder.side_by_side_run_rows) == (3, 3)
    pair = load_pair(index_root, provider="cpu", intra_op_threads=2, runs_at_once=2, run_rows=0, batch_rows=8)
    assert (pair.embedder.run_rows, pair.embedder.side_by_side_run_rows) == (None, None)
    with caplog.at_level("INFO", logger="serving.search.query_embedder"):
        pair = load_pair(index_root, provider="cpu", intra_op_threads=2, runs_at_once=2, run_rows=None, batch_rows=8)
    # Measured: a batch of 8 on the full session, 4 (a stream's share) on the other.
    assert pair.embedder.run_rows in (None, 1, 2, 4)
    assert pair.embedder.side_by_side_run_rows in (None, 1, 2)
    measured = next(r.getMessage() for r in caplog.records if "rows per ONNX Runtime run" in r.getMessage())
    assert "2-thread session, 8 rows in runs of" in measured and "1-thread session, 4 rows in runs of" in measured
    np.testing.assert_allclose(pair.embedder.embed(images), OnnxEmbedder(demo_run / "model").embed(images), atol=1e-5)


def test_a_new_index_for_the_same_model_keeps_the_measured_rows(demo_run, caplog):
    index_root = demo_run / "index"
    options = dict(provider="cpu", intra_op_threads=2, runs_at_once=2, batch_rows=8)
    live = load_pair(index_root, run_rows=3, **options)
    with caplog.at_level("INFO", logger="serving.search.query_embedder"):
        again = load_pair(index_root, run_rows=None, previous=live, **options)
        assert (again.embedder.run_rows, again.embedder.side_by_side_run_rows) == (3, 3)
        assert not [r for r in caplog.records if "rows per ONNX Runtime run" in r.getMessage()]
        live.embedder.model_id = "another model"
        load_pair(index_root, run_rows=None, previous=live, **options)
        assert [r for r in caplog.records if "rows per ONNX Runtime run" in r.getMessage()]


def test_the_largest_run_is_a_batch_or_one_query(tmp_path):
    assert ServerConfig.flat(index_root=str(tmp_path), max_batch_size=24).largest_run == 24
    assert ServerConfig.flat(index_root=str(tmp_path), max_batch_size=24, batching=False).largest_run == 1
    with pytest.raises(ValueError, match="run_rows must be ≥ 0"):
        ServerConfig.flat(index_root=str(tmp_path), run_rows=-1)


def test_a_cpu_run_holds_at_most_a_pass_of_224_px_images():
    from core.data.preprocess import CPU_PASS_PIXELS, rows_per_pass

    assert rows_per_pass(224, 224) == 32 and rows_per_pass(28, 28) == CPU_PASS_PIXELS // 784
    assert rows_per_pass(4000, 4000) == 1  # never zero


def test_while_run_sizes_are_measured_http_says_why_and_grpc_health_is_not_serving(demo_run):
    """A server's start is held up by the measurement (a large batch size here): meanwhile HTTP
    answers 503 saying what the load is doing, and gRPC answers health NOT_SERVING."""
    server = SearchServer(config(demo_run / "index", http_port=0, max_batch_size=512, run_rows_budget_s=300))
    started = asyncio.run_coroutine_threadsafe(SearchApp.start(server), event_loop())
    info = f"http://127.0.0.1:{server.http_port}/v1/info"
    messages, health = [], set()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while not started.done():
            try:
                urllib.request.urlopen(info, timeout=30).close()
            except urllib.error.HTTPError as exc:
                message = json.loads(exc.read())["error"]["message"]
                if exc.code == 503 and "measuring batch sizes" in message:
                    messages.append(message)
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
                    # The pair is swapped in before health turns SERVING: not loaded after the
                    # answer means not loaded when it was given (the load may end in between).
                    if not server.engine.loaded:
                        health.add(status)
            time.sleep(0.01)
        started.result()
        assert messages, "no 503 named the measurement"
        assert messages[0].startswith("not ready: loading the index CURRENT names: measuring batch sizes: session 1 of")
        assert re.search(r"\((\d+) of (\d+)\)$", messages[-1])
        assert health == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        with urllib.request.urlopen(info, timeout=30) as answer:
            assert answer.status == 200
    finally:
        channel.close()
        server.stop(grace=0)
