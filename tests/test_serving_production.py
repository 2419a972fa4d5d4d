"""Production behaviour of the server: batching, overload, deadlines, hot reload under load,
online Recall@K, TLS, tokens, graceful shutdown. Real servers on loopback, real ONNX Runtime and
faiss over the model and index the session's demo chain built."""

from __future__ import annotations

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from index import artifacts
from index.faiss_index import build_index, save_index
from index.items import ItemTable
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient
from serving.server import SearchServer, ServerConfig
from tests.test_preprocess import encode

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def index_root(demo_run, tmp_path) -> Path:
    root = tmp_path / "index"
    shutil.copytree(demo_run / "index", root)
    return root


def start(index_root: Path, **overrides) -> tuple[SearchServer, SearchClient]:
    defaults = dict(index_root=str(index_root), port=0, metrics_port=None, probe_interval_s=3600, probe_size=100)
    server = SearchServer(ServerConfig(**{**defaults, **overrides}))
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=20, admin_token=overrides.get("admin_token"))
    client.wait_ready(20)
    return server, client


def derived_version(root: Path, mutate) -> str:
    """A new (not live) version built from the live one, changed by `mutate(staging_dir)`."""
    live = artifacts.version_dir(root)
    staging = artifacts.index_staging_dir(root)
    for name in ("index.faiss", "items.parquet", "embeddings.npy", "manifest.json"):
        shutil.copy2(live / name, staging / name)
    manifest = json.loads((staging / "manifest.json").read_text())
    mutate(staging, manifest)
    version = artifacts.new_version_name(manifest["index_id"])
    manifest["version"] = version
    artifacts.write_json_atomic(staging / "manifest.json", manifest)
    artifacts.publish_version(root, staging, version, make_current=False)
    return version


def shuffled_labels(staging: Path, manifest: dict) -> None:
    items = ItemTable.read(staging / "items.parquet")
    rng = np.random.default_rng(1)
    items.labels = list(rng.permutation(items.labels))
    items.write(staging / "items.parquet")
    manifest["index_id"] = "shuffledlabels01"


def coarse_ivf(staging: Path, manifest: dict) -> None:
    vectors = np.load(staging / "embeddings.npy")
    save_index(build_index(vectors, "IVF64,Flat", {"nprobe": 1}), staging / "index.faiss")
    manifest.update(index_id="coarseivf0000001", factory="IVF64,Flat", search_params={"nprobe": 1})


def image_requests(root: Path, n: int, k: int = 5) -> list[pb.SearchRequest]:
    items = ItemTable.read(artifacts.version_dir(root) / "items.parquet")
    return [
        pb.SearchRequest(image=Path(items.paths[i]).read_bytes(), k=k, exclude_ids=[items.ids[i]]) for i in range(n)
    ]


def concurrent_then_single(
    server: SearchServer, client: SearchClient, requests: list[pb.SearchRequest]
) -> tuple[list[pb.SearchResponse], list[pb.SearchResponse]]:
    """The answers to `requests` sent 12 at once, then one at a time; the server stopped after."""
    try:
        with ThreadPoolExecutor(12) as pool:
            batched = list(pool.map(client.search, requests))
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
    server, client = start(index_root, max_batch_size=16, max_wait_ms=20)
    try:
        _wait_for(lambda: server.monitor.probe)  # the first probe round runs at start
        total0, count0 = batch_totals(server)
        with ThreadPoolExecutor(16) as pool:
            batched = list(pool.map(client.search, requests))
        total, count = batch_totals(server)
        assert total - total0 == 48 and count - count0 < 48, "concurrent queries must share batches"
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
    server, client = start(index_root, max_batch_size=8, max_wait_ms=20, **flags)
    placed: list[str] = []
    decoder = server.servicer.decoder

    def noting(pair, image):  # the real choice, noted
        placed.append(decoder(pair, image))
        return placed[-1]

    _wait_for(lambda: server.monitor.probe)  # the first probe round runs at start
    server.servicer.decoder = noting
    batched, single = concurrent_then_single(server, client, requests)
    # The pool takes images only while the batcher is busy: a query alone goes to the inference thread.
    assert placement in placed, placed
    assert set(placed) <= {placement, "inference"}
    assert_same_answers(batched, single)


def test_a_server_embedding_batches_in_small_runs_answers_like_single_queries(index_root):
    requests = image_requests(index_root, 24)
    server, client = start(index_root, max_batch_size=8, max_wait_ms=20, run_rows=2)
    assert server.engine.pair.embedder.run_rows == 2
    batched, single = concurrent_then_single(server, client, requests)
    assert_same_answers(batched, single)


def test_images_decode_where_they_cost_least(index_root):
    """Tiny images on the loop, small ones in the inference thread, large ones in the pool while
    a batch is running or filling — and in the inference thread when it would take them at once."""
    server, client = start(index_root, max_batch_size=8, max_wait_ms=400, inference_decode_pixels=100 * 100)
    servicer, pair = server.servicer, server.engine.pair
    sizes = {"tiny": (28, 28), "small": (100, 100), "large": (101, 100)}
    images = {name: server.engine.open_image(encode(Image.new("L", size))) for name, size in sizes.items()}
    try:
        _wait_for(lambda: server.monitor.probe)  # the first probe round runs at start
        idle = {name: servicer.decoder(pair, image) for name, image in images.items()}
        waiting = threading.Thread(target=client.search, args=(image_requests(index_root, 1)[0],))
        waiting.start()
        _wait_for(lambda: not server.batcher.decodes_cheaply)  # its batch waits up to 400 ms for more
        busy = {name: servicer.decoder(pair, image) for name, image in images.items()}
        waiting.join()
    finally:
        client.close()
        server.stop(0)
    assert idle == {"tiny": "loop", "small": "inference", "large": "inference"}
    assert busy == {"tiny": "loop", "small": "inference", "large": "pool"}


def test_embed_calls_are_batched_with_queries_and_equal_the_model(index_root):
    requests = image_requests(index_root, 16)
    server, client = start(index_root, max_batch_size=32, max_wait_ms=50)
    try:
        _wait_for(lambda: server.monitor.probe)
        total0, count0 = batch_totals(server)
        with ThreadPoolExecutor(32) as pool:
            embeds = [pool.submit(client.embed, r.image) for r in requests]
            searches = [pool.submit(client.search, r) for r in requests]
            embedded = [f.result() for f in embeds]
            assert all(f.result().neighbors for f in searches)
        total, count = batch_totals(server)
        assert total - total0 == 32 and count - count0 < 32, "embeds and queries must share batches"
        pair = server.engine.pair
        for request, answer in zip(requests, embedded, strict=True):
            array = server.engine.model_input(pair, server.engine.open_image(request.image))
            direct = server.engine.embed(pair, [array])[0]
            np.testing.assert_allclose(answer.embedding, direct, atol=1e-5)
            assert answer.timings.embed_ms > 0 and answer.timings.search_ms == 0
    finally:
        client.close()
        server.stop(0)


def test_full_queue_answers_resource_exhausted_at_once(index_root):
    requests = image_requests(index_root, 40)
    server, client = start(index_root, max_batch_size=1, max_wait_ms=0, max_queue=2, workers=40)
    codes = []
    try:
        with ThreadPoolExecutor(40) as pool:

            def call(r):
                try:
                    client.search(r)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    return exc.code()

            codes = list(pool.map(call, requests))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert grpc.StatusCode.OK in codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert client.search(requests[0]).neighbors  # still serving
    finally:
        client.close()
        server.stop(0)


def test_old_connections_are_recycled_without_failing_a_call(index_root):
    # Behind an L4 load balancer a client stays on the replica it first reached unless the
    # server ends the connection now and then: with a 1 s age, calls over 4 s must see the
    # channel reconnect and every one of them must still succeed.
    server, client = start(index_root, max_connection_age_s=1.0, max_connection_age_grace_s=1.0)
    states: list[grpc.ChannelConnectivity] = []
    client.channel.subscribe(states.append)
    requests = image_requests(index_root, 4)
    try:
        answered, deadline = 0, time.monotonic() + 4.0
        while time.monotonic() < deadline:
            assert client.search(requests[answered % 4]).neighbors
            answered += 1
            time.sleep(0.02)
    finally:
        client.close()
        server.stop(grace=1)
    assert answered > 20
    reconnects = sum(1 for a, b in itertools.pairwise(states) if a == grpc.ChannelConnectivity.READY and b != a)
    assert reconnects >= 2, states  # with max_connection_age_s=0: none


def test_connection_lifetime_flags_become_grpc_options(tmp_path):
    from serving.__main__ import server_config

    defaults = dict(server_config(["--index-root", str(tmp_path)]).connection_options)
    assert defaults["grpc.max_connection_age_ms"] == 300_000 and defaults["grpc.keepalive_time_ms"] == 60_000
    off = dict(
        server_config(
            ["--index-root", str(tmp_path), "--max-connection-age-s", "0", "--keepalive-s", "0"]
        ).connection_options
    )
    assert "grpc.max_connection_age_ms" not in off and "grpc.keepalive_time_ms" not in off
    assert off["grpc.http2.min_ping_interval_without_data_ms"] == 10_000  # clients may still ping


def test_request_past_its_deadline_is_cancelled(index_root):
    (request,) = image_requests(index_root, 1)
    server, client = start(index_root, max_batch_size=64, max_wait_ms=1500)
    try:
        _wait_for(lambda: server.monitor.probe)  # the start-up probe round must not fill the batch
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.search(request, timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - started < 1.0
        assert client.search(request, timeout=10).neighbors
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            client.embed(request.image, timeout=0.2)  # Embed waits in the same batches
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - started < 1.0
    finally:
        client.close()
        server.stop(0)


def test_reload_under_load_fails_nothing_and_versions_stay_consistent(index_root):
    other = derived_version(index_root, coarse_ivf)
    first = artifacts.current_version(index_root)
    requests = image_requests(index_root, 20)
    server, client = start(index_root, admin_token="tok", max_wait_ms=2)
    stop = threading.Event()
    answers, failures = [], []

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
        time.sleep(0.5)
        for version in (other, first, other):
            assert client.reload(index_version=version).index_version == version
            time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
    finally:
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


def _wait_for(predicate, timeout: float = 60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_probe_recall_gauge_drops_when_a_worse_index_is_swapped_in(index_root):
    worse = derived_version(index_root, shuffled_labels)
    server, client = start(index_root, admin_token="tok")
    try:
        good = server.monitor.run_probe(server.run_probe)
        assert good[1] > 0.8
        assert _gauge(server, "simsearch_recall_at_k", k="1", source="probe") == pytest.approx(good[1])
        client.reload(index_version=worse)
        dropped = _wait_for(lambda: _gauge(server, "simsearch_recall_at_k", k="1", source="probe"))
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
        exact = _wait_for(lambda: _gauge(server, "simsearch_ann_recall_at_k", k="10"))
        assert exact == pytest.approx(1.0)
        client.reload(index_version=coarse)
        for r in requests:
            client.search(r)
        coarse_value = _wait_for(lambda: _gauge(server, "simsearch_ann_recall_at_k", k="10"))
        time.sleep(0.5)
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
        _wait_for(lambda: client.search(request).index_version == other, timeout=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        for stage in ("decode", "queue", "embed", "search"):
            assert f'simsearch_stage_latency_seconds_count{{stage="{stage}"}}' in text
        assert 'simsearch_requests_total{code="OK",method="Search"}' in text
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
        ServerConfig(
            index_root=str(index_root),
            port=0,
            metrics_port=None,
            tls_cert=str(cert),
            tls_key=str(key),
            search_token="let-me-in",
        )
    )
    server.start()
    target = f"localhost:{server.port}"
    (request,) = image_requests(index_root, 1)
    try:
        with SearchClient(target, tls_ca=cert, token="let-me-in") as client:
            assert client.search(request).neighbors
        with SearchClient(target, tls_ca=cert) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.search(request)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert client.healthy()  # health stays open for probes
        with SearchClient(target, tls_ca=cert, token="wrong") as client:
            with pytest.raises(grpc.RpcError) as err:
                client.search(request)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with SearchClient(target, timeout=2) as plaintext:
            with pytest.raises(grpc.RpcError):
                plaintext.search(request)
    finally:
        server.stop(0)


def test_sigterm_drains_in_flight_requests(index_root):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving",
            "serve",
            "--index-root",
            str(index_root),
            "--port",
            str(port),
            "--max-wait-ms",
            "800",
            "--max-batch-size",
            "64",
            "--event-loop",
            "asyncio",  # the in-process tests run on uvloop, the default
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    requests = image_requests(index_root, 8)
    try:
        with SearchClient(f"127.0.0.1:{port}", timeout=30) as client:
            client.wait_ready(60)
            _wait_for(client.healthy, timeout=60)
            with ThreadPoolExecutor(8) as pool:
                pending = [pool.submit(client.search, r) for r in requests]
                time.sleep(0.3)  # the requests are now waiting in the 800 ms batch window
                proc.send_signal(signal.SIGTERM)
                results = [f.result() for f in pending]
        assert all(r.neighbors for r in results)
        assert proc.wait(timeout=30) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert any("draining" in entry["msg"] for entry in logs)
    finally:
        if proc.poll() is None:
            proc.kill()
