"""Every index type answers every call: Flat, IVF-Flat, IVF-PQ (re-ranked from the stored
vectors) and HNSW versions of the demo catalog, each behind a real server on loopback."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from PIL import Image

from core.artifacts import layout as artifacts
from core.artifacts.layout import read_manifest
from core.data.catalog import read_catalog
from index.build.build import run_build
from index.build.config import BuildConfig
from protos.simsearch.v1 import search_pb2 as pb
from tests.support.server import start

pytestmark = pytest.mark.slow

FACTORIES = {
    "flat": ("Flat", {}),
    "ivf-flat": ("IVF32,Flat", {"nprobe": 8}),
    "ivf-pq-reranked": ("IVF32,PQ8", {"nprobe": 8}),  # re-ranking is on by default for PQ codes
    "hnsw": ("HNSW16", {"efSearch": 64}),
}


@pytest.fixture(scope="module")
def catalog(demo_run):
    return read_catalog(demo_run / "train" / "splits" / "test.csv")


@pytest.fixture(scope="module", params=list(FACTORIES), ids=list(FACTORIES))
def served_version(request, demo_run, catalog, tmp_path_factory):
    factory, params = FACTORIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    run_build(
        BuildConfig(
            model=str(demo_run / "model"),
            index_root=str(root),
            catalog=str(demo_run / "train" / "splits" / "test.csv"),
            factory=factory,
            search_params=params,
        ),
        progress=False,
    )
    # Every answer re-run exactly (the ANN gauge covers all of them); probe rounds off, run by the test.
    server, client = start(root, admin_token="t", ann_sample_rate=1.0, probe_size=40)
    yield request.param, server, client
    client.close()
    server.stop(grace=1)


def gauge(server, name: str, **labels) -> float:
    metric = getattr(server.metrics, name)
    return next(s.value for s in metric.collect()[0].samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_call_is_answered(served_version, catalog):
    kind, server, client = served_version
    manifest = read_manifest(artifacts.version_dir(server.config.index_root))
    assert manifest["factory"] == FACTORIES[kind][0]
    assert ("rerank" in manifest["search_params"]) == (kind == "ivf-pq-reranked")
    with Image.open(artifacts.version_dir(server.config.index_root) / artifacts.NEIGHBOURS_FILE) as sheet:
        assert sheet.format == "PNG" and sheet.size == (9 * 108, 12 * 124)  # 12 queries × (query + 8)
    path, item_id = catalog.paths[3], catalog.ids[3]

    by_item = client.search_item(item_id, k=5)
    assert len(by_item.neighbors) == 5 and item_id not in [n.id for n in by_item.neighbors]
    by_image = client.search_image(path, k=5, exclude_ids=[item_id], request_id="r1")
    assert [n.id for n in by_image.neighbors] == [n.id for n in by_item.neighbors]
    vector = client.embed(path.read_bytes()).embedding
    assert client.search_embedding(vector, k=1).neighbors[0].id == item_id
    batch = client.search_batch([pb.SearchRequest(item_id=i, k=3) for i in catalog.ids[:4]])
    assert [len(r.neighbors) for r in batch.responses] == [3, 3, 3, 3]
    assert client.feedback("r1", [by_image.neighbors[0].id]).accepted
    with pytest.raises(grpc.RpcError) as err:
        client.search_item("no-such-item", k=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # The ANN gauge compares answers with exact search over the stored vectors.
    for r in range(0, 120, 3):
        client.search_image(catalog.paths[r], k=10, exclude_ids=[catalog.ids[r]])
    assert server.monitor.ann_settled(60)
    ann = gauge(server, "ann_recall_at_k", k="10")
    assert ann == 1.0 if kind == "flat" else ann > 0.8
    probe = server.monitor.run_probe(server.run_probe)
    assert probe and 0 < probe[1] == gauge(server, "recall_at_k", k="1", source="probe")

    reply = client.reload()
    assert reply.index_version == manifest["version"]
    assert [n.id for n in client.search_item(item_id, k=5).neighbors] == [n.id for n in by_item.neighbors]


def test_item_search_reads_the_stored_vector_not_the_index(served_version, catalog):
    """An IVF index has no direct map (reconstruct fails) and PQ codes decode only roughly: the
    query vector of a search by id is the stored one, so it finds the item itself first."""
    _, server, client = served_version
    pair = server.engine.pair
    row = pair.items.row_of(catalog.ids[7])
    stored = np.load(pair.directory / artifacts.EMBEDDINGS_FILE)[row]
    found = server.service.checks.item(pair, catalog.ids[7])
    assert found.row == row
    np.testing.assert_array_equal(found.vector, stored)
    assert client.search_embedding(stored.tolist(), k=1).neighbors[0].id == catalog.ids[7]


def test_min_score_answers_every_neighbour_at_or_above_it(served_version, catalog):
    """Range search on each index type: every answer reaches min_score with its exact score,
    exact search's rows all answer (Flat: exactly those; an ANN index: nearly all), and k cuts
    the answer to its best k, saying so."""
    kind, server, client = served_version
    pair = server.engine.pair
    vectors = np.load(pair.directory / artifacts.EMBEDDINGS_FILE)
    ids = list(pair.items.ids)
    found = expected = 0
    for r in (3, 11, 29, 40):
        row = pair.items.row_of(catalog.ids[r])
        exact = vectors @ vectors[row]
        exact[row] = -np.inf  # a search by id leaves the item out
        ranked = np.sort(exact)[::-1]
        min_score = float(ranked[9] + ranked[10]) / 2  # between the 10th and 11th: ten rows reach it
        answer = client.search_item(catalog.ids[r], k=0, min_score=min_score)  # k = 0: up to max_k
        assert not answer.truncated and 0 < len(answer.neighbors) <= 10
        rows = [pair.items.row_of(n.id) for n in answer.neighbors]
        scores = np.array([n.score for n in answer.neighbors])
        assert (scores >= min_score).all() and (np.diff(scores) <= 0).all()
        np.testing.assert_allclose(scores, exact[rows], atol=1e-5)  # PQ codes re-ranked: exact scores
        truth = {ids[i] for i in np.flatnonzero(exact >= min_score)}
        if kind == "flat":
            assert {n.id for n in answer.neighbors} == truth
        found += len(truth & {n.id for n in answer.neighbors})
        expected += len(truth)

        cut = client.search_item(catalog.ids[r], k=3, min_score=min_score)
        assert cut.truncated == (len(answer.neighbors) > 3) and len(cut.neighbors) == min(3, len(answer.neighbors))
        assert [n.id for n in cut.neighbors] == [n.id for n in answer.neighbors[:3]]
    assert found >= 0.8 * expected, (found, expected)

    # An image query and an embedding query take the same path.
    r = 3
    by_image = client.search_image(catalog.paths[r], k=0, min_score=0.5, exclude_ids=[catalog.ids[r]])
    by_item = client.search_item(catalog.ids[r], k=0, min_score=0.5)
    assert [n.id for n in by_image.neighbors][:5] == [n.id for n in by_item.neighbors][:5]
    assert all(n.score >= 0.5 for n in by_image.neighbors)
    with pytest.raises(grpc.RpcError) as err:
        client.search_item(catalog.ids[r], k=5, min_score=1.01)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_score" in err.value.details()


def test_an_answer_short_of_k_says_truncated(served_version, catalog):
    """An approximate index may run out of candidates (IVF probes 8 of 32 lists here): fewer than
    k neighbours though the index holds more is `truncated`, never a silent short answer; all
    there is (k above the index's size) is not."""
    kind, server, client = served_version
    size = client.get_info().index_size
    k = min(size, server.config.limits.max_k)
    answer = client.search_item(catalog.ids[0], k=k)
    short = len(answer.neighbors) < min(k, size - 1)  # the query's own item is left out
    assert answer.truncated == short
    if kind.startswith("ivf"):
        assert short  # the case this guards is exercised
    if kind == "flat" and size - 1 < server.config.limits.max_k:
        everything = client.search_item(catalog.ids[0], k=server.config.limits.max_k)
        assert len(everything.neighbors) == size - 1 and not everything.truncated
