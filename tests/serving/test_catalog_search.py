"""Search shaped like a catalog, end to end on a real server (gRPC and HTTP/JSON): items with
several images (grouped answers), queries with several parts (Rocchio), queries by region, and
the catalog's bbox column — with every bad input answered INVALID_ARGUMENT / 400 naming the part
or field."""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from core.artifacts.index_manifest import IndexManifest
from core.data.catalog import CatalogError, read_catalog
from index.build.build import run_build
from index.build.config import BuildConfig
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient
from serving.config import ServerConfig
from tests.support.index import write_tiny_model
from tests.support.server import SearchServer

ITEMS, PER_ITEM, SIDE = 24, 3, 16


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def item_pixels(item: int, shot: int) -> np.ndarray:
    """An item's photo: its own colour pattern, each shot with a little noise of its own."""
    base = np.random.default_rng(item).integers(0, 256, (SIDE, SIDE, 3))
    noise = np.random.default_rng(1000 * item + shot + 1).integers(-12, 13, (SIDE, SIDE, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def write_catalog(folder: Path, bbox: dict[int, str] | None = None, items: int = ITEMS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in range(items):
        for shot in range(PER_ITEM):
            path = folder / f"p{item:02d}-{shot}.png"
            path.write_bytes(png(item_pixels(item, shot)))
            row = {"id": f"p{item:02d}-{shot}", "path": path.name, "item": f"p{item:02d}", "shade": str(item % 2)}
            row["bbox"] = (bbox or {}).get(len(rows), "")
            rows.append(row)
    catalog = folder / "catalog.csv"
    with open(catalog, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return catalog


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalog")
    model = write_tiny_model(tmp / "model", dim=16)
    catalog = write_catalog(tmp / "images")
    root = tmp / "index"
    run_build(
        BuildConfig(
            model=str(model), index_root=str(root), catalog=str(catalog), filterable=["shade"], min_ann_recall=0
        ),
        progress=False,
    )
    config = ServerConfig.flat(
        index_root=str(root), port=0, http_port=0, metrics_port=None, probe_interval_s=0, max_query_parts=4
    )
    server = SearchServer(config)
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60)
    client.wait_ready(60)
    yield server, client, root, tmp
    server.stop()


def groups_of(response: pb.SearchResponse) -> list[str]:
    """The groups of an answer in order (its neighbours come group by group)."""
    order: list[str] = []
    for n in response.neighbors:
        if not order or order[-1] != n.group:
            order.append(n.group)
    return order


def invalid(client: SearchClient, request: pb.SearchRequest) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        client.search(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details()


def test_the_item_column_is_the_default_grouping(served):
    server, client, root, _ = served
    manifest = IndexManifest.read(IndexVersion.open(root).directory)
    assert manifest.item_field == "item" and "item" in manifest.filterable
    # The build's sample queries by item: each photo finds its item's other photos first.
    assert set(manifest.quality.item_recall_at_k) == {"1", "2", "4", "8"}
    assert manifest.quality.item_recall_at_k["1"] == 1.0
    info = client.get_info()
    assert info.item_field == "item" and info.limits.max_per_group == 16 and info.limits.max_query_parts == 4
    query = png(item_pixels(5, 9))
    answer = client.search(pb.SearchRequest(image=query, k=6))
    assert answer.group_by == "item"
    groups = groups_of(answer)
    assert len(groups) == len(set(groups)) == 6 == len(answer.neighbors)
    assert groups[0] == "p05" and not answer.truncated
    # Image by image the top 6 hold the item's 3 photos: grouping is what spread them.
    plain = client.search(pb.SearchRequest(image=query, k=6, group_by=""))
    assert plain.group_by == "" and [n.id.split("-")[0] for n in plain.neighbors[:3]] == ["p05"] * 3
    two = client.search(pb.SearchRequest(image=query, k=4, per_group=2))
    assert groups_of(two) == groups[:4] and len(two.neighbors) == 8
    assert all(a.group == b.group for a, b in zip(two.neighbors[::2], two.neighbors[1::2], strict=True))
    scores = [n.score for n in two.neighbors[::2]]
    assert scores == sorted(scores, reverse=True)


def test_grouping_with_filters_and_a_short_answer(served):
    _, client, _, _ = served
    query = png(item_pixels(4, 9))
    even = pb.Filter(must=[pb.Condition(field="shade", value="0")])
    answer = client.search(pb.SearchRequest(image=query, k=100, filter=even))
    assert len(groups_of(answer)) == ITEMS // 2 and answer.truncated  # 12 items match, 100 asked
    by_shade = client.search(pb.SearchRequest(image=query, k=5, group_by="shade", per_group=3))
    assert groups_of(by_shade) == ["0", "1"] and by_shade.truncated and len(by_shade.neighbors) == 6


def test_an_item_query_leaves_its_item_out(served):
    _, client, _, _ = served
    answer = client.search(pb.SearchRequest(item_id="p07-1", k=5))
    assert "p07" not in groups_of(answer) and len(groups_of(answer)) == 5


def test_several_positive_photos_and_a_negative(served):
    _, client, _, _ = served
    parts = [pb.QueryPart(image=png(item_pixels(9, 10 + s))) for s in range(3)]
    answer = client.search(pb.SearchRequest(parts=parts, k=3))
    assert groups_of(answer)[0] == "p09"
    # Like p03-0 but not like p11-0, p11 weighing twice: the query is the documented formula,
    # normalise(e(p03-0) - 2 e(p11-0)), and both parts' items are left out.
    _, _, root, _ = served
    version = IndexVersion.open(root)
    e = {i: version.vector(version.row_of(i)) for i in ("p03-0", "p11-0")}
    contrast = client.search(
        pb.SearchRequest(
            parts=[pb.QueryPart(item_id="p03-0"), pb.QueryPart(item_id="p11-0", negative=True, weight=2.0)], k=ITEMS
        )
    )
    q = e["p03-0"] - 2.0 * e["p11-0"]
    own = [f"p{i}-{s}" for i in ("03", "11") for s in range(PER_ITEM)]
    expected = client.search(
        pb.SearchRequest(embedding=pb.Embedding(values=(q / np.linalg.norm(q)).tolist()), exclude_ids=own, k=ITEMS)
    )
    assert groups_of(contrast) == groups_of(expected) and len(groups_of(contrast)) == ITEMS - 2
    np.testing.assert_allclose([n.score for n in contrast.neighbors], [n.score for n in expected.neighbors], atol=1e-5)
    alone = client.search(pb.SearchRequest(parts=[pb.QueryPart(item_id="p03-0", weight=2.0)], k=4))
    assert groups_of(alone) == groups_of(client.search(pb.SearchRequest(item_id="p03-0", k=4)))


def test_a_region_searches_for_its_crop(served):
    _, client, _, _ = served
    scene = np.zeros((40, 60, 3), dtype=np.uint8)
    scene[10:26, 30:46] = item_pixels(13, 0)
    region = pb.Region(x=30, y=10, width=16, height=16)
    cropped = client.search(pb.SearchRequest(image=png(scene), region=region, k=3, group_by=""))
    direct = client.search(pb.SearchRequest(image=png(item_pixels(13, 0)), k=3, group_by=""))
    assert [n.id for n in cropped.neighbors] == [n.id for n in direct.neighbors]
    assert cropped.neighbors[0].id == "p13-0"
    np.testing.assert_allclose([n.score for n in cropped.neighbors], [n.score for n in direct.neighbors], atol=1e-5)


def test_bad_requests_name_the_part_or_field(served):
    _, client, _, _ = served
    image = png(item_pixels(1, 0))
    assert "group_by: 'colour' is not a declared field" in invalid(
        client, pb.SearchRequest(image=image, k=3, group_by="colour")
    )
    assert "per_group must be within 1..16" in invalid(client, pb.SearchRequest(image=image, k=3, per_group=17))
    assert "per_group must be within" in invalid(client, pb.SearchRequest(image=image, k=3, per_group=-1))
    assert "per_group must be within 1..16, got 0" in invalid(client, pb.SearchRequest(image=image, k=3, per_group=0))
    negative = [pb.QueryPart(image=image, negative=True)]
    assert "all negative" in invalid(client, pb.SearchRequest(parts=negative, k=3))
    nan = [pb.QueryPart(image=image, weight=float("nan"))]
    assert "parts[0]: weight must be a finite number above 0" in invalid(client, pb.SearchRequest(parts=nan, k=3))
    zero = [pb.QueryPart(image=image, weight=0.0)]
    assert "parts[0]: weight" in invalid(client, pb.SearchRequest(parts=zero, k=3))
    many = [pb.QueryPart(image=image)] * 5
    assert "5 query parts exceed the maximum of 4" in invalid(client, pb.SearchRequest(parts=many, k=3))
    broken = [pb.QueryPart(image=image), pb.QueryPart(image=b"not an image")]
    assert "parts[1]: cannot decode image" in invalid(client, pb.SearchRequest(parts=broken, k=3))
    cancel = [pb.QueryPart(item_id="p01-0"), pb.QueryPart(item_id="p01-0", negative=True, weight=1.0)]
    assert "cancel out" in invalid(client, pb.SearchRequest(parts=cancel, k=3))
    on_embedding = [pb.QueryPart(embedding=pb.Embedding(values=[1.0] * 16), region=pb.Region(width=9, height=9))]
    assert "parts[0]: a region crops an image" in invalid(client, pb.SearchRequest(parts=on_embedding, k=3))
    assert "region crops an image query" in invalid(
        client, pb.SearchRequest(item_id="p01-0", region=pb.Region(width=9, height=9), k=3)
    )
    outside = pb.Region(x=10, y=0, width=16, height=16)
    assert "reaches outside the 16x16 image" in invalid(client, pb.SearchRequest(image=image, region=outside, k=3))
    assert "is empty" in invalid(client, pb.SearchRequest(image=image, region=pb.Region(width=0, height=5), k=3))
    tiny = pb.Region(x=0, y=0, width=4, height=4)
    assert "under the minimum of 8 pixels" in invalid(client, pb.SearchRequest(image=image, region=tiny, k=3))
    both = pb.SearchRequest(image=image, parts=[pb.QueryPart(image=image)], k=3)
    assert "either image or parts" in invalid(client, both)


def test_http_speaks_the_same_catalog_search(served):
    server, client, _, _ = served
    base = f"http://127.0.0.1:{server.http_port}"
    query = item_pixels(5, 9)
    body = {
        "k": 4,
        "perGroup": 2,
        "parts": [{"image": __import__("base64").b64encode(png(query)).decode()}],
    }
    request = urllib.request.Request(
        f"{base}/v1/search", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    answer = json.load(urllib.request.urlopen(request, timeout=60))
    grpc_answer = client.search(pb.SearchRequest(image=png(query), k=4, per_group=2))
    assert answer["groupBy"] == "item"
    assert [n["id"] for n in answer["neighbors"]] == [n.id for n in grpc_answer.neighbors]
    assert [n["group"] for n in answer["neighbors"]] == [n.group for n in grpc_answer.neighbors]
    scene = np.zeros((40, 60, 3), dtype=np.uint8)
    scene[10:26, 30:46] = item_pixels(13, 0)
    upload = urllib.request.Request(
        f"{base}/v1/search/image?k=2&groupBy=&region=30,10,16,16",
        data=png(scene),
        headers={"Content-Type": "image/png"},
    )
    cropped = json.load(urllib.request.urlopen(upload, timeout=60))
    assert cropped["neighbors"][0]["id"] == "p13-0" and cropped["groupBy"] == ""
    bad = urllib.request.Request(
        f"{base}/v1/search/image?k=2&region=50,10,16,16", data=png(scene), headers={"Content-Type": "image/png"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(bad, timeout=60)
    assert caught.value.code == 400
    assert "reaches outside the 60x40 image" in json.load(caught.value)["error"]["message"]


def test_bbox_rows_embed_their_crop(served, tmp_path):
    _, _, _, tmp = served
    model = tmp / "model"
    folder = tmp_path / "boxed"
    folder.mkdir()
    scene = np.zeros((40, 60, 3), dtype=np.uint8)
    scene[10:26, 30:46] = item_pixels(2, 0)
    Image.fromarray(scene).save(folder / "scene.png")
    Image.fromarray(item_pixels(2, 0)).save(folder / "product.png")
    catalog = folder / "catalog.csv"
    catalog.write_text('id,path,bbox\nscene,scene.png,"30,10,16,16"\nproduct,product.png,\n')
    root = tmp_path / "index"
    run_build(
        BuildConfig(model=str(model), index_root=str(root), catalog=str(catalog), min_ann_recall=0), progress=False
    )
    vectors = np.load(IndexVersion.open(root).directory / "embeddings.npy")
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)  # the scene's row is its crop
    catalog.write_text('id,path,bbox\nscene,scene.png,"50,10,16,16"\nproduct,product.png,"0,0,nine,9"\n')
    with pytest.raises(CatalogError, match=r"1 row\(s\) with a bad bbox \(row 2: '0,0,nine,9' is not four numbers"):
        read_catalog(catalog)
    catalog.write_text('id,path,bbox\nscene,scene.png,"50,10,16,16"\nproduct,product.png,\n')
    with pytest.raises(CatalogError, match=r"1 row\(s\) whose bbox does not fit the image \(row 1: region"):
        run_build(
            BuildConfig(model=str(model), index_root=str(tmp_path / "other"), catalog=str(catalog), min_ann_recall=0),
            progress=False,
        )
    assert not (tmp_path / "other" / "CURRENT").exists()


def test_the_probe_measures_item_recall_online(served):
    server, client, _, _ = served
    assert server.run_probe() is None  # no labels: nothing for the image-level probe to score
    figures = {f.k: f.value for f in client.get_info().recall_at_k if f.source == "probe_items"}
    assert set(figures) == set(server.config.monitor.ks) and figures[1] == 1.0
    assert server.monitor.probe_items == figures


def test_a_batch_groups_each_query_to_its_own_k(served):
    _, client, _, _ = served
    image = png(item_pixels(6, 9))
    requests = [
        pb.SearchRequest(image=image, k=3),
        pb.SearchRequest(image=image, k=7, per_group=2),
        pb.SearchRequest(image=image, k=5, group_by=""),
        pb.SearchRequest(parts=[pb.QueryPart(image=image), pb.QueryPart(item_id="p20-0", negative=True)], k=4),
    ]
    answers = client.search_batch(requests).responses
    assert [len(groups_of(a)) for a in answers[:2]] == [3, 7] and len(answers[1].neighbors) == 14
    assert len(answers[2].neighbors) == 5 and answers[2].group_by == ""
    assert len(groups_of(answers[3])) == 4 and "p20" not in groups_of(answers[3])
    for request, answer in zip(requests, answers, strict=True):  # each as if asked alone
        assert [n.id for n in answer.neighbors] == [n.id for n in client.search(request).neighbors]


def test_ann_fidelity_of_grouped_answers_matches_the_build(served, tmp_path):
    """An HNSW index with an item field: grouped answers (the default) are compared with the
    exact grouped answer — same filter, exclusions and takedowns — so the sampled fidelity is
    what the build measured, not the overlap of one row per item with the exact top rows."""
    _, _, _, tmp = served
    catalog = write_catalog(tmp_path / "images", items=300)  # 900 rows: index rounds, not the exact pass
    root = tmp_path / "index"
    run_build(
        BuildConfig(
            model=str(tmp / "model"), index_root=str(root), catalog=str(catalog), factory="HNSW32",
            filterable=["shade"], min_ann_recall=0,
        ),
        progress=False,
    )  # fmt: skip
    built = IndexManifest.read(IndexVersion.open(root).directory).quality.ann_recall_at_k
    config = ServerConfig.flat(
        index_root=str(root), port=0, metrics_port=None, probe_interval_s=0, ann_sample_rate=1.0, admin_token="tok"
    )
    server = SearchServer(config)
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60, admin_token="tok")
    try:
        client.wait_ready(60)
        client.remove_items(["p01-0", "p02-0", "p02-1", "p02-2"], reason="test")  # rows the index still holds
        even = pb.Filter(must=[pb.Condition(field="shade", value="0")])
        for item in range(0, 300, 3):
            client.search(pb.SearchRequest(item_id=f"p{item:02d}-1", k=10))
            client.search(pb.SearchRequest(image=png(item_pixels(item, 7)), k=10, filter=even, per_group=2))
        assert server.monitor.ann_settled(timeout=60)
        sampled = server.monitor.ann_values()
        assert set(sampled) == {1, 5, 10}
        assert sampled[10] == pytest.approx(built, abs=0.05), (sampled, built)
        info = {f.k: f.value for f in client.get_info().ann_recall_at_k}
        assert info == pytest.approx(sampled)
    finally:
        client.close()
        server.stop()


def test_feedback_counts_each_request_once_and_only_what_it_can_score(served):
    """Feedback names ids of the index (or it is refused, naming them), one mark per request id
    (a second replaces the first), and Recall@K only for K within the answer's length."""
    server, client, _, _ = served
    image = png(item_pixels(8, 9))
    short = client.search(pb.SearchRequest(image=image, k=3, request_id="fb-short"))
    top = short.neighbors[0].id
    with pytest.raises(grpc.RpcError) as caught:
        client.feedback("fb-short", [top, "no-such-1", "no-such-2"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'no-such-1', 'no-such-2'" in caught.value.details() and repr(top) not in caught.value.details()
    assert "feedback" not in server.monitor.figures()  # a refused mark counts nothing

    assert client.feedback("fb-short", [top]).accepted
    assert server.monitor.figures()["feedback"] == {1: 1.0}  # a 3-row answer says nothing of R@5, R@10
    assert client.feedback("fb-short", [top]).accepted  # the same mark again: still one mark
    assert len(server.monitor.feedback) == 1 and server.monitor.figures()["feedback"] == {1: 1.0}
    assert client.feedback("fb-short", []).accepted  # a second mark replaces the first: none relevant
    assert len(server.monitor.feedback) == 1 and server.monitor.figures()["feedback"] == {1: 0.0}

    # An indexed id the answer left out is a "should have been returned" mark: a miss at every K.
    full = client.search(pb.SearchRequest(image=image, k=10, request_id="fb-full"))
    returned = {n.id for n in full.neighbors}
    missed = next(f"p{i:02d}-{s}" for i in range(ITEMS) for s in range(PER_ITEM) if f"p{i:02d}-{s}" not in returned)
    assert client.feedback("fb-full", [missed]).accepted
    assert server.monitor.figures()["feedback"] == {1: 0.0, 5: 0.0, 10: 0.0}
    assert client.feedback("fb-full", [missed, full.neighbors[2].id]).accepted  # a hit at rank 3 replaces it
    assert server.monitor.figures()["feedback"] == {1: 0.0, 5: 1.0, 10: 1.0}  # R@5, R@10: the 10-row answer alone


def test_a_labelled_query_is_scored_by_the_item_field_or_refused(served, tmp_path):
    """Rows with an item but no label: a query's `label` names the item it should find. Rows
    with neither: a labelled query cannot be scored, and is told so."""
    server, client, _, tmp = served
    found = client.search(pb.SearchRequest(image=png(item_pixels(5, 9)), k=3, label="p05"))
    assert groups_of(found)[0] == "p05"
    missed = client.search(pb.SearchRequest(image=png(item_pixels(6, 9)), k=3, label="p23", group_by=""))
    assert all(n.id.startswith("p06-") for n in missed.neighbors)  # plain rows, scored by their item too
    assert len(server.monitor.traffic) == 2 and server.monitor.figures()["traffic"] == {1: 0.5}

    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "a.png").write_bytes(png(item_pixels(1, 0)))
    (folder / "b.png").write_bytes(png(item_pixels(2, 0)))
    (folder / "catalog.csv").write_text("id,path\na,a.png\nb,b.png\n")
    root = tmp_path / "index"
    run_build(
        BuildConfig(
            model=str(tmp / "model"), index_root=str(root), catalog=str(folder / "catalog.csv"), min_ann_recall=0
        ),
        progress=False,
    )
    bare = SearchServer(ServerConfig.flat(index_root=str(root), port=0, metrics_port=None, probe_interval_s=0))
    bare.start()
    try:
        with SearchClient(f"127.0.0.1:{bare.port}", timeout=60) as other:
            other.wait_ready(60)
            assert "label: this index version's rows have no label and no item field" in invalid(
                other, pb.SearchRequest(item_id="a", k=1, label="b")
            )
            assert other.search(pb.SearchRequest(item_id="a", k=1)).neighbors[0].id == "b"
    finally:
        bare.stop()


def test_a_bad_request_in_a_batch_is_named_by_its_place(served):
    server, client, _, _ = served
    image = png(item_pixels(3, 9))
    requests = [pb.SearchRequest(image=image, k=3), pb.SearchRequest(image=image, k=3, per_group=17)]
    with pytest.raises(grpc.RpcError) as caught:
        client.search_batch(requests)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "requests[1]: per_group must be within 1..16, got 17"
    body = {"requests": [{"itemId": "p01-0", "k": 2}, {"itemId": "no-such-item", "k": 2}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/search-batch",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    assert json.load(refused.value)["error"]["message"] == "requests[1]: unknown item id 'no-such-item'"
    assert "requests[" not in invalid(client, pb.SearchRequest(image=image, k=3, per_group=17))  # a lone search


def test_a_negative_part_weighs_a_fifth_of_a_positive_by_default(served):
    """Rocchio's own defaults weigh negatives far below positives (β 0.75, γ 0.15): a "not like"
    part without a weight pushes at 0.2, so one negative steers an answer rather than wrecking it."""
    _, client, root, _ = served
    version = IndexVersion.open(root)
    e = {i: version.vector(version.row_of(i)) for i in ("p03-0", "p11-0")}
    parts = [pb.QueryPart(item_id="p03-0"), pb.QueryPart(item_id="p11-0", negative=True)]
    default = client.search(pb.SearchRequest(parts=parts, k=ITEMS))
    q = e["p03-0"] - 0.2 * e["p11-0"]
    own = [f"p{i}-{s}" for i in ("03", "11") for s in range(PER_ITEM)]
    expected = client.search(
        pb.SearchRequest(embedding=pb.Embedding(values=(q / np.linalg.norm(q)).tolist()), exclude_ids=own, k=ITEMS)
    )
    assert groups_of(default) == groups_of(expected)
    np.testing.assert_allclose([n.score for n in default.neighbors], [n.score for n in expected.neighbors], atol=1e-5)
    positive = [pb.QueryPart(item_id="p03-0", weight=1.0)]  # a positive part's default stays 1
    assert groups_of(client.search(pb.SearchRequest(parts=positive, k=4))) == groups_of(
        client.search(pb.SearchRequest(item_id="p03-0", k=4))
    )
