"""The sharded search's merge (serving/shards/fanout.py), without a cluster: S = 4 shards, each a
`ShardSearcher` in this process, answer every kind of query exactly as the one-index engine
answers the same catalog built as one index — plain, filtered, grouped by the item (the shard
key) and by a field spanning shards, with several rows a group, min_score, excluded rows and a
takedown — by id and order (Flat: exact, so ties aside the same). A shard that fails leaves its
name in the answers, never a silently short answer."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from core.retrieval.vectors import l2_normalized
from index.changes.lifecycle import remove_items
from index.search.filters import Condition, Filter
from index.versions.version import IndexVersion
from serving.monitoring.monitor import MonitorConfig, RecallMonitor
from serving.ray_serve.handles import RayShards
from serving.ray_serve.ingress_version import IngressVersion
from serving.search.answers import NOTHING_EXCLUDED, Exclusion, Hit, Scope
from serving.search.engine import SearchEngine, ServingPair
from serving.shards.fanout import LocalShards, ShardedSearch
from serving.shards.searcher import ShardSearcher
from serving.telemetry.metrics import ServiceMetrics
from tests.support import shards as support

N, DIM, ITEMS = 1200, 16, 400
K = 10


pytestmark = pytest.mark.usefixtures("local_ray")  # the sharded builds add their shards in Ray tasks


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    model = support.model(folder / "model", DIM)
    data = support.catalog(N, DIM, ITEMS)
    support.publish(folder / "one", data, model, 1)
    support.publish(folder / "four", data, model, 4)
    return folder / "one", folder / "four"


def engines(one_root, four_root):
    single = IndexVersion.open(one_root).load()
    merged = IndexVersion.open(four_root)
    one = ServingPair(None, single.searchable(), single)  # type: ignore[arg-type]
    four = ServingPair(None, None, merged)  # type: ignore[arg-type]  # the ingress holds no index
    return (SearchEngine(), one), (ShardedSearch(LocalShards(four_root, 4)), four)


def queries(count: int) -> np.ndarray:
    return l2_normalized(np.random.default_rng(7).standard_normal((count, DIM)).astype(np.float32))


def scope_on(pair: ServingPair, query_filter: Filter | None, group_by: str | None, per_group: int, min_score=None):
    version = pair.index_version
    allowed = None
    if query_filter is not None:
        allowed = version.filters.mask(query_filter)
        allowed.flags.writeable = False
    groups = version.groups(group_by) if group_by else None
    return Scope(allowed, min_score, groups, per_group, query_filter)


def answered_ids(pair, answers):
    """Each answer's ids and scores, as its hits name them — checked against the rows' own items:
    what a shard names a hit by is the row it answered."""
    items = pair.items
    for hit in (h for a in answers for h in a.hits):
        assert (hit.id, hit.label, hit.metadata) == (
            items.ids[hit.row],
            items.labels[hit.row],
            items.metadata.text[hit.row],
        )
    return [[(h.id, round(h.score, 5)) for h in a.hits] for a in answers]


def groups_of(pair, answers, scope):
    for hit in (h for a in answers for h in a.hits):
        assert hit.group == scope.groups.label(scope.groups.codes[hit.row])
    return [[h.group for h in a.hits] for a in answers]


CASES = {
    "plain": (None, None, 1, None),
    "filtered": (Filter(must=(Condition("shade", value="2"),)), None, 1, None),
    "grouped by item": (None, "item", 2, None),
    "grouped by a field spanning shards": (None, "shade", 3, None),
    "grouped and filtered": (Filter(must_not=(Condition("shade", value="0"),)), "item", 1, None),
    "min_score": (None, None, 1, 0.55),
    "min_score grouped": (None, "item", 1, 0.7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shards_answer_as_one_index(roots, case):
    (engine, one), (sharded, four) = engines(*roots)
    query_filter, group_by, per_group, min_score = CASES[case]
    q = queries(120)
    skip_ids = [[f"id{(7 * i) % N:05d}", f"id{(11 * i + 3) % N:05d}"] for i in range(len(q))]
    k = K if group_by is None else 4
    got = []
    for engine_, pair in ((engine, one), (sharded, four)):
        scope = scope_on(pair, query_filter, group_by, per_group, min_score)
        exclude = [Exclusion(ids=frozenset(ids)) for ids in skip_ids]
        answers = engine_.search(pair, q, k, exclude, [scope] * len(q), [k] * len(q))
        got.append(
            (
                answered_ids(pair, answers),
                [a.truncated for a in answers],
                groups_of(pair, answers, scope) if scope.groups is not None else None,
            )
        )
    assert got[0] == got[1]
    assert sum(bool(a) for a in got[0][0]) > len(q) // 2  # not a comparison of empty answers
    if min_score is not None:
        assert any(got[0][1]) and not all(got[0][1])  # the bound cuts some answers and not others


def test_a_takedown_never_answers_from_any_shard(roots, tmp_path):
    _, four_root = roots
    (_, _), (sharded, four) = engines(*roots)
    q = four.index_version.vectors[:50]  # every row's own vector: it answers first
    taken = [four.items.ids[r] for r in range(0, 50, 5)]
    report = remove_items(four_root, taken, "tester", "takedown")
    after = IndexVersion.open(four_root, report.version)
    pair = ServingPair(None, None, after)  # type: ignore[arg-type]
    answers = sharded.search(pair, q, K, [NOTHING_EXCLUDED] * len(q), None, None)
    ids = {after.items.ids[h.row] for a in answers for h in a.hits}
    assert ids and not ids & set(taken)
    assert all(a.shards_answered == ("000", "001", "002", "003") and not a.shards_missing for a in answers)


def test_a_failed_shard_is_named_in_every_answer(roots):
    _, four_root = roots
    (_, _), (_, four) = engines(*roots)
    shards = LocalShards(four_root, 4)

    def broken(version, request):
        raise ConnectionError("replica gone")

    shards.searchers[2].search = broken
    answers = ShardedSearch(shards).search(four, queries(3), K, [NOTHING_EXCLUDED] * 3)
    for answer in answers:
        assert answer.shards_missing == ("002",) and answer.shards_answered == ("000", "001", "003")
        assert "shard 002 did not answer" in answer.unavailable and "replica gone" in answer.unavailable
        assert len(answer.hits) == K  # what the others answered, named partial by the fields above


def test_a_shard_replica_keeps_two_versions_and_refuses_a_damaged_one(roots):
    _, four_root = roots
    version = IndexVersion.open(four_root).name
    searcher = ShardSearcher(four_root, 1)
    assert searcher.warm(version)["rows"] == IndexVersion.open(four_root).manifest.shards[1].rows
    with pytest.raises(Exception, match="shards: this deployment's shard 004"):
        ShardSearcher(four_root, 4).warm(version)


def test_the_monitors_ann_fidelity_over_the_shards_is_the_one_index_figure(roots):
    """A sharded server's online ANN fidelity (its exact re-runs asked of the shards, many sampled
    queries a call) is the figure one index gives the same answers: plain, filtered and grouped."""
    (engine, one), (sharded, four) = engines(*roots)
    q = queries(40)
    ranks = [*range(7), 20, 21, 22]  # an imperfect answer: 7 of the exact top 10, then ranks 21-23
    shade = Filter(must=(Condition("shade", value="1"),))
    # Rows another test took down in the sharded root are left out of both answers.
    gone = frozenset(r for r, i in enumerate(one.items.ids) if four.index_version.row_of(i) is None)
    figures = []
    for pair, hook in ((one, None), (four, sharded.exact_top)):
        monitor = RecallMonitor(MonitorConfig(ks=(1, 5, 10), ann_sample_rate=1.0, ann_queue=1024), ServiceMetrics())
        monitor.exact_top = hook
        monitor.reset(pair)
        for query_filter, group_by in ((None, None), (shade, None), (None, "item")):
            scope = scope_on(one, query_filter, group_by, 1)
            exact = engine.search(one, q, 30, [Exclusion(rows=gone)] * len(q), [scope] * len(q), [30] * len(q))
            own = scope_on(pair, query_filter, group_by, 1)
            for vector, answer in zip(q, exact, strict=True):
                rows = [pair.index_version.row_of(one.items.ids[answer.hits[r].row]) for r in ranks]
                skip = Exclusion(rows=gone) if pair is one else NOTHING_EXCLUDED
                hits = [Hit(row, 0.0, answer.hits[r].group) for row, r in zip(rows, ranks, strict=True)]
                monitor.maybe_sample_ann(pair.serial, vector, hits, skip, own)
        monitor.start(None)
        assert monitor.ann_settled(60)
        monitor.stop()
        figures.append(monitor.ann_values())
    assert figures[0] == figures[1]
    assert figures[0][1] == 1.0 and 0.6 < figures[0][10] < 0.8  # the answers' own fidelity, not 1 nor 0


@pytest.mark.parametrize("group_by", [None, "item", "shade"])
def test_a_shards_hits_take_no_more_bytes_than_it_says(roots, group_by):
    """What bounds a shard call's reply (`RayShards` sends one that may pass Serve's message limit
    through the object store): each hit of a pickled answer — its id, metadata, group value and
    item value (the rows are unlabelled) — takes at most the `hit_bytes` its shard's `warm` says."""
    _, four_root = roots
    version = IndexVersion.open(four_root).name
    searcher = ShardSearcher(four_root, 2)
    bound = searcher.warm(version)["hit_bytes"]
    q = queries(64)
    scope = Scope(groups=IndexVersion.open(four_root).groups(group_by) if group_by else None, per_group=3)
    request = ShardedSearch.request(q, K, [NOTHING_EXCLUDED] * len(q), [scope] * len(q), None)
    answer = searcher.search(version, request)
    empty = searcher.search(version, ShardedSearch.request(q[:0], K, [], [], None))
    hits = len(answer.rows)
    assert hits >= len(q) * K and all(name[1] and name[4] for name in answer.named)
    assert (len(pickle.dumps(answer)) - len(pickle.dumps(empty))) / hits <= bound
    assert hits <= request.most_hits()


def test_an_item_querys_own_group_is_left_out_on_every_shard(roots):
    """A grouped item query leaves its own group out: an exclusion by value, which each shard
    resolves over its own rows — grouped by a field spanning shards, its rows are in all four."""
    (engine, one), (sharded, four) = engines(*roots)
    q = queries(30)
    k = 3
    # Items another test took down in the sharded root are left out of both answers.
    gone = {i for i in one.items.ids if four.index_version.row_of(i) is None}
    own = [Exclusion(ids=frozenset({f"id{i:05d}", *gone}), groups=frozenset({str(i % 5)})) for i in range(len(q))]
    got = []
    for engine_, pair in ((engine, one), (sharded, four)):
        scope = scope_on(pair, None, "shade", 2)
        answers = engine_.search(pair, q, k, own, [scope] * len(q), [k] * len(q))
        got.append([[(h.id, h.group) for h in a.hits] for a in answers])
        for i, answer in enumerate(answers):
            assert len(answer.hits) == 2 * k and str(i % 5) not in {h.group for h in answer.hits}
    assert got[0] == got[1]


class _Searching:
    """A shard deployment's handle over a `ShardSearcher` in this process: `RayShards` without a
    cluster, each call answered at once, the arguments it was sent kept."""

    def __init__(self, searcher: ShardSearcher) -> None:
        self.searcher, self.sent = searcher, []

    def options(self, method_name: str, _by_reference: bool = True):
        handle = self

        class Method:
            def remote(self, version, argument):
                handle.sent.append(argument)
                try:
                    outcome = getattr(handle.searcher, method_name)(version, argument)
                except Exception as exc:  # noqa: BLE001 - raised where the answer is read, as Serve does
                    outcome = exc
                return support.Answered(outcome)

        return Method()


@pytest.mark.parametrize("item_field", ["item", None])
def test_the_ingress_locates_an_item_on_the_shard_holding_it(roots, tmp_path, item_field):
    """An item query's vector and group value come from the shard holding the item, as one index
    has them: placed by id, only the shard its id names is asked; placed by the item field
    (unknown from an id), every shard at once."""
    model = roots[0].parent / "model"
    root = tmp_path / "root"
    support.publish(root, support.catalog(300, DIM, 100, seed=1), model, 4, item_field=item_field)
    whole = IndexVersion.open(root)
    handles = [_Searching(ShardSearcher(root, n)) for n in range(4)]
    ingress = IngressVersion(whole.directory, RayShards(handles, 5.0, 1, None))
    asked = [f"id{i:05d}" for i in range(0, 300, 7)]
    for item_id in asked:
        found, expected = ingress.locate(item_id, "shade"), whole.locate(item_id, "shade")
        assert (found.row, found.value) == (expected.row, expected.value)
        np.testing.assert_array_equal(found.vector, expected.vector)
    assert ingress.locate("no-such-item") is None
    calls = [len(h.sent) for h in handles]
    if item_field is None:
        assert sum(calls) == len(asked) + 1 and min(calls) > 0  # one shard an id, each asked for some
    else:
        assert calls == [len(asked) + 1] * 4
