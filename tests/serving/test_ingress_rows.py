"""`serve --ray`'s ingress holds no rows (issue 47): its version (`IngressVersion`) reads only the
manifest — it has no items, tombstones, vectors or id lookup, and no filters or groups (None:
the shards make their own), yet is what the service reads of a version (`VersionView`, as
`IndexVersion` is) — and every call still
answers, from the shards, as the one-process server over the same version answers: plain,
filtered, grouped (by the shard key and by a field spanning shards), min_score, item_id and
parts (the item located on its shard), exclude_ids, labelled, Feedback, GetInfo, a thumbnail's
path and the probe's sample. The ingress here is the production one (`SearchApp` with
`ShardedEngine`, `RayShards`) with each shard deployment's handle a `ShardSearcher` in this
process: the same calls, no cluster."""

from __future__ import annotations

import inspect

import grpc
import numpy as np
import pytest

from core.retrieval.vectors import l2_normalized
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.errors import NotFound
from serving.ray_serve.handles import RayShards
from serving.ray_serve.ingress_version import IngressVersion
from serving.search.engine import ServingPair, load_pair
from serving.search.version_view import VersionView
from serving.server import SearchApp
from serving.shards.fanout import ShardedEngine, ShardedSearch
from serving.shards.searcher import ShardSearcher
from tests.support import server as support_server
from tests.support import shards as support

N, DIM, ITEMS, SHARDS = 1200, 16, 400, 4

pytestmark = pytest.mark.usefixtures("local_ray")  # the sharded build adds its shards in Ray tasks


class Searching:
    """A shard deployment's handle over a `ShardSearcher` in this process, answering at once."""

    def __init__(self, searcher: ShardSearcher) -> None:
        self.searcher = searcher

    def options(self, method_name: str, _by_reference: bool = True):
        searcher = self.searcher

        class Method:
            def remote(self, version, argument):
                try:
                    return support.Answered(getattr(searcher, method_name)(version, argument))
                except Exception as exc:  # noqa: BLE001 - raised where the answer is read, as Serve does
                    return support.Answered(exc)

        return Method()


class IngressServer(support_server.SearchServer):
    """The ingress replica's server (`serving.ray_serve.deployment.IngressReplica`) with in-process shards."""

    def __init__(self, root) -> None:
        self.reach = RayShards([Searching(ShardSearcher(root, n)) for n in range(SHARDS)], 30.0, 0, None)
        sharded = ShardedSearch(self.reach)
        config = support_server.config(root)
        SearchApp.__init__(self, config, ShardedEngine(config.limits, sharded), self.opened)
        self.monitor.exact_top = sharded.exact_top
        self._call(self.bind())
        self.versions: list[IngressVersion] = []

    def opened(self, version=None, model_dir=None, previous=None, progress=None) -> ServingPair:
        """As the ingress loads a version: opened on every shard, then the model's sessions (this
        test's process loads the whole version for them; the ingress's own version holds no row)."""
        local = load_pair(self.config.index_root, version)
        opened = IngressVersion(local.index_version.directory, self.reach).check()
        for handle in self.reach.handles:
            held = handle.searcher.warm(opened.name)
            self.reach.warmed(opened.name, held)
            opened.warmed(held)
        self.versions.append(opened)
        return ServingPair(local.embedder, None, opened, local.text)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ingress-rows")
    model = support.model(folder / "model", DIM)
    support.publish(folder / "four", support.catalog(N, DIM, ITEMS), model, SHARDS)
    ingress = IngressServer(folder / "four")
    ingress.start()
    one, one_client = support_server.start(folder / "four")  # the one-process server, same version
    yield ingress, support_server.connect(ingress), one, one_client
    for server in (ingress, one):
        server.stop(grace=1)


def requests(count: int) -> list[pb.SearchRequest]:
    rng = np.random.default_rng(5)
    vectors = l2_normalized(rng.standard_normal((count, DIM)).astype(np.float32))
    shade = pb.Filter(must=[pb.Condition(field="shade", value="2")])
    made = []
    for i, vector in enumerate(vectors):
        embedding = pb.Embedding(values=vector.tolist())
        made += [
            pb.SearchRequest(embedding=embedding, k=8, group_by=""),
            pb.SearchRequest(embedding=embedding, k=8, group_by="", filter=shade, exclude_ids=[f"id{i:05d}"]),
            pb.SearchRequest(embedding=embedding, k=4, per_group=2),  # by the item field, the shard key
            pb.SearchRequest(embedding=embedding, k=3, group_by="shade", per_group=3, filter=shade),
            pb.SearchRequest(embedding=embedding, k=3, group_by="shade", per_group=2),  # spanning shards
            pb.SearchRequest(embedding=embedding, group_by="", min_score=0.6, label=f"item{i % ITEMS}"),
            pb.SearchRequest(item_id=f"id{7 * i:05d}", k=5, group_by=""),
            pb.SearchRequest(item_id=f"id{7 * i:05d}", k=3, group_by="shade"),  # its own shade left out
            pb.SearchRequest(
                parts=[pb.QueryPart(item_id=f"id{3 * i:05d}"), pb.QueryPart(embedding=embedding, negative=True)],
                k=4,
            ),
        ]
    return made


def answered(response: pb.SearchResponse) -> list[tuple]:
    return [(n.id, round(n.score, 5), n.label, dict(n.metadata), n.group) for n in response.neighbors]


def test_the_ingress_answers_every_call_from_its_shards_and_reads_no_row(servers):
    ingress, client, one, one_client = servers
    version = ingress.versions[-1]
    for read in ("items", "deleted", "live_mask", "vectors", "index", "row_of"):
        assert not hasattr(version, read), read
    assert version.filters is None and version.groups("shade") is None
    whole = IndexVersion(version.directory)  # what `serve` serves: the same view of a version, with its rows
    for member in [*VersionView.__annotations__, *(n for n in vars(VersionView) if not n.startswith("_"))]:
        for view in (version, whole):
            inspect.getattr_static(view, member)  # each has it, read without loading a row
    asked = requests(6)
    got, expected = client.search_batch(asked).responses, one_client.search_batch(asked).responses
    assert [answered(r) for r in got] == [answered(r) for r in expected]
    assert all(list(r.shards_answered) == ["000", "001", "002", "003"] for r in got)
    assert sum(len(r.neighbors) for r in got) > len(asked) * 3  # not a comparison of empty answers
    for i, r in enumerate(got[7::9]):  # an item query grouped by shade: its own item's shade left out
        assert r.neighbors and str((7 * i) % 5) not in {n.group for n in r.neighbors}
    # A labelled query on rows without labels is scored against its hits' item field: recorded.
    traffic = ingress.monitor.figures().get("traffic")
    assert traffic and traffic == one.monitor.figures().get("traffic")
    # Feedback: ids the answer holds, one it missed, one no version holds.
    first = got[0]
    missed = next(r for r in got[1:] if r.neighbors and r.neighbors[0].id not in {n.id for n in first.neighbors})
    assert client.feedback(first.request_id, [first.neighbors[2].id, missed.neighbors[0].id]).accepted
    with pytest.raises(grpc.RpcError) as refused:
        client.feedback(first.request_id, ["no-such-item"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no-such-item" in refused.value.details()
    info, one_info = client.get_info(), one_client.get_info()
    assert (info.index_size, info.deleted_rows) == (one_info.index_size, one_info.deleted_rows)
    # A thumbnail reads the path its shard gives for the id (the test catalog's files do not exist).
    with pytest.raises(NotFound, match="13.png"):
        ingress._call(ingress.service.thumbnail("id00013", 64))
    with pytest.raises(NotFound, match="no item 'nope'"):
        ingress._call(ingress.service.thumbnail("nope", 64))


@pytest.mark.parametrize("item_field", [None, "item"])
def test_the_probe_sample_gathered_from_the_shards_is_the_whole_versions(servers, item_field):
    ingress, *_ = servers
    whole = IndexVersion.open(ingress.config.index_root)
    for size in (1, 37, N):
        gathered = ingress.versions[-1].probe_sample(size, item_field)
        expected = whole.probe_sample(size, item_field)
        assert gathered == expected and len(expected) == size
    assert not ingress.versions[-1].labelled and ingress.versions[-1].labelled == whole.labelled


def test_a_filter_the_ingress_refuses_says_what_the_one_process_server_says(servers):
    _, client, _, one_client = servers
    bad = pb.Filter(must=[pb.Condition(field="shade", range=pb.Range(gte=1))])
    messages = []
    for c in (client, one_client):
        with pytest.raises(grpc.RpcError) as refused:
            c.search(pb.SearchRequest(embedding=pb.Embedding(values=[1.0] + [0.0] * (DIM - 1)), filter=bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        messages.append(refused.value.details())
    assert messages[0] == messages[1] and "numeric field" in messages[0]
