"""Retrieval quality: Recall@K and MAP@R, with exact faiss search as reference.

Training evaluation, index quality gates and the server's online monitor all use these, so a
Recall@K means the same thing at every stage.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from core.retrieval.vectors import exact_search


def recall_from_neighbor_labels(
    neighbor_labels: np.ndarray, query_labels: np.ndarray, ks: Sequence[int]
) -> dict[int, float]:
    """Recall@K: the fraction of queries with a same-label item among their K nearest.

    `neighbor_labels` is (queries, >= max K), nearest first, already without the query itself.
    """
    neighbor_labels = np.asarray(neighbor_labels)
    query_labels = np.asarray(query_labels)
    if len(query_labels) == 0:
        raise ValueError("no queries to measure recall on")
    if neighbor_labels.shape[1] < max(ks):
        raise ValueError(f"need {max(ks)} neighbours per query, got {neighbor_labels.shape[1]}")
    hits = neighbor_labels == query_labels[:, None]
    first_hit = np.where(hits.any(axis=1), hits.argmax(axis=1), np.iinfo(np.int64).max)
    return {int(k): float(np.mean(first_hit < k)) for k in ks}


def _neighbors_without_self(embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest other items of every item (self removed even among exact ties)."""
    n = len(embeddings)
    scores, rows = exact_search(embeddings, embeddings, min(k + 1, n))
    keep = rows != np.arange(n)[:, None]
    # Each row drops its own index once; rows where self was not returned drop the last column.
    drop_last = keep.all(axis=1)
    keep[drop_last, -1] = False
    width = keep.shape[1] - 1
    return scores[keep].reshape(n, width), rows[keep].reshape(n, width)


def _pad_to(neighbor_labels: np.ndarray, width: int) -> np.ndarray:
    """Neighbour labels widened to `width` columns with a label no query has (sets smaller than K)."""
    if neighbor_labels.shape[1] >= width:
        return neighbor_labels
    pad = np.full((len(neighbor_labels), width - neighbor_labels.shape[1]), object(), dtype=object)
    return np.concatenate([neighbor_labels.astype(object), pad], axis=1)


def recall_at_k(embeddings: np.ndarray, labels: Sequence, ks: Sequence[int] = (1, 2, 4, 8)) -> dict[int, float]:
    """Leave-one-out Recall@K: every item queries all the others by exact inner product."""
    labels = np.asarray(labels)
    if len(labels) < 2:
        raise ValueError("Recall@K needs at least two items")
    k = min(max(ks), len(labels) - 1)
    _, rows = _neighbors_without_self(embeddings, k)
    neighbor_labels = labels[rows]
    return recall_from_neighbor_labels(_pad_to(neighbor_labels, max(ks)), labels, ks)


def query_gallery_recall_at_k(
    queries: np.ndarray,
    query_labels: Sequence,
    gallery: np.ndarray,
    gallery_labels: Sequence,
    ks: Sequence[int] = (1, 10, 20, 30, 40, 50),
) -> dict[int, float]:
    """Recall@K of queries against a separate gallery (In-shop's protocol): no self to remove."""
    gallery_labels = np.asarray(gallery_labels)
    if len(gallery_labels) == 0:
        raise ValueError("Recall@K needs a non-empty gallery")
    k = min(max(ks), len(gallery_labels))
    _, rows = exact_search(gallery, queries, k)
    neighbor_labels = _pad_to(gallery_labels[rows], max(ks))
    return recall_from_neighbor_labels(neighbor_labels, np.asarray(query_labels, dtype=object), ks)


def map_at_r(embeddings: np.ndarray, labels: Sequence) -> float:
    """MAP@R (Musgrave et al.): R = number of other items of the query's class."""
    labels = np.asarray(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    r_per_query = counts[inverse] - 1
    max_r = int(r_per_query.max())
    if max_r == 0:
        raise ValueError("MAP@R needs at least one class with two items")
    _, rows = _neighbors_without_self(embeddings, min(max_r, len(labels) - 1))
    hits = labels[rows] == labels[:, None]
    ranks = np.arange(1, hits.shape[1] + 1)
    precision_at_i = np.cumsum(hits, axis=1) / ranks
    within_r = ranks[None, :] <= r_per_query[:, None]
    ap = (precision_at_i * hits * within_r).sum(axis=1) / np.maximum(r_per_query, 1)
    return float(ap[r_per_query > 0].mean())


def stable_key(item_id: str, seed: int = 0) -> tuple[bytes, str]:
    """An id's place in `stable_order`: a hash of `seed` and the id (BLAKE2b; Python's hash() is
    salted per process), then the id. Parts of a catalog ranked apart merge by it."""
    return hashlib.blake2b(f"{seed}:{item_id}".encode(), digest_size=8).digest(), str(item_id)


def stable_order(ids: Sequence[str], seed: int = 0) -> np.ndarray:
    """Every row, ranked by its id's `stable_key`, ties in row order: the same ids rank alike
    whatever the rows' order, in every build."""
    keys = [stable_key(i, seed) for i in ids]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def stable_sample(ids: Sequence[str], size: int, seed: int = 0) -> np.ndarray:
    """`size` of the rows (all when fewer), sorted, chosen by their ids (`stable_order`): two
    builds of one catalog in different row orders sample the same items, so their figures compare."""
    return np.sort(stable_order(ids, seed)[:size])


WILSON_Z = 1.959964  # the normal quantile of a two-sided 95% interval


def wilson_interval(fraction: float, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a proportion measured on `n` trials, such as
    a Recall@K over `n` queries: unlike the normal approximation it stays within [0, 1] and is
    not empty at 0 or 1. (0, 1) when nothing was measured."""
    if n <= 0:
        return 0.0, 1.0
    z2 = z * z
    centre = (fraction + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(fraction * (1 - fraction) / n + z2 / (4 * n * n))
    # At 0 or 1 the bound is exactly 0 or 1 (the formula lands an ulp inside it).
    return (0.0 if fraction <= 0 else centre - half), (1.0 if fraction >= 1 else centre + half)
