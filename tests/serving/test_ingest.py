"""AddItems (issue 48, ingest while serving) on a real server on loopback, over gRPC and HTTP/JSON:
images embedded by the live model and embeddings, added as a new version that is served before
the call returns; an id already indexed refused unless upsert; every bad input answered
INVALID_ARGUMENT / 400 naming the item and the fault, with nothing published; the admin token
required, as for RemoveItems."""

from __future__ import annotations

import base64
import io

import grpc
import numpy as np
import pytest
import requests
from PIL import Image

from core.artifacts import layout as artifacts
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.search.checks import MAX_ADD_ITEMS
from tests.support.index import SIDE, write_catalog_index
from tests.support.server import connect, start, wait_for

ADMIN = "ingest-s3cret"
DIM = 16  # the tiny model's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("ingest"), items=12)
    # Whole-shard compactions past the default --max-segments only: no background merge publishes
    # between a test's looks at what is live (tiered merges have a test of their own, below).
    server, client = start(root, http_port=0, admin_token=ADMIN, merges="whole")
    yield server, client, f"http://127.0.0.1:{server.http_port}", root
    client.close()
    server.stop(grace=1)


def png(seed: int, side: int = SIDE) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def unit(seed: int) -> list[float]:
    vector = np.random.default_rng(seed).standard_normal(DIM)
    return (vector / np.linalg.norm(vector)).tolist()


def nearest(client, **query) -> pb.SearchResponse:
    """The single best row for a query, ungrouped (the index groups by its item field)."""
    return client.search(pb.SearchRequest(k=1, group_by="", **query))


def post(base: str, path: str, body: dict, token: str | None = ADMIN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(f"{base}{path}", json=body, headers=headers, timeout=60)


def test_items_added_over_grpc_are_served_when_the_call_returns(served):
    server, client, base, root = served
    before = client.get_info()
    image = png(seed=101)
    reply = client.add_items(
        [
            pb.NewItem(id="new-embedding", embedding=pb.Embedding(values=unit(1)), metadata={"shade": "7"}),
            pb.NewItem(id="new-image", image=image, metadata={"item": "fresh", "shade": "7"}),
        ]
    )
    assert (reply.added, reply.replaced) == (2, 0)
    assert reply.previous_index_version == before.index_version != reply.index_version
    assert reply.index_version == artifacts.current_version(root)
    assert reply.index_size == before.index_size + 2
    info = client.get_info()
    assert (info.index_version, info.index_size) == (reply.index_version, before.index_size + 2)

    # Found at once by their own vector and image, from the version the call named.
    by_vector = nearest(client, embedding=pb.Embedding(values=unit(1)))
    assert by_vector.neighbors[0].id == "new-embedding" and by_vector.neighbors[0].score == pytest.approx(1, abs=1e-5)
    assert by_vector.index_version == reply.index_version
    by_image = nearest(client, image=image)
    assert by_image.neighbors[0].id == "new-image" and by_image.neighbors[0].score == pytest.approx(1, abs=1e-5)
    assert dict(by_image.neighbors[0].metadata) == {"item": "fresh", "shade": "7"}
    # The image was embedded as Embed embeds it, and its fields filter as the built rows' do.
    embedded = client.embed(image).embedding
    assert nearest(client, embedding=pb.Embedding(values=embedded)).neighbors[0].id == "new-image"
    shade = pb.Filter(must=[pb.Condition(field="shade", value="7")])
    within = client.search(pb.SearchRequest(embedding=pb.Embedding(values=unit(5)), k=10, group_by="", filter=shade))
    assert sorted(n.id for n in within.neighbors) == ["new-embedding", "new-image"]
    assert server.metrics.items_added.collect()[0].samples[0].value >= 2
    # No path given: the item has no file, and its thumbnail says so.
    thumbnail = requests.get(f"{base}/v1/items/new-image/thumbnail", timeout=60)
    assert thumbnail.status_code == 404 and "ingest:new-image" in thumbnail.json()["error"]["message"]


def test_items_added_over_http_are_served_when_the_call_returns(served, tmp_path):
    server, client, base, root = served
    before = client.get_info()
    image = png(seed=202)
    (tmp_path / "photo.png").write_bytes(image)
    body = {
        "items": [
            {"id": "http-image", "image": base64.b64encode(image).decode(), "path": str(tmp_path / "photo.png")},
            {"id": "http-embedding", "embedding": {"values": unit(2)}, "metadata": {"shade": "1"}},
        ]
    }
    answer = post(base, "/v1/admin/add-items", body)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert (reply["added"], reply["replaced"], reply["indexSize"]) == (2, 0, before.index_size + 2)
    assert reply["previousIndexVersion"] == before.index_version != reply["indexVersion"]
    query = {"embedding": {"values": unit(2)}, "k": 1, "groupBy": ""}
    found = requests.post(f"{base}/v1/search", json=query, timeout=60)
    assert found.json()["neighbors"][0]["id"] == "http-embedding"
    assert found.json()["indexVersion"] == reply["indexVersion"]
    assert nearest(client, image=image).neighbors[0].id == "http-image"
    thumbnail = requests.get(f"{base}/v1/items/http-image/thumbnail", timeout=60)  # the path it named
    assert thumbnail.status_code == 200 and thumbnail.headers["Content-Type"].startswith("image/")


def test_an_id_already_indexed_is_refused_unless_upsert_which_replaces_its_vector(served):
    server, client, base, root = served
    client.add_items([pb.NewItem(id="twice", embedding=pb.Embedding(values=unit(3)), metadata={"shade": "a"})])
    size = client.get_info().index_size
    again = [pb.NewItem(id="twice", embedding=pb.Embedding(values=unit(4)), metadata={"shade": "b"})]
    with pytest.raises(grpc.RpcError) as refused:
        client.add_items(again)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'twice'" in refused.value.details() and "upsert" in refused.value.details()
    answer = post(base, "/v1/admin/add-items", {"items": [{"id": "twice", "embedding": {"values": unit(4)}}]})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "upsert" in answer.json()["error"]["message"]
    assert nearest(client, embedding=pb.Embedding(values=unit(3))).neighbors[0].id == "twice"

    reply = client.add_items(again, upsert=True)
    assert (reply.added, reply.replaced, reply.index_size) == (0, 1, size)
    new = nearest(client, embedding=pb.Embedding(values=unit(4))).neighbors[0]
    assert (new.id, dict(new.metadata)) == ("twice", {"shade": "b"}) and new.score == pytest.approx(1, abs=1e-5)
    old = nearest(client, embedding=pb.Embedding(values=unit(3))).neighbors[0]
    assert old.id != "twice" or old.score < 0.99  # its old vector is gone
    by_http = post(
        base, "/v1/admin/add-items", {"upsert": True, "items": [{"id": "twice", "embedding": {"values": unit(3)}}]}
    )
    assert by_http.status_code == 200 and by_http.json()["replaced"] == 1, by_http.text
    assert nearest(client, embedding=pb.Embedding(values=unit(3))).neighbors[0].id == "twice"


def truncated_png() -> bytes:
    """A PNG whose header reads (its size checked) but whose pixels do not decode."""
    data = png(seed=7, side=64)
    return data[: len(data) // 2]


def bad_calls() -> list[tuple[str, list[dict], str]]:
    """(case, the call's items as proto3 JSON, what the message says): each refused with nothing added."""
    good = {"id": "fine", "embedding": {"values": unit(9)}}
    image = base64.b64encode(png(seed=9)).decode()
    return [
        ("no items", [], "items: empty"),
        ("an empty id", [good, {"id": "", "embedding": {"values": unit(9)}}], "items[1]: id is empty"),
        ("neither image nor embedding", [{"id": "bare"}], "items[0]: item 'bare' has neither image nor embedding"),
        ("a wrong dimension", [{"id": "short", "embedding": {"values": [1.0, 2.0, 3.0]}}],
         f"items[0]: embedding has dimension 3, the live model's is {DIM}"),
        ("a NaN embedding", [{"id": "nan", "embedding": {"values": ["NaN"] * DIM}}],
         "items[0]: embedding contains NaN"),
        ("empty image bytes", [{"id": "empty", "image": ""}], "items[0]: image bytes are empty"),
        ("not an image", [{"id": "junk", "image": base64.b64encode(b"not an image at all").decode()}],
         "items[0]: cannot decode image"),
        ("pixels that do not decode", [good, {"id": "cut", "image": base64.b64encode(truncated_png()).decode()}],
         "items[1]: cannot decode image"),
        ("too many items", [{"id": f"many-{i}", "embedding": {"values": unit(i)}} for i in range(MAX_ADD_ITEMS + 1)],
         f"{MAX_ADD_ITEMS + 1} items exceed the limit of {MAX_ADD_ITEMS} a call"),
        ("an id given twice", [good, {"id": "fine", "image": image}], "item id 'fine' comes twice"),
        ("labels on a version without them", [{**good, "label": "cat"}], "have labels and version"),
        ("labels on some items only", [{**good, "label": "cat"}, {"id": "other", "image": image}],
         "items[1]: has no label and items[0] has one"),
    ]  # fmt: skip


def test_every_bad_input_is_refused_naming_the_item_and_the_fault_on_both_transports(served):
    from google.protobuf import json_format

    server, client, base, root = served
    before = client.get_info()
    for case, items, says in bad_calls():
        request = json_format.ParseDict({"items": items}, pb.AddItemsRequest())
        with pytest.raises(grpc.RpcError) as refused:
            client.add_items(list(request.items))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert says in refused.value.details(), (case, refused.value.details())
        answer = post(base, "/v1/admin/add-items", {"items": items})
        assert answer.status_code == 400, (case, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "INVALID_ARGUMENT" and says in error["message"], (case, error)
    after = client.get_info()
    assert (after.index_version, after.index_size) == (before.index_version, before.index_size)
    assert artifacts.current_version(root) == before.index_version  # nothing was published


def test_too_many_items_are_refused_by_their_count_before_any_is_decoded(served):
    """1,001 items to /v1/admin/add-items were refused for their count only after 39.8 s: every
    image's base64 was decoded first. Here no item could be decoded at all (not base64 over HTTP,
    not an image over gRPC), and the answer is the count's."""
    server, client, base, root = served
    says = f"{MAX_ADD_ITEMS + 1} items exceed the limit of {MAX_ADD_ITEMS} a call; send them in several calls"
    body = {"items": [{"id": f"junk-{i}", "image": "not base64!"} for i in range(MAX_ADD_ITEMS + 1)]}
    answer = post(base, "/v1/admin/add-items", body)
    assert answer.status_code == 400 and answer.json()["error"] == {"code": "INVALID_ARGUMENT", "message": says}
    items = [pb.NewItem(id=f"junk-{i}", image=b"not an image") for i in range(MAX_ADD_ITEMS + 1)]
    with pytest.raises(grpc.RpcError) as refused:
        client.add_items(items)
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, says)


def test_a_call_without_the_admin_token_is_refused(served):
    server, client, base, root = served
    item = pb.NewItem(id="sneaky", embedding=pb.Embedding(values=unit(6)))
    anonymous = connect(server)
    try:
        with pytest.raises(grpc.RpcError) as denied:
            anonymous.add_items([item])
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous.admin_token = "wrong"
        with pytest.raises(grpc.RpcError) as wrong:
            anonymous.add_items([item])
        assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        anonymous.close()
    body = {"items": [{"id": "sneaky", "embedding": {"values": unit(6)}}]}
    assert post(base, "/v1/admin/add-items", body, token=None).status_code == 401
    assert post(base, "/v1/admin/add-items", body, token="wrong").status_code == 403
    assert nearest(client, embedding=pb.Embedding(values=unit(6))).neighbors[0].id != "sneaky"


def test_ingests_past_max_segments_are_compacted_after_their_answer_and_the_result_served(tmp_path):
    """With --merges whole, an ingest answers once its own segment is served; the compaction it
    makes due (more than --max-segments) runs after, as `index compact` in a process of its own,
    and the server then serves the merged version: at most --max-segments segments, every
    ingested item found."""
    root = write_catalog_index(tmp_path, items=12)
    server, client = start(root, admin_token=ADMIN, max_segments=2, merges="whole")
    try:
        answered = []
        for call in range(4):
            item = pb.NewItem(
                id=f"seg-{call}", embedding=pb.Embedding(values=unit(200 + call)), metadata={"shade": "1"}
            )
            answered.append(client.add_items([item]).index_version)
        # Each call was answered from a version holding its own item (an ingest after a compaction
        # adds to the compacted version).
        for call, version in enumerate(answered):
            assert IndexVersion(artifacts.version_dir(root, version)).row_of(f"seg-{call}") is not None

        def compacted() -> bool:  # what the last ingest left is merged once due, and served
            live = IndexVersion.open(root)
            return len(live.manifest.segments or []) <= 2 and client.get_info().index_version == live.name

        wait_for(compacted)
        made = [IndexVersion(path).manifest for path in (root / artifacts.VERSIONS).iterdir() if path.is_dir()]
        assert any("compacted" in " ".join(m.quality_gate.reasons) for m in made if m.quality_gate)
        for call in range(4):
            found = nearest(client, embedding=pb.Embedding(values=unit(200 + call)))
            assert found.neighbors[0].id == f"seg-{call}"
    finally:
        client.close()
        server.stop(grace=1)


def test_every_ingest_is_found_by_the_search_right_after_it_while_compactions_publish_between(tmp_path):
    """Back-to-back ingests past --max-segments: compactions run in their own process and publish
    while the next ingest waits its turn, then adds to the compacted version. The server must
    never go back to a compacted version older than the one an ingest has made live: each
    item answers the search sent the moment its call returned."""
    root = write_catalog_index(tmp_path, items=12)
    server, client = start(root, admin_token=ADMIN, max_segments=2, merges="whole")
    try:
        missed = []
        for call in range(12):
            vector = pb.Embedding(values=unit(300 + call))
            client.add_items([pb.NewItem(id=f"burst-{call}", embedding=vector, metadata={"shade": "1"})])
            for earlier in range(call + 1):
                found = nearest(client, embedding=pb.Embedding(values=unit(300 + earlier)))
                if found.neighbors[0].id != f"burst-{earlier}":
                    missed.append((call, earlier, found.index_version))
        assert missed == []
    finally:
        client.close()
        server.stop(grace=1)


def test_ingests_set_off_tiered_merges_after_their_answer_and_the_merged_version_is_served(tmp_path):
    """By default (--merges tiered) a server's ingests make segments that the tiered policy
    merges once due — here the ten one-row segments of size class 0, into one — in an `index
    compact --tiered` process after the call's answer; the server then serves the merged version,
    every ingested item found, and no --max-segments compaction ran (max_segments is left high)."""
    from index.changes.merges import merge_records

    root = write_catalog_index(tmp_path, items=12)
    server, client = start(root, admin_token=ADMIN, max_segments=1000)
    try:
        for call in range(10):  # the 10th fills class 0 (segments_per_tier 10; 10 rows ≤ half the base)
            vector = pb.Embedding(values=unit(500 + call))
            item = pb.NewItem(id=f"tier-{call}", embedding=vector, metadata={"shade": "1"})
            client.add_items([item])

        def merged() -> bool:
            live = IndexVersion.open(root)
            return bool(merge_records(root)) and client.get_info().index_version == live.name

        wait_for(merged)
        live = IndexVersion.open(root)
        merge = IndexVersion(artifacts.version_dir(root, merge_records(root)[0]["version"])).manifest
        assert "10 of 11 segments (tier 0)" in " ".join(merge.quality_gate.reasons), merge.quality_gate
        assert len(live.manifest.segments) == 2  # the base and the ingests' segments merged into one
        for call in range(10):
            assert nearest(client, embedding=pb.Embedding(values=unit(500 + call))).neighbors[0].id == f"tier-{call}"
    finally:
        client.close()
        server.stop(grace=1)
