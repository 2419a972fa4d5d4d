"""The gate's figures say what the index does, not its tie order or the catalog's row order: rows
tied with the exact k-th neighbour count alike (an exact index measures ANN recall 1.0, one that
misses still less), the probe sample is chosen by ids, and probe Recall@K carries its interval."""

from __future__ import annotations

import numpy as np
import pytest

from core.artifacts.index_manifest import QualityReport
from core.retrieval.metrics import stable_sample, wilson_interval
from core.retrieval.vectors import exact_search, l2_normalized
from index.build.gate import GateThresholds, describe_quality, quality_figures
from index.search.ann_recall import TIE_TOLERANCE, ann_recall, recall_with_ties
from index.search.faiss_index import apply_search_params, build_index
from index.search.faiss_search import search
from tests.support import shards as support

N, DIM, COPIES, K = 2000, 32, 300, 10


def with_copies(seed: int = 0) -> np.ndarray:
    """N unit vectors, of which rows N/2 .. N/2 + COPIES copy rows 0 .. COPIES (another shard's)."""
    vectors = l2_normalized(np.random.default_rng(seed).standard_normal((N, DIM)).astype(np.float32))
    vectors[N // 2 : N // 2 + COPIES] = vectors[:COPIES]
    return vectors


def identity_overlap(index, vectors: np.ndarray, queries: np.ndarray, k: int) -> float:
    """ANN recall counting rows by identity alone: what the gate measured before ties counted."""
    _, exact = exact_search(vectors, queries, k)
    _, found = search(index, queries, k)
    return float(np.mean([len(set(f) & set(e)) / k for f, e in zip(found.tolist(), exact.tolist(), strict=True)]))


def thresholds(sample: int = 500) -> GateThresholds:
    return GateThresholds(
        ks=(1, 4), quality_sample=sample, ann_k=K, min_ann_recall=0, min_probe_recall_at_1=0, max_recall_drop=None
    )


def ids_of(n: int) -> list[str]:
    return [f"item-{i:05d}" for i in range(n)]


def test_an_exact_index_measures_ann_recall_one_whatever_order_it_lists_ties_in():
    vectors = with_copies()
    merged = support.two_flat_shards(vectors, highest_row_first=True)  # exact search at k = 1: lowest first
    queries = vectors[:COPIES]  # each query's own row and its copy tie for first place
    assert identity_overlap(merged, vectors, queries, 1) < 0.1  # tie order alone, counted as misses
    assert ann_recall(merged, vectors, queries, 1) == 1.0
    assert ann_recall(merged, vectors, queries, K) == 1.0
    report = quality_figures(merged, vectors, ids_of(N), None, thresholds())
    assert report.ann_recall_at_k == 1.0
    hnsw = build_index(vectors, "HNSW32", device="cpu")
    apply_search_params(hnsw, {"efSearch": 512})
    assert ann_recall(hnsw, vectors, queries, K) == 1.0


def test_an_index_that_misses_still_measures_below_one():
    vectors = with_copies()
    ivf = build_index(vectors, "IVF32,Flat", search_params={"nprobe": 1}, device="cpu")
    queries = l2_normalized(vectors[:COPIES] + 0.3 * np.random.default_rng(1).standard_normal((COPIES, DIM)))
    assert 0 < ann_recall(ivf, vectors, queries, K) < 0.9
    assert 0 < quality_figures(ivf, vectors, ids_of(N), None, thresholds()).ann_recall_at_k < 0.9


def test_ties_are_judged_by_exact_score_within_the_tolerance():
    exact, exact_scores = [0, 1, 2], [0.9, 0.8, 0.7]
    # Row 5 scores as the 3rd best (a copy of row 2, a float rounding apart): a hit; row 6 below it.
    assert recall_with_ties([0, 1, 5], [0.9, 0.8, 0.7 - TIE_TOLERANCE / 2], exact, exact_scores, 3) == 1.0
    assert recall_with_ties([0, 1, 6], [0.9, 0.8, 0.7 - 1e-4], exact, exact_scores, 3) == pytest.approx(2 / 3)
    # An answer's score counts only where it is exact: a row not scored (-inf) is a miss.
    assert recall_with_ties([0, 6, 1], [0.9, -np.inf, 0.8], exact, exact_scores, 3) == pytest.approx(2 / 3)
    # Fewer than k rows exist (a filter's): only they count, whatever the others score.
    assert recall_with_ties([0, 1, 7], [0.9, 0.8, 0.95], [0, 1], [0.9, 0.8], 3) == pytest.approx(2 / 3)


def test_the_sample_is_chosen_by_ids_so_a_reordered_catalog_measures_the_same():
    rng = np.random.default_rng(2)
    centres = rng.standard_normal((40, DIM))
    label_of = rng.integers(0, 40, N)
    vectors = l2_normalized((centres[label_of] + 0.9 * rng.standard_normal((N, DIM))).astype(np.float32))
    ids, labels = ids_of(N), [f"class{c}" for c in label_of]
    order = rng.permutation(N)
    # The same items are sampled, whatever their rows.
    sample, shuffled = stable_sample(ids, 300), stable_sample([ids[r] for r in order], 300)
    assert sorted(ids[r] for r in sample) == sorted(ids[order[r]] for r in shuffled)
    assert len(set(sample.tolist())) == 300 and list(sample) == sorted(sample)
    assert not np.array_equal(stable_sample(ids, 300, seed=1), sample)  # the tuning's sample is another
    figures = []
    for rows in (np.arange(N), order):
        index = build_index(vectors[rows], "Flat", device="cpu")
        figures.append(
            quality_figures(index, vectors[rows], [ids[r] for r in rows], [labels[r] for r in rows], thresholds(300))
        )
    first, second = figures
    assert first.probe_recall_at_k == second.probe_recall_at_k and first.probe_queries == second.probe_queries == 300
    assert first.probe_interval_at_k == second.probe_interval_at_k
    low, high = first.probe_interval_at_k["1"]
    assert low < first.probe_recall_at_k["1"] < high
    assert (low, high) == pytest.approx(wilson_interval(first.probe_recall_at_k["1"], 300))


def test_the_build_line_and_the_manifest_carry_the_probe_interval():
    report = QualityReport(
        sample_size=1000, ann_k=10, ann_recall_at_k=0.9995, probe_source="leave-one-out sample of the catalog",
        probe_recall_at_k={"1": 0.323}, probe_queries=1000, probe_interval_at_k={"1": [0.2947, 0.3526]},
    )  # fmt: skip
    line = describe_quality(report)
    assert "R@1 0.3230 [0.2947, 0.3526] (1000 queries, 95% intervals; leave-one-out" in line
    assert QualityReport.from_dict(report.to_dict()) == report
    # A manifest written before intervals were measured reads as before, and its line has none.
    older = {k: v for k, v in report.to_dict().items() if k not in ("probe_queries", "probe_interval_at_k")}
    read = QualityReport.from_dict(older)
    assert read.probe_interval_at_k is None and read.probe_queries is None and not read.extra
    assert "R@1 0.3230 (leave-one-out" in describe_quality(read)
