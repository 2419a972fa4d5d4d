"""Every row at or above a score (`index.search.range_search`) on each index type, against exact search:
clusters of near-copies among random vectors, with deleted and excluded rows and a bound."""

from __future__ import annotations

import numpy as np
import pytest

from index.build.duplicates import find_groups
from index.search.faiss_index import build_index, with_default_rerank
from index.search.faiss_search import ExactRerank, searchable
from index.search.range_search import by_range_search, reaching

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


class StubVersion:
    """What `find_groups` reads of an index version: its index as searched, vectors, deleted rows."""

    def __init__(self, vectors: np.ndarray, factory: str, live: np.ndarray | None = None) -> None:
        self.vectors, self.live_mask = vectors, live
        self._index = build_index(vectors, factory)

    def load(self) -> StubVersion:
        return self

    def searchable(self):
        return self._index


@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_groups_are_the_connected_components_of_the_pairs(factory):
    """A chain a-b-c (a and c below the threshold, linked through b), a pair, and loners; a
    deleted row bridging two groups does not join them."""
    rng = np.random.default_rng(3)
    plane = np.linalg.qr(rng.standard_normal((64, 2)))[0].T.astype(np.float32)  # two orthonormal rows

    def at(degrees: float) -> np.ndarray:  # a unit vector in the plane: cosines are cos(angle between)
        return np.cos(np.radians(degrees)) * plane[0] + np.sin(np.radians(degrees)) * plane[1]

    # Threshold 0.85 (31.8°): a chain 0°-25°-50° (0° and 50° apart), a pair 110°-120°, a bridge
    # at 80° (30° from 50° and from 110°), and 200 random vectors far from all of them.
    far = rng.standard_normal((200, 64)).astype(np.float32)
    vectors = np.vstack([at(0), at(25), at(50), at(110), at(120), at(80), far / np.linalg.norm(far, axis=1)[:, None]])
    scores = vectors @ vectors.T
    min_score = 0.85
    assert scores[2, 5] >= min_score and scores[5, 3] >= min_score > scores[0, 2]
    live = np.ones(len(vectors), dtype=bool)
    live[5] = False

    groups = find_groups(StubVersion(vectors, factory, live), min_score, max_neighbours=10, batch_size=64)
    assert [sorted(m.tolist()) for m in groups.members] == [[0, 1, 2], [3, 4]]
    assert groups.members[0][0] == 1  # led by its most connected member
    assert groups.edges == 3 and groups.truncated_rows == 0 and groups.searched_rows == len(vectors) - 1
    assert groups.best_match[0] == groups.best_match[2] == 1 and (groups.best_match[3], groups.best_match[4]) == (4, 3)
    np.testing.assert_allclose(groups.best_score[[0, 2]], scores[1, [0, 2]], atol=1e-5)
    assert np.isnan(groups.best_score[5]) and groups.best_match[5] == -1

    with_bridge = find_groups(StubVersion(vectors, factory), min_score, max_neighbours=10, batch_size=64)
    assert [sorted(m.tolist()) for m in with_bridge.members] == [[0, 1, 2, 3, 4, 5]]
