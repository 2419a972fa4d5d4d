"""The one order of search hits (core/retrieval/ranking.py): score descending, ties to the lower id (no ids:
the earlier place); NaN last, a NO_ROW place as -inf. `best_k` is `ranked`'s first k however the
partition under it splits a tie at the k-th place; and every place that orders hits answers in
that order for scores that tie."""

from __future__ import annotations

from types import SimpleNamespace

import faiss
import numpy as np
import pytest

from core.retrieval.ranking import NO_ROW, SORT_BELOW, best_k, ranked
from core.retrieval.vectors import RowBlocks, exact_search, l2_normalized
from index.search.faiss_search import ExactRerank, exact_within, inner_products
from index.search.grouping import Groups, exact_groups, filled_groups
from index.search.merge import best_rows
from serving.monitoring.monitor import _best
from serving.search.answers import Scope
from serving.search.plans import search_range

NAN, INF = float("nan"), float("inf")


def test_ties_go_to_the_earlier_place_nan_last_and_minus_inf_before_it():
    scores = np.array([0.5, 0.9, -INF, 0.9, NAN, 0.5, 0.9], dtype=np.float32)
    assert ranked(scores).tolist() == [1, 3, 6, 0, 5, 2, 4]
    assert best_k(scores, 4).tolist() == [1, 3, 6, 0]


def test_with_ids_ties_go_to_the_lower_id_and_a_no_row_place_ranks_as_minus_inf():
    scores = np.array([0.5, 0.9, 0.9, 0.7, 0.9, 0.1], dtype=np.float32)
    ids = np.array([8, 6, 2, NO_ROW, 4, 3])
    # 0.7 at NO_ROW counts as -inf: after every real score, NO_ROW's -1 first among the -inf.
    assert ranked(scores, ids).tolist() == [2, 4, 1, 0, 5, 3]
    assert ranked(np.array([-INF, 0.0, -INF]), np.array([5, NO_ROW, 2])).tolist() == [1, 2, 0]
    # Both the score and the id tie: the earlier place.
    assert ranked(np.array([0.3, 0.3, 0.3]), np.array([4, 1, 1])).tolist() == [1, 2, 0]


def test_a_tie_across_the_kth_place_keeps_the_lowest_places_a_partition_may_drop():
    equal = np.full(5000, 0.25, dtype=np.float32)
    assert best_k(equal, 7).tolist() == list(range(7))
    # Few ties, far apart (past the first blocks looked in): the lowest of them still.
    line = np.linspace(0.0, 0.5, 20_000, dtype=np.float32)[::-1].copy()  # distinct, best first
    line[[0, 1]] = [0.99, 0.98]
    line[[9_000, 19_999, 15_000, 6_000]] = 0.97
    assert best_k(line, 4).tolist() == [0, 1, 6_000, 9_000]
    ids = np.arange(20_000)[::-1].copy()  # the lower id is the later place
    assert best_k(line, 4, ids).tolist() == [0, 1, 19_999, 15_000]
    # Every finite score taken: the rest are -inf (a filter's) or NaN, the lowest places of them.
    sparse = np.full(3000, -INF, dtype=np.float32)
    sparse[[2500, 7]] = [0.1, 0.2]
    assert best_k(sparse, 5).tolist() == [7, 2500, 0, 1, 2]
    sparse[:1000] = NAN
    sparse[2500] = 0.1
    assert best_k(sparse, 5).tolist() == [2500, 1000, 1001, 1002, 1003]


@pytest.mark.parametrize("seed", range(4))
def test_best_k_is_ranked_first_k_whatever_the_ties(seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
        n = int(rng.choice([3, SORT_BELOW, 700, 3000]))
        lines, k = int(rng.integers(1, 4)), int(rng.integers(0, 60))
        levels = int(rng.integers(1, 40))
        scores = (rng.integers(0, levels, size=(lines, n)) / levels).astype(np.float32)
        odd = rng.random((lines, n))
        scores[odd < 0.05] = NAN
        scores[(odd > 0.05) & (odd < 0.05 + 0.5 * rng.random())] = -INF
        ids = rng.permutation(scores.size).reshape(scores.shape) if seed % 2 else rng.integers(-1, 6, scores.shape)
        for s, i in ((scores, ids), (scores[0], ids[0])):
            assert np.array_equal(best_k(s, k), ranked(s)[..., :k])
            assert np.array_equal(best_k(s, k, i), ranked(s, i)[..., :k])
    assert best_k(np.zeros((0, 3000)), 5).shape == (0, 5) and best_k(np.zeros(0), 5).shape == (0,)


def test_ranked_is_a_stable_sort_of_the_scores_and_the_lexsort_of_rows_the_merge_used():
    rng = np.random.default_rng(7)
    scores = (rng.integers(0, 5, size=(6, 40)) / 5).astype(np.float32)
    rows = rng.integers(-1, 30, size=(6, 40))
    assert np.array_equal(ranked(scores), np.argsort(-scores, axis=1, kind="stable"))
    keys = np.where(rows == NO_ROW, -np.inf, scores)
    assert np.array_equal(ranked(scores, rows), np.lexsort((rows, -keys), axis=-1))


def _tied_vectors(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit rows of ±0.5 (every product exact, whatever order a kernel adds in: ties are ties),
    every 7th the query itself (score 1), the others below it (0.5 at most)."""
    rng = np.random.default_rng(seed)
    query = np.full((1, 4), 0.5, dtype=np.float32)
    signs = rng.integers(1, 16, size=n)  # not 0: no other row is the query
    vectors = np.where((signs[:, None] >> np.arange(4)) & 1, -0.5, 0.5).astype(np.float32)
    vectors[::7] = query
    return vectors, query


def test_the_merge_and_the_monitor_answer_in_the_one_order():
    rng = np.random.default_rng(1)
    scores = (rng.integers(0, 4, size=(3, 600)) / 4).astype(np.float32)
    rows = np.stack([rng.permutation(600) for _ in range(3)])
    rows[:, ::50] = NO_ROW
    top_scores, top_rows = best_rows(rows, scores, 12)
    assert np.array_equal(top_rows, np.take_along_axis(rows, ranked(scores, rows)[:, :12], axis=1))
    line = np.full(5000, -np.inf, dtype=np.float32)
    line[1000:3000] = 0.25  # ties across the depth: the lowest places
    line[[4000, 17]] = 0.5, 0.1
    assert _best(line, 10).tolist() == ranked(line)[:10].tolist() == [4000, *range(1000, 1009)]
    masked = np.full(5000, -np.inf, dtype=np.float32)
    masked[[4000, 30, 2000]] = 0.5
    assert _best(masked, 10).tolist() == [30, 2000, 4000]


def test_exact_search_keeps_ties_in_faiss_order_by_block_and_place():
    vectors, query = _tied_vectors()
    alone = exact_search(vectors, query, 30)[1]
    # The live rows re-ranked by place: faiss's own answer, tied rows in its order.
    assert exact_search(vectors, query, 30, np.ones(len(vectors), bool))[1].tolist() == alone.tolist()
    blocks = exact_search(RowBlocks([vectors[:200], vectors[200:]]), query, 60)[1][0]
    first = faiss.knn(query, vectors[:200], 60, metric=faiss.METRIC_INNER_PRODUCT)
    second = faiss.knn(query, vectors[200:], 60, metric=faiss.METRIC_INNER_PRODUCT)
    scores = np.concatenate([first[0], second[0]], axis=1)
    places = np.concatenate([first[1], second[1] + 200], axis=1)
    assert blocks.tolist() == places[0, best_k(scores, 60)[0]].tolist()
    tied = set(range(0, 400, 7))
    assert all(r < 200 for r in blocks[:29]) and set(blocks[:58].tolist()) == tied


def test_the_rerank_orders_exact_ties_by_the_order_the_index_found_them():
    vectors, query = _tied_vectors()
    noisy = l2_normalized(vectors + 0.01 * np.random.default_rng(2).standard_normal(vectors.shape).astype(np.float32))
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(noisy)  # approximate scores that differ where the exact ones tie
    rerank = ExactRerank(index, vectors, factor=4)
    _, candidates = index.search(query, 40)
    exact = vectors[candidates[0]] @ query[0]
    scores, rows = rerank.search(query, 10)
    assert rows[0].tolist() == candidates[0, best_k(exact, 10)].tolist()
    assert rows[0].tolist() == [r for r in candidates[0].tolist() if r % 7 == 0][:10]
    assert rows[0].tolist() != sorted(rows[0].tolist())  # the index's order, not the rows'


def test_exact_within_one_query_puts_ties_in_row_order():
    vectors, query = _tied_vectors(n=2000)
    rows = np.arange(3, 2000, 2)  # a filter's rows, ascending
    scores, found = exact_within(vectors, query, 12, rows)
    products = vectors[rows] @ query[0]
    assert found[0].tolist() == rows[ranked(products)[:12]].tolist()
    assert found[0].tolist() == [r for r in rows.tolist() if r % 7 == 0][:12]


def test_a_filtered_min_score_search_puts_ties_in_row_order():
    vectors, query = _tied_vectors(n=2000)
    allowed = np.ones(len(vectors), bool)
    allowed[::3] = False
    pair = SimpleNamespace(index_version=SimpleNamespace(live_mask=None), vectors=vectors)
    answer = search_range(pair, query[0], 15, frozenset({7}), Scope(allowed=allowed, min_score=0.5))
    rows = [r for r in range(2000) if allowed[r] and r != 7 and r % 7 == 0]
    assert [h.row for h in answer.hits] == rows[:15] and answer.truncated


def test_grouped_answers_rank_tied_groups_and_rows_in_the_one_order():
    vectors, query = _tied_vectors(n=420)
    names = [f"g{(r // 3) % 40}" for r in range(len(vectors))]  # each group's rows spread
    groups = Groups.of_values("item", names)
    top = exact_groups(query[0], vectors, groups, 8, None, frozenset(), None)
    best = np.maximum.reduceat(inner_products(vectors, query[0])[groups.rows], groups.offsets[:-1])
    assert top == ranked(best)[:9].tolist()
    answer = filled_groups(top, query[0], vectors, groups, 3, None, frozenset(), None, 8)
    assert [g for g, _ in answer.groups] == top[:8]  # tied groups stay in the order found
    for group, hits in answer.groups:
        its = groups.rows[groups.offsets[group] : groups.offsets[group + 1]]
        assert [r for r, _ in hits] == its[ranked(inner_products(vectors, query[0], its))[:3]].tolist()
