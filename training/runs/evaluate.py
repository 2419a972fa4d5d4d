"""Evaluation of an embedding model: embed with torch, score with the shared index metrics.

Recall@K and MAP@R come from `core.retrieval.metrics` (the same numbers the index gate and the
server report); NMI and the pair-similarity histograms are training-only diagnostics.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.data.catalog import ITEM_COLUMN
from core.retrieval.metrics import map_at_r, query_gallery_recall_at_k, recall_at_k
from index.search.faiss_index import build_index
from index.search.grouping import Groups, item_recall_at_k


def retrieval_metrics(embeddings: np.ndarray, labels: Sequence[int], ks: Sequence[int], with_nmi: bool = False) -> dict:
    """Recall@K (leave-one-out, exact inner product), MAP@R and optionally NMI, JSON-ready."""
    recall = recall_at_k(embeddings, labels, ks)
    out = {
        "recall_at_k": {str(k): v for k, v in recall.items()},
        "map_at_r": map_at_r(embeddings, labels),
    }
    if with_nmi:
        out["nmi"] = nmi(embeddings, labels)
    return out


def item_recall(embeddings: np.ndarray, items: Sequence[str], ks: Sequence[int]) -> dict[str, float] | None:
    """Item-level Recall@K of a split whose rows name their item (a catalog's `item` column):
    each image queries the others, its own row left out, and hits when its item is among the K
    best items — the index's grouped search over an exact (Flat) index. None when no item has
    two images."""
    groups = Groups.of_values(ITEM_COLUMN, items)
    found = item_recall_at_k(build_index(embeddings, "Flat"), embeddings, groups, np.arange(len(items)), ks)
    return None if found is None else {str(k): v for k, v in found.items()}


def query_gallery_metrics(
    queries: np.ndarray,
    query_labels: Sequence[int],
    gallery: np.ndarray,
    gallery_labels: Sequence[int],
    ks: Sequence[int],
) -> dict:
    """In-shop's protocol: Recall@K of queries against a separate gallery."""
    recall = query_gallery_recall_at_k(queries, query_labels, gallery, gallery_labels, ks)
    return {"recall_at_k": {str(k): v for k, v in recall.items()}}


# Multiply-adds k-means may spend on its restarts (~a minute on 2 cores). One run's cost is
# iterations × items × classes × dimensions, and with the classes growing with the catalog it
# grows with its square: SOP's test half (63,800 images of 5,800 classes, 1,280-d) took 2.4·10¹⁴
# for 5 restarts of 50 iterations, hours on 2 cores. Past the budget, one run of fewer iterations.
KMEANS_RESTART_BUDGET = 2e12


def kmeans_schedule(items: int, classes: int, dim: int) -> tuple[int, int]:
    """(iterations, restarts) for NMI's k-means: 50 × 5 where that fits the budget, else one run
    of 20 iterations."""
    if 50 * 5 * items * classes * dim <= KMEANS_RESTART_BUDGET:
        return 50, 5
    return 20, 1


def nmi(embeddings: np.ndarray, labels: Sequence[int], seed: int = 0) -> float:
    """NMI of k-means clusters (k = number of classes) against the labels, the usual DML protocol."""
    import faiss
    from sklearn.metrics import normalized_mutual_info_score

    labels = np.asarray(labels)
    n_classes = len(np.unique(labels))
    if n_classes < 2 or len(labels) <= n_classes:
        raise ValueError(f"NMI needs more items ({len(labels)}) than classes ({n_classes}) and 2+ classes")
    data = np.ascontiguousarray(embeddings, dtype=np.float32)
    # Several restarts where affordable: one k-means run can settle in a poor optimum and
    # understate NMI.
    niter, nredo = kmeans_schedule(len(data), n_classes, data.shape[1])
    kmeans = faiss.Kmeans(
        data.shape[1], n_classes, niter=niter, nredo=nredo, seed=seed, min_points_per_centroid=1, verbose=False
    )
    kmeans.train(data)
    _, assignment = kmeans.index.search(data, 1)
    return float(normalized_mutual_info_score(labels, assignment[:, 0]))


def pair_similarities(
    embeddings: np.ndarray, labels: Sequence[int], max_pairs: int = 200_000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Cosine similarities of positive and of negative pairs (sampled when there are many).

    Their histograms' overlap is what the histogram-loss paper measures: the smaller, the
    better the embedding separates classes.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if n * (n - 1) // 2 <= max_pairs:
        rows, cols = np.triu_indices(n, k=1)
    else:
        # Drawn directly, never enumerated: SOP's 60k test images have 1.8e9 pairs (29 GB of
        # indices). Pairs are uniform over unordered pairs of distinct items, as the subsample
        # of the enumeration was.
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, n, max_pairs)
        cols = rng.integers(0, n - 1, max_pairs)
        cols += cols >= rows
    sims = np.einsum("ij,ij->i", embeddings[rows], embeddings[cols])
    same = labels[rows] == labels[cols]
    return sims[same], sims[~same]


def similarity_bins(positive: np.ndarray, negative: np.ndarray, bins: int = 100) -> np.ndarray:
    """Bin edges spanning both similarity sets (an untrained net crowds them near 1)."""
    if len(positive) == 0 or len(negative) == 0:
        raise ValueError("need positive and negative pairs for similarity histograms")
    lo = float(min(positive.min(), negative.min()))
    hi = float(max(positive.max(), negative.max()))
    return np.linspace(lo, max(hi, lo + 1e-6), bins + 1)


def histogram_overlap(positive: np.ndarray, negative: np.ndarray, bins: int = 100) -> float:
    """Shared area of the two normalised similarity histograms (0 = separated, 1 = identical)."""
    edges = similarity_bins(positive, negative, bins)
    p, _ = np.histogram(positive, edges)
    n, _ = np.histogram(negative, edges)
    return float(np.minimum(p / p.sum(), n / n.sum()).sum())
