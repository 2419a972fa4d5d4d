"""index.search.faiss_index, faiss_search and ann_recall: building, searching and tuning
inner-product indexes on L2-normalised vectors."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from core.retrieval.vectors import as_float32_rows, exact_search, l2_normalized
from index.search.faiss_index import (
    apply_search_params,
    build_index,
    load_index,
    save_index,
    select_device,
    stores_exact_vectors,
    with_default_rerank,
)
from index.search.faiss_search import search, searchable

DIM = 16


def clustered(n: int, clusters: int = 20, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """Points around random centres: an index has real neighbour structure to find."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)) * 3
    assign = rng.integers(0, clusters, n)
    return (centres[assign] + rng.normal(size=(n, dim)) * 0.3).astype(np.float32)


def brute_force(database: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    d = database / np.linalg.norm(database, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    sims = q.astype(np.float64) @ d.astype(np.float64).T
    rows = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, rows, axis=1), rows


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return clustered(2000)


@pytest.fixture(scope="module")
def queries() -> np.ndarray:
    return clustered(100, seed=1)


@pytest.fixture(scope="module")
def built(data):
    """Indexes over `data` by factory string, built once per module (IVF-PQ training is slow)."""
    cache: dict[str, faiss.Index] = {}

    def get(factory: str) -> faiss.Index:
        if factory not in cache:
            cache[factory] = build_index(data, factory, device="cpu")
        return cache[factory]

    return get


# --- building ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, params, min_recall",
    [
        ("Flat", None, 1.0),
        ("IVF16,Flat", {"nprobe": 16}, 1.0),  # probing every list is exhaustive
        ("IVF16,Flat", {"nprobe": 4}, 0.8),
        ("HNSW16", {"efSearch": 256}, 0.95),
        ("IVF16,PQ4", {"nprobe": 16}, 0.3),
    ],
)
def test_build_index_finds_true_neighbours(data, queries, built, factory, params, min_recall):
    index = built(factory)
    if params:
        apply_search_params(index, params)
    assert index.ntotal == len(data) and index.d == DIM
    assert index.metric_type == faiss.METRIC_INNER_PRODUCT
    assert index.is_trained
    k = 10
    scores, rows = search(index, queries, k)
    assert rows.shape == (len(queries), k) and scores.shape == (len(queries), k)
    assert (rows >= 0).all()
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    _, truth = brute_force(data, queries, k)
    recall = np.mean([len(set(r) & set(t)) / k for r, t in zip(rows, truth, strict=True)])
    assert recall >= min_recall, (factory, recall)


def test_build_index_applies_search_params(data):
    index = build_index(data[:500], "HNSW16", search_params={"efSearch": 77}, device="cpu")
    assert faiss.downcast_index(index).hnsw.efSearch == 77


def test_flat_scores_are_cosine_similarities(data, queries, built):
    index = built("Flat")
    scores, rows = search(index, queries, 5)
    expected_scores, expected_rows = brute_force(data, queries, 5)
    np.testing.assert_array_equal(rows, expected_rows)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-5)
    assert scores.max() <= 1.0 + 1e-5


def test_ivf_trains_on_a_sample(data):
    index = build_index(data, "IVF16,Flat", train_size=500, device="cpu", seed=3)
    assert index.is_trained and index.ntotal == len(data)


def test_search_params_are_applied(data):
    index = build_index(data, "IVF16,Flat", search_params={"nprobe": 5}, device="cpu")
    assert faiss.extract_index_ivf(index).nprobe == 5
    apply_search_params(index, {"nprobe": 9})
    assert faiss.extract_index_ivf(index).nprobe == 9
    with pytest.raises(ValueError, match="does not accept search parameter"):
        apply_search_params(build_index(data[:50], "Flat", device="cpu"), {"nprobe": 2})


@pytest.mark.parametrize("factory", ["NotAnIndex", "IVF16,Bogus", ""])
def test_invalid_factory_string(data, factory):
    with pytest.raises(ValueError, match="invalid faiss factory string"):
        build_index(data[:100], factory, device="cpu")


def test_build_rejects_bad_vectors(data):
    with pytest.raises(ValueError, match="zero vectors"):
        build_index(np.zeros((0, DIM), np.float32), device="cpu")
    bad = data[:50].copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        build_index(bad, device="cpu")
    with pytest.raises(ValueError, match="2-D"):
        build_index(data[0], device="cpu")


def test_save_and_load_round_trip(tmp_path, queries, built):
    index = built("HNSW16")
    path = tmp_path / "index.faiss"
    save_index(index, path)
    loaded = load_index(path)
    assert loaded.ntotal == index.ntotal
    np.testing.assert_array_equal(search(loaded, queries, 5)[1], search(index, queries, 5)[1])
    with pytest.raises(FileNotFoundError):
        load_index(tmp_path / "missing.faiss")


def test_only_indexes_that_keep_the_vectors_count_as_exact(data, built):
    for factory in ("Flat", "HNSW16", "IVF16,Flat"):
        assert stores_exact_vectors(built(factory))
        assert with_default_rerank(built(factory), {"nprobe": 4}) == {"nprobe": 4}
    # Lossy codes decode to approximations: such an index is re-ranked unless told otherwise.
    for lossy in (built("IVF16,PQ4"), build_index(data, "IVF16,SQ8", device="cpu")):
        assert not stores_exact_vectors(lossy)
        assert with_default_rerank(lossy, {}) == {"rerank": 10}
        assert with_default_rerank(lossy, {"rerank": 0}) == {"rerank": 0}


def test_exact_rerank_recovers_what_pq_codes_lose(data, queries):
    exact = l2_normalized(data)
    pq = build_index(data, "IVF16,PQ2", {"nprobe": 16}, device="cpu")  # 2 bytes a vector: very lossy
    _, truth = brute_force(data, queries, 10)

    def recall(index) -> float:
        _, rows = search(index, queries, 10)
        return float(np.mean([len(set(r) & set(t)) / 10 for r, t in zip(rows, truth, strict=True)]))

    assert searchable(pq, {"nprobe": 16}, exact) is pq
    reranked = searchable(pq, {"nprobe": 16, "rerank": 20}, exact)
    assert reranked.ntotal == pq.ntotal and reranked.d == pq.d
    assert recall(pq) < 0.8 < recall(reranked)
    scores, rows = search(reranked, queries, 10)
    # Scores are exact inner products of the rows returned, best first.
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", l2_normalized(queries), exact[rows]), atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()
    # Fewer vectors than candidates asked for: the missing places are -1, as faiss answers.
    small = build_index(data[:30], "PQ2x4", device="cpu")
    scores, rows = searchable(small, {"rerank": 4}, exact[:30]).search(l2_normalized(queries[:2]), 40)
    assert (rows[:, 30:] == -1).all() and (rows[:, :30] >= 0).all()
    with pytest.raises(ValueError, match="rerank must be a whole number"):
        apply_search_params(pq, {"rerank": 1.5})
    with pytest.raises(ValueError, match="needs the stored vectors"):
        searchable(pq, {"rerank": 4}, None)


def test_exact_rerank_scores_candidates_in_the_memory_map_as_a_gather_would(data, queries, tmp_path):
    exact = l2_normalized(data)
    np.save(tmp_path / "embeddings.npy", exact)
    mapped = np.load(tmp_path / "embeddings.npy", mmap_mode="r")
    pq = build_index(data, "IVF16,PQ2", {"nprobe": 4}, device="cpu")
    reranked = searchable(pq, {"rerank": 10}, mapped)
    q = l2_normalized(queries)
    scores, rows = reranked.search(q, 10)
    # The reference: every candidate's vector gathered out of the map, multiplied, sorted.
    _, candidates = pq.search(q, 100)
    reference = np.einsum("qd,qcd->qc", q, exact[np.maximum(candidates, 0)])
    reference[candidates < 0] = -np.inf
    order = np.argsort(-reference, axis=1, kind="stable")[:, :10]
    np.testing.assert_allclose(scores, np.take_along_axis(reference, order, axis=1), atol=1e-6)
    assert (rows == np.take_along_axis(candidates, order, axis=1)).mean() > 0.999  # float ties aside
    # A copy of the vectors that is not C-ordered float32 is gathered instead: the same answers.
    strided = np.asfortranarray(exact)
    scores_copy, rows_copy = searchable(pq, {"rerank": 10}, strided).search(q, 10)
    np.testing.assert_allclose(scores_copy, scores, atol=1e-6)


# --- searching --------------------------------------------------------------------------------


def test_search_argument_errors(data):
    index = build_index(data[:100], "Flat", device="cpu")
    for k in (0, -1):
        with pytest.raises(ValueError, match="k must be positive"):
            search(index, data[:2], k)
    with pytest.raises(ValueError, match="dimension 16, got 8"):
        search(index, data[:2, :8], 1)
    nan_query = data[:2].copy()
    nan_query[1, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        search(index, nan_query, 1)
    inf_query = data[:2].copy()
    inf_query[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        search(index, inf_query, 1)


def test_search_k_larger_than_the_index(data):
    index = build_index(data[:7], "Flat", device="cpu")
    scores, rows = search(index, data[:3], 50)
    assert rows.shape == (3, 7)
    assert sorted(rows[0].tolist()) == list(range(7))
    assert rows[:, 0].tolist() == [0, 1, 2]  # each vector is its own nearest neighbour


def test_search_accepts_unnormalised_float64_queries(data):
    index = build_index(data, "Flat", device="cpu")
    q = data[:4].astype(np.float64)
    _, rows_a = search(index, q, 3)
    _, rows_b = search(index, q * 123.0, 3)
    np.testing.assert_array_equal(rows_a, rows_b)


def test_l2_normalized_does_not_modify_its_input(data):
    original = data[:10].copy()
    view = data[:10]
    out = l2_normalized(view)
    np.testing.assert_array_equal(view, original)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(out, original / np.linalg.norm(original, axis=1, keepdims=True), atol=1e-6)
    assert out.dtype == np.float32
    # Also for an array that is already float32 and contiguous (no implicit copy on conversion).
    already = np.ascontiguousarray(original, dtype=np.float32)
    l2_normalized(already)
    np.testing.assert_array_equal(already, original)


def test_build_index_does_not_modify_its_input(data):
    copy = data[:200].copy()
    build_index(copy, "Flat", device="cpu")
    np.testing.assert_array_equal(copy, data[:200])


def test_as_float32_rows():
    out = as_float32_rows([[1, 2], [3, 4]], dim=2)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    with pytest.raises(ValueError, match="dimension 3"):
        as_float32_rows(np.ones((2, 2)), dim=3)


def test_exact_search_equals_numpy_brute_force(data, queries):
    scores, rows = exact_search(data, queries, 7)
    expected_scores, expected_rows = brute_force(data, queries, 7)
    np.testing.assert_array_equal(rows, expected_rows)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-5)
    # The database argument is not normalised in place either.
    db = data[:300].copy()
    exact_search(db, queries, 3)
    np.testing.assert_array_equal(db, data[:300])


# --- device selection ---------------------------------------------------------------------------


def test_select_device():
    assert select_device("auto", num_gpus=0) == "cpu"
    assert select_device("auto", num_gpus=1) == "gpu"
    assert select_device("cpu", num_gpus=4) == "cpu"
    assert select_device("gpu", num_gpus=2) == "gpu"
    with pytest.raises(RuntimeError, match="no GPU"):
        select_device("gpu", num_gpus=0)
    with pytest.raises(ValueError, match="auto, cpu or gpu"):
        select_device("cuda", num_gpus=1)
    assert select_device("auto") in ("cpu", "gpu")  # whatever this machine has, never a crash


def test_hnsw_build_effort_is_applied_before_the_rows_go_in():
    """efConstruction among the build's parameters shapes the graph (issue 62: it was set after
    `add`, where it changes nothing): a better graph finds more of the true neighbours."""
    rng = np.random.default_rng(0)
    data = rng.standard_normal((3000, 16)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    queries = data[:200] + 0.3 * rng.standard_normal((200, 16)).astype(np.float32)
    truth = exact_search(data, queries, 10)[1]

    def recall(params: dict) -> float:
        index = build_index(data, "HNSW8", params)
        assert faiss.downcast_index(index).hnsw.efConstruction == params["efConstruction"]
        rows = index.search(queries / np.linalg.norm(queries, axis=1, keepdims=True), 10)[1]
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows.tolist(), truth.tolist(), strict=True)])

    assert recall({"efConstruction": 200, "efSearch": 16}) > recall({"efConstruction": 8, "efSearch": 16})
