"""core.retrieval.metrics: Recall@K, MAP@R and ANN recall, checked against brute-force numpy."""

from __future__ import annotations

import numpy as np
import pytest

from core.retrieval.metrics import (
    _neighbors_without_self,
    map_at_r,
    recall_at_k,
    recall_from_neighbor_labels,
)
from index.search.ann_recall import ann_recall
from index.search.faiss_index import apply_search_params, build_index


def others_by_similarity(embeddings: np.ndarray) -> np.ndarray:
    """For each item, every other item ordered by cosine similarity (self excluded)."""
    e = embeddings.astype(np.float64)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    sims = e @ e.T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1, kind="stable")[:, :-1]


def brute_recall(embeddings, labels, ks) -> dict[int, float]:
    labels = np.asarray(labels)
    order = others_by_similarity(embeddings)
    return {k: float(np.mean([(labels[order[i, :k]] == labels[i]).any() for i in range(len(labels))])) for k in ks}


def brute_map_at_r(embeddings, labels) -> float:
    labels = np.asarray(labels)
    order = others_by_similarity(embeddings)
    aps = []
    for i in range(len(labels)):
        r = int((labels == labels[i]).sum()) - 1
        if r == 0:
            continue
        relevant = labels[order[i, :r]] == labels[i]
        precision = np.cumsum(relevant) / np.arange(1, r + 1)
        aps.append(float((precision * relevant).sum() / r))
    return float(np.mean(aps))


def labelled_data(seed: int = 0, n: int = 300, classes: int = 15, dim: int = 8):
    """Overlapping clusters (recall is neither 0 nor 1) plus exact duplicate vectors."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    labels = rng.integers(0, classes, n)
    x = (centres[labels] + rng.normal(size=(n, dim)) * 0.8).astype(np.float32)
    labels = [f"c{v}" for v in labels]
    # Duplicates with the same label, including a run of 6 identical copies (more ties than
    # the K+1 neighbours asked for, so the query itself may not even be among them).
    x = np.concatenate([x, x[:10], np.repeat(x[10:11], 5, axis=0)])
    labels = labels + labels[:10] + [labels[10]] * 5
    # Two identical vectors with labels no other item has: each one's only tie is the other,
    # so Recall@K for both is 0 unless a query is allowed to find itself.
    twin = rng.normal(size=(1, dim)).astype(np.float32) * 5
    x = np.concatenate([x, twin, twin])
    labels = labels + ["solo-a", "solo-b"]
    return x, np.asarray(labels)


# --- Recall@K ---------------------------------------------------------------------------------


def test_recall_from_neighbor_labels_by_hand():
    neighbours = np.array([[1, 2, 3], [2, 2, 1], [5, 5, 5], [1, 1, 2]])
    queries = np.array([2, 2, 1, 2])
    recall = recall_from_neighbor_labels(neighbours, queries, (1, 2, 3))
    assert recall == {1: 0.25, 2: 0.5, 3: 0.75}
    with pytest.raises(ValueError, match="need 4 neighbours"):
        recall_from_neighbor_labels(neighbours, queries, (1, 4))
    with pytest.raises(ValueError, match="no queries"):
        recall_from_neighbor_labels(np.zeros((0, 3)), np.zeros(0), (1,))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_at_k_matches_brute_force(seed):
    x, labels = labelled_data(seed)
    ks = (1, 2, 4, 8, 16)
    got = recall_at_k(x, labels, ks)
    expected = brute_recall(x, labels, ks)
    assert got == pytest.approx(expected, abs=1e-12)
    assert 0.1 < got[1] < 0.95  # the data is neither trivial nor hopeless
    assert all(got[a] <= got[b] for a, b in zip(ks, ks[1:], strict=False))


def test_self_is_excluded_even_among_exact_ties():
    x, labels = labelled_data(0)
    n = len(labels)
    for k in (1, 3, 8):
        _, rows = _neighbors_without_self(x, k)
        assert rows.shape == (n, k)
        assert not (rows == np.arange(n)[:, None]).any()
        assert all(len(set(r)) == k for r in rows.tolist())
    # The exact twins with labels of their own are misses at every K: each found the other.
    solo = np.flatnonzero(np.char.startswith(labels.astype(str), "solo"))
    _, rows = _neighbors_without_self(x, 1)
    assert rows[solo, 0].tolist() == solo[::-1].tolist()
    assert recall_at_k(x[solo], labels[solo], (1,)) == {1: 0.0}
    # All items identical (every score ties): still never the query itself.
    same = np.ones((6, 4), np.float32)
    _, rows = _neighbors_without_self(same, 2)
    assert not (rows == np.arange(6)[:, None]).any()
    assert recall_at_k(same, ["a", "b", "c", "d", "e", "f"], (1, 2)) == {1: 0.0, 2: 0.0}


def test_recall_at_k_on_tiny_sets_pads_missing_neighbours():
    x = np.array([[1, 0], [0.9, 0.1], [0, 1]], np.float32)
    labels = ["a", "b", "a"]
    got = recall_at_k(x, labels, (1, 2, 4, 8))
    assert got == brute_recall(x, labels, (1, 2, 4, 8))
    assert got == {1: 0.0, 2: pytest.approx(2 / 3), 4: pytest.approx(2 / 3), 8: pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="at least two"):
        recall_at_k(x[:1], ["a"], (1,))


def test_recall_at_k_with_integer_labels():
    x, labels = labelled_data(4)
    codes = np.unique(labels, return_inverse=True)[1]
    assert recall_at_k(x, codes, (1, 4)) == recall_at_k(x, labels, (1, 4))


# --- MAP@R ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_map_at_r_matches_brute_force(seed):
    x, labels = labelled_data(seed)
    got = map_at_r(x, labels)
    assert got == pytest.approx(brute_map_at_r(x, labels), abs=1e-12)
    assert 0.0 < got < 1.0


def test_map_at_r_by_hand():
    # Class a has 3 items: for a0 (R=2) the order is a1, b0, a2 → AP = (1/1 + 0) / 2 = 0.5.
    x = np.array([[1.0, 0.0], [0.99, 0.14], [0.8, 0.6], [0.96, 0.28], [0.0, 1.0]], np.float32)
    labels = ["a", "a", "a", "b", "c"]  # "c" has no other item and is not a query
    assert map_at_r(x, labels) == pytest.approx(brute_map_at_r(x, labels))
    perfect = np.array([[1, 0], [1, 0.01], [0, 1], [0.01, 1]], np.float32)
    assert map_at_r(perfect, [0, 0, 1, 1]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least one class with two items"):
        map_at_r(x[:2], ["a", "b"])


# --- ANN recall -------------------------------------------------------------------------------


def test_ann_recall():
    x, _ = labelled_data(0, n=1000)
    queries = x[:50] + 0.05
    flat = build_index(x, "Flat", device="cpu")
    assert ann_recall(flat, x, queries, 10) == 1.0
    ivf = build_index(x, "IVF16,Flat", search_params={"nprobe": 1}, device="cpu")
    partial = ann_recall(ivf, x, queries, 10)
    assert 0.0 < partial < 1.0
    apply_search_params(ivf, {"nprobe": 16})
    assert ann_recall(ivf, x, queries, 10) == 1.0


def test_exact_search_matches_brute_force_and_keeps_unit_rows_in_place():
    from core.retrieval.vectors import exact_search, unit_rows

    rng = np.random.default_rng(3)
    raw = rng.standard_normal((300, 16)).astype(np.float32) * 3  # not unit length: normalised
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    assert unit_rows(unit) is unit  # a model's embeddings are searched as they are, not copied
    assert unit_rows(raw) is not raw and np.allclose(unit_rows(raw), unit, atol=1e-6)
    for database in (raw, unit):
        scores, rows = exact_search(database, raw[:20], 5)
        expected = np.argsort(-(unit[:20] @ unit.T), axis=1, kind="stable")[:, :5]
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_allclose(scores, np.take_along_axis(unit[:20] @ unit.T, expected, 1), atol=1e-5)
    _, none = exact_search(np.zeros((0, 16), np.float32), unit[:2], 3)
    assert (none == -1).all()


def test_item_recall_counts_a_query_by_its_item_among_the_k_best_items():
    from training.runs.evaluate import item_recall

    # Items a, b, c. a0's nearest image is b0 (another item), its own a1 comes third: item
    # R@1 misses, R@2 hits (b, then a). The other five find their item first.
    vectors = np.array(
        [[1, 0, 0], [0.6, 0.8, 0], [0.95, 0.31, 0], [0.6, 0.8, 0.02], [0, 0, 1], [0, 0.1, 0.99]], dtype=np.float32
    )
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    items = ["a", "a", "b", "b", "c", "c"]
    figures = item_recall(vectors, items, [1, 2])
    rows = np.argsort(-(vectors @ vectors.T), axis=1)[:, 1:]  # brute force, own row left out
    firsts = [[items[r] for r in row] for row in rows]
    best_items = [list(dict.fromkeys(f)) for f in firsts]
    expected = {str(k): np.mean([items[i] in best_items[i][:k] for i in range(6)]) for k in (1, 2)}
    assert figures == pytest.approx(expected)
    assert figures["1"] < 1.0 and figures["2"] == 1.0
    assert item_recall(vectors, ["a", "b", "c", "d", "e", "f"], [1]) is None  # no item has two images
