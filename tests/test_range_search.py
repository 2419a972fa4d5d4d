"""Every row at or above a score (`index.range_search`) on each index type, against exact search:
clusters of near-copies among random vectors, with deleted and excluded rows and a bound."""

from __future__ import annotations

import numpy as np
import pytest

from index.faiss_index import ExactRerank, build_index, searchable, with_default_rerank
from index.range_search import by_range_search, reaching

FACTORIES = {
    "flat": ("Flat", {}),
    "ivf-flat": ("IVF8,Flat", {"nprobe": 8}),  # every list probed: as complete as exact search
    "ivf-pq-reranked": ("IVF8,PQ8", {"nprobe": 8}),
    "hnsw": ("HNSW16", {"efSearch": 16}),
}


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    """300 groups of 8 noisy copies of a random 32-d vector: scores from ~0 to ~0.99."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((300, 32)).astype(np.float32)
    x = np.concatenate([centres + 0.35 * rng.standard_normal(centres.shape).astype(np.float32) for _ in range(8)])
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module", params=list(FACTORIES), ids=list(FACTORIES))
def index(request, vectors):
    factory, params = FACTORIES[request.param]
    built = build_index(vectors, factory, params)
    return request.param, searchable(built, with_default_rerank(built, params), vectors)


def exact_reaching(vectors, query, min_score, drop=()) -> set[int]:
    return set(np.flatnonzero(vectors @ query >= min_score).tolist()) - set(drop)


@pytest.mark.parametrize("min_score", [0.8, 0.6, 0.3])
def test_every_row_at_or_above_the_score_and_none_below(index, vectors, min_score):
    kind, searched = index
    assert by_range_search(searched) == (kind != "hnsw")
    assert isinstance(searched, ExactRerank) == (kind == "ivf-pq-reranked")
    queries = vectors[:40]
    answers = reaching(searched, queries, min_score, limit=len(vectors), exclude=[{i} for i in range(40)])
    found = missed = 0
    for i, answer in enumerate(answers):
        assert not answer.truncated and i not in answer.rows
        assert (answer.scores >= min_score).all() and (np.diff(answer.scores) <= 0).all()
        # The scores are the exact ones, PQ codes re-ranked included.
        np.testing.assert_allclose(answer.scores, vectors[answer.rows] @ queries[i], atol=1e-5)
        truth = exact_reaching(vectors, queries[i], min_score, drop=[i])
        found += len(truth & set(answer.rows.tolist()))
        missed += len(truth - set(answer.rows.tolist()))
        assert set(answer.rows.tolist()) <= truth | set(np.flatnonzero(vectors @ queries[i] >= min_score - 1e-6))
    assert found > 40 and missed <= (0 if kind in ("flat", "ivf-flat") else 0.01 * found), (found, missed)


def test_the_bound_cuts_the_answer_and_says_so(index, vectors):
    _, searched = index
    query = vectors[:1]
    everything = reaching(searched, query, 0.3, limit=len(vectors))[0]
    assert len(everything.rows) > 5 and not everything.truncated
    cut = reaching(searched, query, 0.3, limit=5)[0]
    assert cut.truncated and len(cut.rows) == 5
    np.testing.assert_array_equal(cut.rows, everything.rows[:5])  # the best five, in order
    assert not reaching(searched, query, 0.3, limit=len(everything.rows))[0].truncated


def test_deleted_and_excluded_rows_never_answer(index, vectors):
    _, searched = index
    query = vectors[7:8]
    before = reaching(searched, query, 0.5, limit=100)[0].rows
    assert len(before) >= 4
    live = np.ones(len(vectors), dtype=bool)
    live[before[:2]] = False
    after = reaching(searched, query, 0.5, limit=100, live=live, exclude=[{int(before[2])}])[0].rows
    assert set(after.tolist()) == set(before[3:].tolist())


def test_a_score_exactly_at_the_threshold_answers(vectors):
    flat = build_index(vectors, "Flat")
    wide = reaching(flat, vectors[:1], 0.0, limit=10)[0]  # faiss's own rounding of each score
    row, score = int(wide.rows[3]), float(wide.scores[3])
    assert row in reaching(flat, vectors[:1], score, limit=10)[0].rows.tolist()  # faiss alone keeps only > radius


def test_no_rows_reaching_is_an_empty_answer(index, vectors):
    _, searched = index
    rng = np.random.default_rng(1)
    far = rng.standard_normal((1, 32)).astype(np.float32)
    far /= np.linalg.norm(far)
    answer = reaching(searched, far, 0.999, limit=10)[0]
    assert len(answer.rows) == 0 and not answer.truncated
    with pytest.raises(ValueError, match="min_score"):
        reaching(searched, far, 1.5, limit=10)
