"""The gRPC server on loopback: answers, errors as status codes, health, reflection, auth."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from PIL import Image

from core.data.catalog import read_catalog
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from tests.support.images import encode, png_header_only

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def test_catalog(demo_run):
    return read_catalog(demo_run / "train" / "splits" / "test.csv")


def test_search_by_image_item_and_embedding_agree(served, test_catalog):
    _, client = served
    path, item_id = test_catalog.paths[0], test_catalog.ids[0]
    by_image = client.search_image(path, k=5, exclude_ids=[item_id])
    by_item = client.search_item(item_id, k=5)
    assert [n.id for n in by_item.neighbors] == [n.id for n in by_image.neighbors]
    assert item_id not in [n.id for n in by_item.neighbors]
    vector = client.embed(path.read_bytes()).embedding
    by_vector = client.search_embedding(vector, k=1)
    assert by_vector.neighbors[0].id == item_id
    assert by_image.model_id and by_image.index_version
    assert by_image.timings.total_ms > 0


def test_calls_without_a_deadline_are_answered(served, test_catalog):
    """grpcurl, h2load and bare stubs send no grpc-timeout: the server must not read that as an error."""
    server, _ = served
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.SimilaritySearchStub(channel)
        image = test_catalog.paths[0].read_bytes()
        assert len(stub.Search(pb.SearchRequest(image=image, k=3)).neighbors) == 3
        batch = stub.SearchBatch(pb.SearchBatchRequest(requests=[pb.SearchRequest(image=image, k=2)] * 3))
        assert [len(r.neighbors) for r in batch.responses] == [2, 2, 2]


def test_request_id_is_echoed_and_feedback_accepted(served, test_catalog):
    _, client = served
    response = client.search_image(test_catalog.paths[1], k=3, request_id="req-42")
    assert response.request_id == "req-42"
    assert client.feedback("req-42", [response.neighbors[0].id]).accepted
    with pytest.raises(grpc.RpcError) as err:
        client.feedback("never-sent", [])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # no id at all: said so, not "unknown or expired request_id ''"
        client.feedback("", [response.neighbors[0].id])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request_id is required")


@pytest.mark.parametrize(
    "request_kwargs, code, fragment",
    [
        ({"image": b"not an image", "k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "decode"),
        ({"image": b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "decode"),
        ({"image": b"", "k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ({"k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "no query"),
        ({"item_id": "no-such-item", "k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "unknown item"),
        ({"embedding": pb.Embedding(values=[1.0, 2.0]), "k": 5}, grpc.StatusCode.INVALID_ARGUMENT, "dimension"),
        ({"item_id": "x", "k": -3}, grpc.StatusCode.INVALID_ARGUMENT, "k must be within 1..50, got -3"),
        ({"item_id": "x", "k": 51}, grpc.StatusCode.INVALID_ARGUMENT, "k must be within 1..50, got 51"),
        ({"item_id": "x", "k": 5, "min_score": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "min_score"),
        ({"item_id": "x", "k": 5, "min_score": -1.01}, grpc.StatusCode.INVALID_ARGUMENT, "min_score"),
        ({"item_id": "x", "k": 5, "min_score": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "min_score"),
    ],
)
def test_bad_requests_get_status_codes_and_server_keeps_serving(served, test_catalog, request_kwargs, code, fragment):
    _, client = served
    with pytest.raises(grpc.RpcError) as err:
        client.search(pb.SearchRequest(**request_kwargs))
    assert err.value.code() == code
    assert fragment in err.value.details()
    assert client.search_item(test_catalog.ids[0], k=1).neighbors


def test_min_score_is_bounded_by_k_and_says_when_it_cut(served, test_catalog):
    _, client = served
    item = test_catalog.ids[0]
    # Every row reaches -1: k = 0 means up to max_k (50 here), and the answer says it was cut.
    everything = client.search_item(item, k=0, min_score=-1.0)
    assert len(everything.neighbors) == 50 and everything.truncated
    assert item not in [n.id for n in everything.neighbors]
    top = client.search_item(item, k=50)
    assert [n.id for n in everything.neighbors] == [n.id for n in top.neighbors]
    assert not top.truncated  # a plain top-k is never "cut"
    # Above its best neighbour's score nothing reaches: an empty answer, not an error.
    above = min(1.0, top.neighbors[0].score + 1e-4)
    none = client.search_item(item, k=0, min_score=above)
    assert len(none.neighbors) == 0 and not none.truncated
    # In a batch beside plain queries, each keeps its own bound.
    batch = client.search_batch(
        [
            pb.SearchRequest(item_id=item, k=3),
            pb.SearchRequest(item_id=item, k=4, min_score=-1.0),
            pb.SearchRequest(item_id=item, k=0, min_score=above),
        ]
    )
    assert [len(r.neighbors) for r in batch.responses] == [3, 4, 0]
    assert [r.truncated for r in batch.responses] == [False, True, False]


def test_query_command_takes_min_score(served, test_catalog):
    server, _ = served
    done = subprocess.run(
        [sys.executable, "-m", "serving", "query", str(test_catalog.paths[0]), "--target", f"127.0.0.1:{server.port}",
         "--k", "0", "--min-score", "-1", "--json"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (answer,) = json.loads(done.stdout)
    assert len(answer["neighbors"]) == 50 and answer["truncated"] is True  # every row reaches -1; max_k 50


def test_pixel_bomb_and_oversized_message_are_resource_exhausted(served):
    _, client = served
    with pytest.raises(grpc.RpcError) as err:
        client.search(pb.SearchRequest(image=encode(Image.new("L", (2000, 2000))), k=3))  # 4 Mpx > 1 Mpx limit
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pixels" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # past Pillow's own bomb threshold: still a size refusal
        client.search(pb.SearchRequest(image=png_header_only(20_000, 20_000), k=3))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pixel limit" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search(pb.SearchRequest(image=b"\0" * (3 * 1024 * 1024), k=3))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_get_info_health_and_reflection(served):
    server, client = served
    info = client.get_info()
    assert info.index_size == server.engine.pair.index.ntotal
    assert info.embedding_dim == 128 and info.limits.max_k == 50
    assert client.healthy() and client.healthy("simsearch.v1.SimilaritySearch")
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"simsearch.v1.SimilaritySearch", "simsearch.v1.IndexAdmin", "grpc.health.v1.Health"} <= names
    assert health_pb2.HealthCheckResponse.SERVING


def test_admin_reload_requires_token(served):
    server, client = served
    from serving.client import SearchClient

    with SearchClient(f"127.0.0.1:{server.port}") as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.reload()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with SearchClient(f"127.0.0.1:{server.port}", admin_token="wrong") as intruder:
        with pytest.raises(grpc.RpcError) as err:
            intruder.reload()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    reply = client.reload()
    assert reply.index_version == server.engine.pair.version
    with pytest.raises(grpc.RpcError) as err:
        client.reload(index_version="no-such-version")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.search_item(server.engine.pair.items.ids[0], k=1).neighbors  # old pair still serves


def test_server_waiting_for_an_index_is_unavailable_and_not_healthy(tmp_path, caplog):
    from serving.client import SearchClient
    from serving.config import ServerConfig
    from tests.support.server import SearchServer

    config = ServerConfig.flat(
        index_root=str(tmp_path), port=0, metrics_port=None, probe_interval_s=0, watch_current=True
    )
    server = SearchServer(config)
    with caplog.at_level(logging.WARNING, logger="serving.server"):
        server.start()
    try:
        with SearchClient(f"127.0.0.1:{server.port}", timeout=60) as client:  # a bound on a hang only
            assert not client.healthy()
            with pytest.raises(grpc.RpcError) as err:
                client.get_info()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=0)
    waiting = [r for r in caplog.records if "waiting for CURRENT to name a version (--watch-current)" in r.getMessage()]
    assert len(waiting) == 1, caplog.text  # said once, not at every look at CURRENT


def test_serve_on_a_folder_without_index_versions_is_refused_at_start(tmp_path):
    """A model folder given as --index-root served 503s for ever with a warning in the log
    (issue 40, item 13): without --watch-current there is nothing to wait for."""
    from tests.support.index import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    done = subprocess.run(
        [sys.executable, "-m", "serving", "serve", "--index-root", str(model), "--port", "0", "--metrics-port", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"error: {model} holds no index versions (it looks like a model folder: it holds model.onnx); an index "
        f"root holds versions/ and CURRENT, written by `python -m index build --index-root {model}`"
    ], done.stderr


def test_benchmark_load_generator_is_answered_ok(served, test_catalog, tmp_path):
    """bench_serving's load: gRPC-framed SearchRequests over raw HTTP/2 (h2load), no deadline."""
    from benchmarks.harness import grpc_body, h2load

    server, _ = served

    def answered(code: str) -> float:
        samples = server.metrics.requests.collect()[0].samples
        return sum(s.value for s in samples if s.labels == {"method": "Search", "code": code, "protocol": "grpc"})

    body = tmp_path / "search.grpc"
    body.write_bytes(grpc_body(test_catalog.paths[0].read_bytes()))
    ok_before, bad_before = answered("OK"), answered("INVALID_ARGUMENT") + answered("INTERNAL")
    result = h2load(server.port, body, concurrency=4, seconds=1, log=tmp_path / "h2load.log")
    assert result["queries"] > 0 and result["p50_ms"] > 0
    assert answered("OK") - ok_before >= result["queries"] - 4  # all but those cut off at the end
    assert answered("INVALID_ARGUMENT") + answered("INTERNAL") == bad_before
