"""The server's live ANN fidelity (serving/monitoring/monitor.py) counts rows — and groups — that tie with the
exact K-th best as equal, as the build's ANN recall does: an exact index answering a catalog with
duplicated vectors reads 1.0 whatever order it lists the copies in, one that misses less."""

from __future__ import annotations

import time

import numpy as np
import pytest

from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import apply_search_params, build_index
from index.versions.version import IndexVersion
from serving.monitoring.ann_samples import EXACT_DEPTH, SampledQuery
from serving.monitoring.monitor import MonitorConfig, RecallMonitor
from serving.search.answers import EVERY_ROW, NOTHING_EXCLUDED
from serving.search.engine import SearchEngine, ServingPair
from serving.telemetry.metrics import ServiceMetrics
from tests.support import shards as support

N, DIM, ITEMS, COPIES = 600, 16, 200, 60
KS = (1, 5, 10)


@pytest.fixture(scope="module")
def version(tmp_path_factory) -> IndexVersion:
    """A Flat version whose rows N/2 .. N/2 + COPIES copy rows 0 .. COPIES (another item's)."""
    folder = tmp_path_factory.mktemp("ties")
    vectors, items = support.catalog(N, DIM, ITEMS)
    vectors[N // 2 : N // 2 + COPIES] = vectors[:COPIES]
    support.publish(folder / "index", (vectors, items), support.model(folder / "model", DIM), 1)
    return IndexVersion.open(folder / "index").load()


def monitor_on(pair: ServingPair) -> RecallMonitor:
    monitor = RecallMonitor(MonitorConfig(ks=KS, ann_sample_rate=1.0), ServiceMetrics())
    monitor.reset(pair)
    return monitor


def answers(pair: ServingPair, queries: np.ndarray) -> list[list[int]]:
    found = SearchEngine().search(pair, queries, max(KS), [NOTHING_EXCLUDED] * len(queries))
    return [[h.row for h in a.hits] for a in found]


def by_identity(pair: ServingPair, queries: np.ndarray, rows: list[list[int]], k: int) -> float:
    """Fidelity@k counting rows by identity alone against the exact ranking (ties: the lower row)."""
    overlap = []
    for query, answer in zip(queries, rows, strict=True):
        scores = pair.index_version.exact_scores(query)
        overlap.append(len(set(answer[:k]) & set(np.argsort(-scores, kind="stable")[:k].tolist())) / k)
    return float(np.mean(overlap))


def test_an_exact_index_reads_fidelity_one_whatever_order_it_lists_copies_in(version):
    pair = ServingPair(None, support.two_flat_shards(np.asarray(version.vectors), highest_row_first=True), version)  # type: ignore[arg-type]
    queries = np.asarray(version.vectors[:COPIES])  # a row and its copy tie for the first place
    rows = answers(pair, queries)
    assert by_identity(pair, queries, rows, 1) < 0.1  # what the monitor read before ties counted
    monitor = monitor_on(pair)
    for query, answer in zip(queries, rows, strict=True):
        monitor.check_ann(pair.serial, query, answer, set())
    assert monitor.ann_values() == {1: 1.0, 5: 1.0, 10: 1.0}


def test_an_index_that_misses_still_reads_below_one(version):
    ivf = build_index(np.asarray(version.vectors), "IVF16,Flat", device="cpu")
    apply_search_params(ivf, {"nprobe": 1})
    pair = ServingPair(None, ivf, version)  # type: ignore[arg-type]
    noise = 0.5 * np.random.default_rng(3).standard_normal((COPIES, DIM))
    queries = l2_normalized((version.vectors[:COPIES] + noise).astype(np.float32))
    monitor = monitor_on(pair)
    for query, answer in zip(queries, answers(pair, queries), strict=True):
        monitor.check_ann(pair.serial, query, answer, set())
    assert 0 < monitor.ann_values()[10] < 0.9


def test_grouped_answers_count_groups_tied_with_the_kth_as_equal(version):
    pair = ServingPair(None, version.searchable(), version)  # type: ignore[arg-type]
    groups = version.groups("item")
    query = np.asarray(version.vectors[0])  # item0's row 0 and item100's copy of it tie
    scores = version.exact_scores(query)
    best = {}
    for row in np.argsort(-scores, kind="stable").tolist():
        best.setdefault(int(groups.codes[row]), row)
    ranked = list(best.values())[: max(KS)]  # each group's best row, best group first
    tied = [groups.label(groups.codes[r]) for r in ranked[:2]]
    assert sorted(tied) == ["item0", "item100"] and scores[ranked[0]] == scores[ranked[1]]
    monitor = monitor_on(pair)
    monitor.check_ann(pair.serial, query, [ranked[1], ranked[0], *ranked[2:]], set(), None, groups)
    assert monitor.ann_values() == {1: 1.0, 5: 1.0, 10: 1.0}
    # A group that is not tied in first place is a miss there.
    monitor.reset(pair)
    monitor.check_ann(pair.serial, query, [ranked[2], ranked[0], ranked[1], *ranked[3:]], set(), None, groups)
    assert monitor.ann_values() == {1: 0.0, 5: 1.0, 10: 1.0}


def test_a_sharded_servers_exact_rankings_are_compared_by_their_scores(version):
    """The sharded path (`RecallMonitor.exact_top`: rankings with scores from the shards): the
    copies listed in the other order than the answer's still read 1.0; a real miss does not."""
    pair = ServingPair(None, version.searchable(), version)  # type: ignore[arg-type]
    asked = []

    def exact_top(on, k, queries):
        asked.append(k)
        ranked = []
        for query in queries:
            scores = on.index_version.exact_scores(query.vector)
            top = np.lexsort((-np.arange(len(scores)), -scores))[:k]  # ties: the later row first
            ranked.append((top.tolist(), scores[top].tolist()))
        return ranked

    queries = np.asarray(version.vectors[:COPIES])
    rows = answers(pair, queries)
    monitor = monitor_on(pair)
    monitor.exact_top = exact_top
    monitor.check_ann_remote(jobs(pair, queries, rows))
    assert monitor.ann_values() == {1: 1.0, 5: 1.0, 10: 1.0} and asked == [EXACT_DEPTH * max(KS)]
    # Each answer less its second row (the copy tied first), with the worst row last: 9 of 10.
    monitor.reset(pair)
    worst = [int(np.argmin(version.exact_scores(q))) for q in queries]
    monitor.check_ann_remote(jobs(pair, queries, [[r[0], *r[2:], w] for r, w in zip(rows, worst, strict=True)]))
    assert monitor.ann_values()[10] == pytest.approx(0.9)


def jobs(pair: ServingPair, queries: np.ndarray, rows: list[list[int]]) -> list[SampledQuery]:
    """Sampled queries as the monitor queues them: plain, nothing excluded, no filter."""
    return [SampledQuery(pair.serial, q, r, NOTHING_EXCLUDED, EVERY_ROW) for q, r in zip(queries, rows, strict=True)]


def test_the_exact_re_runs_take_at_most_their_share_of_a_core(version):
    """After each re-run the checker waits out what it spent, scaled to its share: 10 re-runs of
    10 ms of CPU each take at least 10 × 10 ms / share of wall time (unbounded: about 0.1 s)."""
    share = 0.2
    monitor = RecallMonitor(MonitorConfig(ks=KS, ann_sample_rate=1.0, ann_cpu_share=share), ServiceMetrics())
    pair = ServingPair(None, version.index, version)  # type: ignore[arg-type]
    monitor.reset(pair)

    def rerun(job: SampledQuery) -> None:  # an exact re-run of a known cost, in the checker's thread
        done = time.thread_time() + 0.01
        while time.thread_time() < done:
            pass

    monitor.check_sampled = rerun  # type: ignore[method-assign]
    monitor.start(None)
    try:
        started = time.monotonic()
        for row in range(10):
            monitor.maybe_sample_ann(pair.serial, version.vector(row), [], NOTHING_EXCLUDED)
        assert monitor.ann_settled(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        monitor.stop()
    assert elapsed >= 9 * 0.01 / share, elapsed  # the last re-run's wait comes after it settled
