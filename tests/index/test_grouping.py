"""Grouped search (index/search/grouping.py): k distinct groups whenever k groups have an eligible row,
on random catalogs, for every index type, with and without a filter and deleted rows."""

from __future__ import annotations

import numpy as np
import pytest

from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import build_index
from index.search.faiss_search import searchable
from index.search.filters import FieldRows, FieldSpec
from index.search.grouping import EXACT_PASS, MAX_CANDIDATES, OVERFETCH, Groups, search_groups

FACTORIES = {
    "Flat": {},
    "IVF16,Flat": {"nprobe": 1},  # one list of 16: most groups sit in lists it never probes
    "HNSW8": {"efSearch": 8},
    "IVF16,SQ8": {"nprobe": 1, "rerank": 4},  # approximate codes, re-ranked exactly
}


def random_catalog(seed: int, n: int = 600, dim: int = 16) -> tuple[np.ndarray, list[str | None]]:
    """Vectors clustered by group (so a query's neighbours crowd into few groups) and each row's
    group name; about 5% of rows carry none."""
    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(20, 120))
    centres = rng.normal(size=(n_groups, dim))
    group = rng.integers(0, n_groups, size=n)
    vectors = l2_normalized((centres[group] + 0.15 * rng.normal(size=(n, dim))).astype(np.float32))
    names: list[str | None] = [None if rng.random() < 0.05 else f"g{g:03d}" for g in group]
    return vectors, names


def groups_of(names: list[str | None]) -> Groups:
    return Groups.of_values("item", names)


def reference(vectors, names, query, k, per_group, eligible, exclude):
    """Brute force: every eligible row scored, each group's best rows, groups by their best."""
    scores = vectors @ query
    best: dict[str, list[tuple[float, int]]] = {}
    for row in np.argsort(-scores, kind="stable"):
        if names[row] is None or not eligible[row] or row in exclude:
            continue
        best.setdefault(names[row], []).append((float(scores[row]), int(row)))
    ranked = sorted(best.items(), key=lambda g: -g[1][0][0])[:k]
    return [(name, [row for _, row in hits[:per_group]]) for name, hits in ranked]


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("seed", range(6))
def test_k_distinct_groups_whenever_k_groups_match(factory, seed):
    vectors, names = random_catalog(seed)
    groups = groups_of(names)
    index = searchable(build_index(vectors, factory, FACTORIES[factory]), FACTORIES[factory], vectors)
    rng = np.random.default_rng(100 + seed)
    n = len(vectors)
    filtered = seed % 2 == 1
    allowed = rng.random(n) < 0.3 if filtered else np.ones(n, dtype=bool)
    if seed % 3 == 0:  # takedowns: deleted rows are masked like a filter's
        allowed &= rng.random(n) > 0.1
    queries = l2_normalized(rng.normal(size=(8, vectors.shape[1])).astype(np.float32))
    exclude = [frozenset(rng.choice(n, size=3, replace=False).tolist()) for _ in queries]
    k, per_group = int(rng.integers(1, 30)), int(rng.integers(1, 4))
    answers = search_groups(
        index, vectors, queries, k, groups, per_group, allowed=None if allowed.all() else allowed, exclude=exclude
    )
    for query, answer, skip in zip(queries, answers, exclude, strict=True):
        expected = reference(vectors, names, query, 10**6, per_group, allowed, skip)
        found = [groups.label(g) for g, _ in answer.groups]
        assert len(found) == len(set(found)) == min(k, len(expected)), (factory, k, len(expected))
        assert answer.truncated == (len(expected) < k)
        by_name = dict(expected)
        for group, hits in answer.groups:
            rows = [row for row, _ in hits]
            # Each group's rows are its exact best, whichever candidates the index met.
            assert rows == by_name[groups.label(group)]
            assert all(allowed[r] and r not in skip for r in rows)
        scores = [hits[0][1] for _, hits in answer.groups]
        assert scores == sorted(scores, reverse=True)
        if factory == "Flat":  # exact: the very groups brute force ranks first
            assert found == [name for name, _ in expected[:k]]


def test_widening_is_bounded_and_reported():
    """A query whose neighbours crowd into a few groups needs wider rounds; past MAX_CANDIDATES
    rows the exact pass answers, and the answer says which."""
    rng = np.random.default_rng(7)
    dim = 16
    # 3,000 rows of one group around the query, then 50 groups of 2 rows far from it.
    near = l2_normalized((np.ones(dim) + 0.05 * rng.normal(size=(3000, dim))).astype(np.float32))
    far = l2_normalized(rng.normal(size=(100, dim)).astype(np.float32))
    vectors = np.vstack([near, far])
    names = ["crowd"] * 3000 + [f"g{i // 2}" for i in range(100)]
    groups = groups_of(names)
    query = l2_normalized(np.ones((1, dim), dtype=np.float32))
    index = build_index(vectors, "HNSW16", {"efSearch": 16})
    (answer,) = search_groups(index, vectors, query, 10, groups)
    assert len(answer.groups) == 10 and answer.candidates == EXACT_PASS
    (easy,) = search_groups(index, vectors, far[:1], 3, groups)
    assert OVERFETCH * 3 <= easy.candidates <= MAX_CANDIDATES


def test_min_score_counts_groups_that_reach_it():
    vectors, names = random_catalog(3)
    groups = groups_of(names)
    index = build_index(vectors, "Flat", {})
    query = vectors[:1]
    (answer,) = search_groups(index, vectors, query, 1000, groups, min_score=0.9)
    expected = [g for g, hits in reference(vectors, names, query[0], 10**6, 1, np.ones(len(names), bool), frozenset())]
    reaching = [
        g for g in expected if float(np.max(vectors[[i for i, n in enumerate(names) if n == g]] @ query[0])) >= 0.9
    ]
    assert [groups.label(g) for g, _ in answer.groups] == reaching
    assert not answer.truncated
    (cut,) = search_groups(index, vectors, query, 1, groups, min_score=0.9)
    assert cut.truncated == (len(reaching) > 1)


def test_groups_from_an_items_table_field():
    table = ItemTable(
        ids=["a", "b", "c"], labels=None, paths=["x", "y", "z"], metadata=[{"item": "p"}, {}, {"item": "p"}]
    )
    rows = FieldRows.build(FieldSpec("item", "string"), (m.get("item") for m in table.metadata), 3)
    groups = Groups.of("item", rows, 3)
    assert groups.codes.tolist() == [0, -1, 0] and groups.has_value.tolist() == [True, False, True]
    assert groups.rows_of(0).tolist() == [0, 2]
