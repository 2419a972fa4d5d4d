"""Production behaviour of the server: batching, overload, deadlines, hot reload under load,
online Recall@K, TLS, tokens, graceful shutdown. Real servers on loopback, real ONNX Runtime and
faiss over the model and index the session's demo chain built.

None of these tests waits for a state to happen by itself: a full queue, queries sharing a
batch, a deadline passing mid-request, a drain in progress are made by the test — the batcher
paused (`DynamicBatcher.pause`) while queries queue, a batch held at a `Gate` in its inference
thread — so they hold however busy the machine is. Probe rounds, background work most tests do
not test, are off (`probe_interval_s=0`); a test that needs one runs it itself. Waits are for a
condition, with a generous bound that only a hang reaches."""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import pytest
from PIL import Image

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from index.search.faiss_index import build_index, save_index
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient
from serving.config import ServerConfig
from serving.search.executors import DecodePlacement
from tests.support.images import encode
from tests.support.server import SearchServer, config, connect, derived_version, image_requests, start, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@pytest.fixture()
def index_root(demo_run, tmp_path) -> Path:
    root = tmp_path / "index"
    shutil.copytree(demo_run / "index", root)
    return root


class Gate:
    """Wraps a function so that its calls wait while the gate is closed, until the test opens
    it: put around the engine's `embed`, it holds a batch in its inference thread (running, its
    stream taken) for as long as the test needs. Open at first unless made closed."""

    def __init__(self, fn, closed: bool = True) -> None:
        self.fn = fn
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.held = 0  # calls waiting at the gate now
        if not closed:
            self._open.set()

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.held += 1
        try:
            assert self._open.wait(120), "the test never opened the gate"
        finally:
            with self._lock:
                self.held -= 1
        return self.fn(*args, **kwargs)

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()


def hold_inference(server: SearchServer, closed: bool = True) -> Gate:
    """A gate around the server's embedding: batches of images wait at it in their inference thread."""
    gate = Gate(server.engine.embed, closed)
    server.engine.embed = gate
    return gate


def shuffled_labels(staging: Path, manifest: dict) -> None:
    items = ItemTable.read(staging / "items.parquet")
    rng = np.random.default_rng(1)
    shuffled = [str(label) for label in rng.permutation(list(items.labels))]
    ItemTable(items.ids, shuffled, items.paths, items.metadata).write(staging / "items.parquet")
    manifest["index_id"] = "shuffledlabels01"


def coarse_ivf(staging: Path, manifest: dict) -> None:
    vectors = np.load(staging / "embeddings.npy")
    save_index(build_index(vectors, "IVF64,Flat", {"nprobe": 1}), staging / "index.faiss")
    manifest.update(index_id="coarseivf0000001", factory="IVF64,Flat", search_params={"nprobe": 1})


def queued_together(server: SearchServer, calls: list[Callable[[], T]]) -> list[T]:
    """The results of `calls` (each one RPC) made at once while the batcher is paused, the
    batcher let go once every one of them is queued: they must share batches, however slowly
    the machine sends them (made at once unpaused, they overlap only if the machine sends the
    later ones while the first still wait)."""
    total0, count0 = batch_totals(server)
    server.batcher.pause()
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(call) for call in calls]
            # (A call that failed ends the wait at once: its result() raises below.)
            wait_for(lambda: server.batcher.queued == len(calls) or any(f.done() for f in futures))
            server.batcher.resume()
            results = [f.result() for f in futures]
    finally:
        server.batcher.resume()
    total, count = batch_totals(server)
    assert total - total0 == len(calls) and count - count0 < len(calls), "queries queued together must share batches"
    return results


def concurrent_then_single(
    server: SearchServer, client: SearchClient, requests: list[pb.SearchRequest]
) -> tuple[list[pb.SearchResponse], list[pb.SearchResponse]]:
    """The answers to `requests` queued together (so batched), then one at a time; the server stopped after."""
    try:
        batched = queued_together(server, [functools.partial(client.search, r) for r in requests])
        return batched, [client.search(r) for r in requests]
    finally:
        client.close()
        server.stop(0)


def assert_same_answers(answers: list[pb.SearchResponse], expected: list[pb.SearchResponse]) -> None:
    """The same neighbours in the same order, the same scores to float32 rounding."""
    for a, b in zip(answers, expected, strict=True):
        assert [n.id for n in a.neighbors] == [n.id for n in b.neighbors]
        np.testing.assert_allclose([n.score for n in a.neighbors], [n.score for n in b.neighbors], atol=1e-5)


def batch_totals(server: SearchServer) -> tuple[float, float]:
    """Queries batched so far, and batches run (the batch-size histogram's sum and count)."""
    samples = server.metrics.batch_size.collect()[0].samples
    return tuple(
        next(s.value for s in samples if s.name == name)
        for name in ("simsearch_batch_size_sum", "simsearch_batch_size_count")
    )


def test_concurrent_queries_are_batched_and_equal_unbatched_answers(index_root):
    requests = image_requests(index_root, 48)
    # One stream: with two, whether the last 16 run as one batch or split 8 + 8 over both streams
    # (the policy for a queue of two shares) depends on whether both earlier batches finished
    # before the batching task woke — a race, not the behaviour under test.
    server, client = start(index_root, max_batch_size=16, batch_streams=1)
    try:
        total0, count0 = batch_totals(server)
        batched = queued_together(server, [functools.partial(client.search, r) for r in requests])
        total, count = batch_totals(server)
        assert (total - total0, count - count0) == (48, 3), "48 queued queries make three full batches of 16"
    finally:
        client.close()
        server.stop(0)
    server, client = start(index_root, batching=False, workers=2)
    try:
        # Queries run side by side there, single-threaded (where ORT would use more than one thread).
        assert (server.engine.pair.embedder.side_by_side_session is not None) == ((os.cpu_count() or 1) > 1)
        single = [client.search(r) for r in requests]
    finally:
        client.close()
        server.stop(0)
    assert_same_answers(batched, single)


@pytest.mark.parametrize(
    ("placement", "flags"),
    [
        ("loop", {}),  # the demo's 28×28 glyphs for a 28×28 model: under --inline-decode-pixels
        ("inference", {"inline_decode_pixels": 0}),
        ("pool", {"inline_decode_pixels": 0, "inference_decode_pixels": 0}),
    ],
)
def test_every_decode_placement_answers_like_a_single_query(index_root, placement, flags):
    requests = image_requests(index_root, 24)
    server, client = start(index_root, max_batch_size=8, **flags)
    placed: list[str] = []
    place = server.service.placement

    def noting(pair, image):  # the real choice, noted
        placed.append(place(pair, image))
        return placed[-1]

    server.service.placement = noting
    batched, single = concurrent_then_single(server, client, requests)
    # The pool takes images only while the batcher is busy (here: queries queued while it is
    # paused, all but the first): a query alone goes to the inference thread.
    assert placement in placed, placed
    assert set(placed) <= {placement, "inference"}
    assert_same_answers(batched, single)


def test_a_server_embedding_batches_in_small_runs_answers_like_single_queries(index_root):
    requests = image_requests(index_root, 24)
    server, client = start(index_root, max_batch_size=8, run_rows=2)
    assert server.engine.pair.embedder.run_rows == 2
    batched, single = concurrent_then_single(server, client, requests)
    assert_same_answers(batched, single)


def test_images_decode_where_they_cost_least(index_root):
    """Tiny images on the loop, small ones in the inference thread, large ones in the pool while
    a batch is queued, filling or running — and in the inference thread when it would take them
    at once."""
    # A batch of two waits up to a minute for its second query: filling lasts until the test
    # sends it. (One stream: with two, a batch of two is two shares, and the second query
    # would start a batch of its own.)
    server, client = start(
        index_root, max_batch_size=2, batch_streams=1, max_wait_ms=60_000, inference_decode_pixels=100 * 100
    )
    service, pair, batcher = server.service, server.engine.pair, server.batcher
    sizes = {"tiny": (28, 28), "small": (100, 100), "large": (101, 100)}
    images = {name: server.service.checks.open_image(encode(Image.new("L", size))) for name, size in sizes.items()}
    a, b = image_requests(index_root, 2)

    def decoders() -> dict[str, str]:
        return {name: service.placement(pair, image) for name, image in images.items()}

    busy: dict[str, dict[str, str]] = {}
    gate = hold_inference(server, closed=False)
    try:
        with ThreadPoolExecutor(2) as pool:
            idle = decoders()
            # Filling: the first query of a batch of two, the batch waiting for the second.
            first = pool.submit(client.search, a)
            wait_for(lambda: batcher.decode_placement is DecodePlacement.IN_POOL and batcher.queued == 0)
            busy["filling"] = decoders()
            second = pool.submit(client.search, b)  # fills the batch, which runs
            assert first.result().neighbors and second.result().neighbors
            # Queued: the batcher paused, a query waits for it.
            batcher.pause()
            first = pool.submit(client.search, a)
            wait_for(lambda: batcher.queued == 1)
            busy["queued"] = decoders()
            second = pool.submit(client.search, b)
            wait_for(lambda: batcher.queued == 2)
            batcher.resume()
            assert first.result().neighbors and second.result().neighbors
            # Running: a full batch held in its inference thread.
            gate.close()
            first, second = pool.submit(client.search, a), pool.submit(client.search, b)
            wait_for(lambda: gate.held == 1)
            busy["running"] = decoders()
            gate.open()
            assert first.result().neighbors and second.result().neighbors
            assert batcher.decode_placement is DecodePlacement.IN_BATCHER  # idle again
    finally:
        gate.open()
        batcher.resume()
        client.close()
        server.stop(0)
    assert idle == {"tiny": "loop", "small": "inference", "large": "inference"}
    for state in ("filling", "queued", "running"):
        assert busy[state] == {"tiny": "loop", "small": "inference", "large": "pool"}, state


def test_embed_calls_are_batched_with_queries_and_equal_the_model(index_root):
    requests = image_requests(index_root, 16)
    server, client = start(index_root, max_batch_size=32)
    try:
        calls = [functools.partial(client.embed, r.image) for r in requests]
        calls += [functools.partial(client.search, r) for r in requests]
        answers = queued_together(server, calls)  # embeds and queries share batches
        embedded, searched = answers[:16], answers[16:]
        assert all(s.neighbors for s in searched)
        pair = server.engine.pair
        for request, answer in zip(requests, embedded, strict=True):
            array = server.engine.model_input(pair, server.service.checks.open_image(request.image))
            direct = server.engine.embed(pair, [array])[0]
            np.testing.assert_allclose(answer.embedding, direct, atol=1e-5)
            assert answer.timings.embed_ms > 0 and answer.timings.search_ms == 0
    finally:
        client.close()
        server.stop(0)


def test_full_queue_answers_resource_exhausted_at_once(index_root):
    requests = image_requests(index_root, 40)
    # 40 workers: gRPC's own limit on calls at once (queue + workers) stays above the 40 sent.
    server, client = start(index_root, max_queue=2, workers=40)
    refusals: list[str] = []

    def call(r):
        try:
            client.search(r)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            refusals.append(exc.details())
            return exc.code()

    # Nothing leaves the paused batcher's queue: the first two queries fill it, the other 38 overflow.
    server.batcher.pause()
    try:
        with ThreadPoolExecutor(40) as pool:
            futures = [pool.submit(call, r) for r in requests]
            # At once: refused while the queue is still full, not once it drains.
            wait_for(lambda: sum(f.done() for f in futures) == 38)
            assert [f.result() for f in futures if f.done()] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 38
            assert all("2 queries already queued" in r for r in refusals), refusals[:3]  # the batcher's queue
            assert server.batcher.queued == 2
            server.batcher.resume()
            codes = [f.result() for f in futures]
        assert codes.count(grpc.StatusCode.OK) == 2  # the admitted two are answered once it drains
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 38
        assert client.search(requests[0]).neighbors  # still serving
    finally:
        server.batcher.resume()
        client.close()
        server.stop(0)


def test_old_connections_are_recycled_without_failing_a_call(index_root):
    # Behind an L4 load balancer a client stays on the replica it first reached unless the
    # server ends the connection now and then: with a 1 s age, calls made one after another
    # must see the channel reconnect, and every one of them must still succeed. Time is the
    # subject here (a connection's age), so the clock is real; the calls go on until the
    # channel has reconnected twice, however long the machine takes to get there.
    server, client = start(index_root, max_connection_age_s=1.0, max_connection_age_grace_s=1.0)
    states: list[grpc.ChannelConnectivity] = []
    client.channel.subscribe(states.append)
    requests = image_requests(index_root, 4)

    def reconnects() -> int:
        return sum(1 for a, b in itertools.pairwise(list(states)) if a == grpc.ChannelConnectivity.READY and b != a)

    try:
        answered, deadline = 0, time.monotonic() + 120  # with max_connection_age_s=0: never reconnects
        while (reconnects() < 2 or answered < 20) and time.monotonic() < deadline:
            assert client.search(requests[answered % 4]).neighbors
            answered += 1
            time.sleep(0.02)
    finally:
        client.close()
        server.stop(grace=1)
    assert answered >= 20
    assert reconnects() >= 2, states


def test_connection_lifetime_flags_become_grpc_options(tmp_path):
    from serving.__main__ import server_config

    defaults = dict(server_config(["--index-root", str(tmp_path)]).transport.connection_options)
    assert defaults["grpc.max_connection_age_ms"] == 300_000 and defaults["grpc.keepalive_time_ms"] == 60_000
    off = dict(
        server_config(
            ["--index-root", str(tmp_path), "--max-connection-age-s", "0", "--keepalive-s", "0"]
        ).transport.connection_options
    )
    assert "grpc.max_connection_age_ms" not in off and "grpc.keepalive_time_ms" not in off
    assert off["grpc.http2.min_ping_interval_without_data_ms"] == 10_000  # clients may still ping


def answered_codes(server: SearchServer, method: str) -> dict[str, float]:
    """The server's count of `method` calls answered, by status code."""
    samples = server.metrics.requests.collect()[0].samples
    return {s.labels["code"]: s.value for s in samples if s.name.endswith("_total") and s.labels["method"] == method}


def failed(server: SearchServer, method: str) -> float:
    return sum(n for code, n in answered_codes(server, method).items() if code != "OK")


def test_reload_is_counted_with_its_code_like_every_rpc(index_root):
    server, client = start(index_root, admin_token="tok")
    try:
        assert client.reload().index_version == server.engine.pair.version
        with pytest.raises(grpc.RpcError) as err:
            client.reload(index_version="20991231T000000000000-nosuchversion00")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: answered_codes(server, "Reload") == {"OK": 1.0, "FAILED_PRECONDITION": 1.0})
        latency = server.metrics.latency.collect()[0].samples
        assert any(
            s.name.endswith("_count") and s.labels == {"method": "Reload", "protocol": "grpc"} and s.value == 2
            for s in latency
        )
    finally:
        client.close()
        server.stop(0)


def test_request_past_its_deadline_is_cancelled(index_root):
    """A call whose deadline passes while its batch is held (in the inference thread, or queued
    behind it) is answered DEADLINE_EXCEEDED by the server then — not when the batch ends — and
    a queued one costs no work."""
    (request,) = image_requests(index_root, 1)
    server, client = start(index_root, batch_streams=1)
    gate = hold_inference(server)  # closed: batches wait in the one inference thread
    try:
        with ThreadPoolExecutor(1) as pool:
            # Mid-request: the query's batch is taken, and held past the query's deadline. (A
            # machine that took longer than the deadline to get it there would see it expire
            # queued instead: answered the same way, and counted the same way below.)
            searching = pool.submit(client.search, request, timeout=3.0)
            wait_for(lambda: gate.held == 1 or searching.done())
            with pytest.raises(grpc.RpcError) as err:
                searching.result()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server answered (not only the client gave up), with the batch still held.
        wait_for(lambda: failed(server, "Search") == 1)
        # Queued behind the held batch: Embed waits in the same batches.
        with pytest.raises(grpc.RpcError) as err:
            client.embed(request.image, timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: failed(server, "Embed") == 1)
        assert gate.held == 1 and answered_codes(server, "Search").get("OK", 0) == 0
        total0, _ = batch_totals(server)
        gate.open()
        assert client.search(request).neighbors  # still serving
        total, _ = batch_totals(server)
        # The held query, then this one: the expired Embed was dropped before it cost any work.
        assert total - total0 == 2
    finally:
        gate.open()
        client.close()
        server.stop(0)


def test_reload_under_load_fails_nothing_and_versions_stay_consistent(index_root):
    other = derived_version(index_root, coarse_ivf)
    first = artifacts.current_version(index_root)
    requests = image_requests(index_root, 20)
    server, client = start(index_root, admin_token="tok")
    gate = hold_inference(server, closed=False)
    stop = threading.Event()
    answers, failures = [], []

    def answered_by(version: str) -> int:
        return sum(a.index_version == version for a in list(answers))

    def load():
        i = 0
        while not stop.is_set():
            try:
                answers.append(client.search(requests[i % len(requests)]))
            except grpc.RpcError as exc:
                failures.append(exc.code())
            i += 1

    try:
        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        wait_for(lambda: answered_by(first) >= 5 or failures)
        for version in (other, first, other):
            # Each swap happens with queries mid-batch on the old pair, held at the gate until
            # the new pair is live; then the new pair answers some before the next swap.
            gate.close()
            wait_for(lambda: gate.held >= 1 or failures)
            before = answered_by(version)
            assert client.reload(index_version=version).index_version == version
            gate.open()
            wait_for(lambda: answered_by(version) >= before + 5 or failures)  # noqa: B023 - used at once
        stop.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
        gate.open()
        client.close()
        server.stop(0)
    assert failures == []
    versions = {a.index_version for a in answers}
    assert versions == {first, other}
    index_ids = {a.index_version: a.index_id for a in answers}
    for a in answers:  # every answer names one consistent (version, index, model) triple
        assert a.index_id == index_ids[a.index_version]
        assert a.model_id == answers[0].model_id


def _gauge(server: SearchServer, name: str, **labels) -> float | None:
    for metric in server.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def noting_probes(server: SearchServer) -> list[str]:
    """The threads of every probe round the server runs from now on (its real rounds, noted);
    set before `start`, which hands the monitor the server's `run_probe`."""
    rounds: list[str] = []
    run_probe = server.run_probe

    def noted():
        rounds.append(threading.current_thread().name)
        return run_probe()

    server.run_probe = noted
    return rounds


def test_with_probes_off_no_round_runs_at_start_or_after_a_reload(index_root):
    threads_before = set(threading.enumerate())
    server = SearchServer(config(index_root, admin_token="tok"))  # probe_interval_s=0
    rounds = noting_probes(server)
    server.start()
    client = connect(server, "tok")
    try:
        assert client.reload().index_version == server.engine.pair.version
        # A round would have run (noted) or be about to (its thread alive): neither.
        started = {t.name for t in set(threading.enumerate()) - threads_before}
        assert not started & {"probe", "probe-after-reload"}, started
        assert rounds == [] and server.monitor.probe is None
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") is None
        # A round on demand still runs and publishes.
        assert server.monitor.run_probe(server.run_probe)[1] > 0.8
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") > 0.8
    finally:
        client.close()
        server.stop(0)


def test_scheduled_probe_rounds_run_at_start_and_after_a_reload(index_root):
    server = SearchServer(config(index_root, admin_token="tok", probe_interval_s=3600))
    rounds = noting_probes(server)
    server.start()
    client = connect(server, "tok")
    try:
        at_start = wait_for(lambda: server.monitor.probe)  # the first round runs at start
        assert rounds == ["probe"] and at_start[1] > 0.8
        client.reload()  # clears the figures of the pair it replaces; a round follows
        assert wait_for(lambda: server.monitor.probe)[1] > 0.8
        assert rounds == ["probe", "probe-after-reload"]  # the next scheduled one: in an hour
    finally:
        client.close()
        server.stop(0)


def test_probe_recall_gauge_drops_when_a_worse_index_is_swapped_in(index_root):
    worse = derived_version(index_root, shuffled_labels)
    server, client = start(index_root, admin_token="tok")  # probe rounds run here, not on a schedule
    try:
        good = server.monitor.run_probe(server.run_probe)
        assert good[1] > 0.8
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") == pytest.approx(good[1])
        client.reload(index_version=worse)
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") is None  # the old pair's figure
        dropped = server.monitor.run_probe(server.run_probe)[1]
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") == pytest.approx(dropped)
        assert dropped < good[1] - 0.3
        info = client.get_info()
        assert any(f.source == "probe" and f.k == 1 and f.value == pytest.approx(dropped) for f in info.recall_at_k)
    finally:
        client.close()
        server.stop(0)


def test_ann_fidelity_reflects_a_coarse_ivf_index(index_root):
    coarse = derived_version(index_root, coarse_ivf)
    requests = image_requests(index_root, 60, k=10)
    server, client = start(index_root, admin_token="tok", ann_sample_rate=1.0)
    try:
        for r in requests[:20]:
            client.search(r)
        assert server.monitor.ann_settled(timeout=60)  # every sampled query checked
        assert _gauge(server, "simsearch_ann_recall_at_k", k="10") == pytest.approx(1.0)
        client.reload(index_version=coarse)
        for r in requests:
            client.search(r)
        assert server.monitor.ann_settled(timeout=60)
        coarse_value = _gauge(server, "simsearch_ann_recall_at_k", k="10")
        assert coarse_value < 0.99
    finally:
        client.close()
        server.stop(0)


def test_labelled_traffic_and_feedback_feed_recall(index_root):
    items = ItemTable.read(artifacts.version_dir(index_root) / "items.parquet")
    server, client = start(index_root)
    try:
        for i in range(10):
            r = client.search_image(
                Path(items.paths[i]).read_bytes(), k=5, exclude_ids=[items.ids[i]], label=items.labels[i]
            )
            relevant = [n.id for n in r.neighbors if n.label == items.labels[i]]
            client.feedback(r.request_id, relevant)
        traffic = _gauge(server, "simsearch_recall_at_k", k="5", source="traffic")
        feedback = _gauge(server, "simsearch_recall_at_k", k="5", source="feedback")
        assert traffic > 0.5 and feedback == pytest.approx(traffic)
        r = client.search_image(Path(items.paths[0]).read_bytes(), k=5, label="no-such-label")
        assert _gauge(server, "simsearch_recall_at_k", k="5", source="traffic") < traffic
    finally:
        client.close()
        server.stop(0)


def test_watch_current_reloads_and_metrics_endpoint_serves_stages(index_root, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    other = derived_version(index_root, coarse_ivf)
    server, client = start(index_root, watch_current=True, watch_interval_s=0.2, metrics_port=metrics_port)
    try:
        (request,) = image_requests(index_root, 1)
        client.search(request)
        artifacts.set_current(index_root, other)
        # The watcher polls every 0.2 s; its reload is done (answers and metrics) once counted.
        wait_for(lambda: _gauge(server, "simsearch_reloads_total") == 2)
        assert client.search(request).index_version == other
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
        for stage in ("decode", "queue", "embed", "search"):
            assert f'simsearch_stage_latency_seconds_count{{stage="{stage}"}}' in text
        assert 'simsearch_requests_total{code="OK",method="Search",protocol="grpc"}' in text
        assert f'index_version="{other}"' in text
        assert "simsearch_reloads_total 2.0" in text
        # The Index builds dashboard follows the live version's manifest.
        built = artifacts.read_manifest(artifacts.version_dir(index_root, other))
        assert f'simsearch_index_build_rows{{state="indexed"}} {float(built["rows"]["indexed"])}' in text
        assert f"simsearch_index_build_duration_seconds {float(built['build_seconds'])}" in text
    finally:
        client.close()
        server.stop(0)


def test_tls_and_search_token(index_root, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(index_root),
            port=0,
            metrics_port=None,
            tls_cert=str(cert),
            tls_key=str(key),
            search_token="let-me-in",
            probe_interval_s=0,
            http_port=0,
        )
    )
    server.start()
    target = f"localhost:{server.port}"
    (request,) = image_requests(index_root, 1)
    try:
        with SearchClient(target, tls_ca=cert, token="let-me-in", timeout=60) as client:
            assert client.search(request).neighbors
        with SearchClient(target, tls_ca=cert, timeout=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.search(request)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert client.healthy()  # health stays open for probes
        with SearchClient(target, tls_ca=cert, token="wrong", timeout=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.search(request)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with SearchClient(target, timeout=2) as plaintext:
            with pytest.raises(grpc.RpcError):
                plaintext.search(request)
        # HTTP shares the certificate and the token.
        import requests

        https = f"https://localhost:{server.http_port}/v1/search"
        body = {"itemId": server.engine.pair.items.ids[0], "k": 3}
        answer = requests.post(https, json=body, verify=str(cert), headers={"Authorization": "Bearer let-me-in"})
        assert answer.status_code == 200 and len(answer.json()["neighbors"]) == 3
        assert requests.post(https, json=body, verify=str(cert), timeout=60).status_code == 401
        with pytest.raises(requests.ConnectionError):
            requests.post(https.replace("https:", "http:"), json=body, timeout=10)
    finally:
        server.stop(0)


# `python -m serving serve ARGS...`, its batcher paused from the start and let go only once
# SIGTERM's drain has begun (gRPC stopped taking calls): queries sent before the signal are
# then still queued when it comes, and answered during the drain, however fast or slow the
# machine. Everything else is the real command: its signal handler, its stop with a grace.
SERVE_PAUSED_UNTIL_DRAIN = """
import asyncio, sys
from serving import __main__ as cli
from serving.server import SearchApp

start = SearchApp.start

async def start_paused(self):
    self.batcher.pause()
    await start(self)
    stop_grpc = self.grpc_server.stop

    async def stop_then_resume(grace):
        stopping = asyncio.ensure_future(stop_grpc(grace))
        await asyncio.sleep(0)  # the stop's first step ran: no new calls from here on
        self.batcher.resume()
        await stopping

    self.grpc_server.stop = stop_then_resume

SearchApp.start = start_paused
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


def queue_depth(metrics_port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    except OSError:
        return None  # not listening yet
    depths = [float(line.split()[1]) for line in text.splitlines() if line.startswith("simsearch_queue_depth ")]
    return depths[0] if depths else None


def test_sigterm_drains_in_flight_requests(index_root):
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, metrics_port = ports
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE_PAUSED_UNTIL_DRAIN,
            "--index-root",
            str(index_root),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--probe-interval-s",
            "0",  # no probe round in the queue
            "--event-loop",
            "asyncio",  # the in-process tests run on uvloop, the default
            "--processes",
            "1",  # the hooks patch this process: a worker process would not carry them
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    requests = image_requests(index_root, 8)
    try:
        with SearchClient(f"127.0.0.1:{port}", timeout=60) as client:
            client.wait_ready(120)
            wait_for(client.healthy, timeout=120)
            with ThreadPoolExecutor(8) as pool:
                pending = [pool.submit(client.search, r) for r in requests]
                wait_for(lambda: queue_depth(metrics_port) == 8 or any(f.done() for f in pending))
                assert not any(f.done() for f in pending)  # all eight in flight, queued
                proc.send_signal(signal.SIGTERM)
                results = [f.result() for f in pending]
        assert all(r.neighbors for r in results)
        assert proc.wait(timeout=30) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert any("draining" in entry["msg"] for entry in logs)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_takedown_waits_for_requests_on_every_earlier_version(index_root):
    """RemoveItems returns once no request answers from any pair before the one it swapped in
    — also a pair a reload beside it swapped out (`--watch-current` loading the takedown's
    version first does that), not only the pair its own swap replaced."""
    server, client = start(index_root, admin_token="tok", batch_streams=1)
    try:
        gate = hold_inference(server)  # closed: a query waits in its inference thread
        held_id = ItemTable.read(artifacts.version_dir(index_root) / "items.parquet").ids[0]
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(client.search, image_requests(index_root, 1)[0])
            wait_for(lambda: gate.held == 1)
            client.reload()  # the held query's pair swapped out by a reload beside the takedown
            beside = server.engine.pair
            removal = pool.submit(client.remove_items, [held_id])
            wait_for(lambda: server.engine.pair.version != beside.version)
            time.sleep(0.5)
            assert not removal.done()  # the takedown's version is live; the held query still answers
            gate.open()
            assert held.result().neighbors
            assert removal.result().removed == 1
    finally:
        client.close()
        server.stop(grace=1)
