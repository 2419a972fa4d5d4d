"""Embedding rows as faiss takes them: float32, C-contiguous, finite, L2-normalised; and exact
inner-product search, the reference every ANN index and every Recall@K is measured against."""

from __future__ import annotations

import faiss
import numpy as np


def as_float32_rows(vectors: np.ndarray, dim: int | None = None) -> np.ndarray:
    array = np.ascontiguousarray(vectors, dtype=np.float32)
    if array.ndim != 2:
        raise ValueError(f"expected a 2-D array of vectors, got shape {array.shape}")
    if dim is not None and array.shape[1] != dim:
        raise ValueError(f"expected vectors of dimension {dim}, got {array.shape[1]}")
    if not np.isfinite(array).all():
        raise ValueError("vectors contain NaN or infinity")
    return array


def l2_normalized(vectors: np.ndarray) -> np.ndarray:
    """A normalised copy (faiss.normalize_L2 works in place and would change the caller's array)."""
    out = as_float32_rows(vectors).copy()
    faiss.normalize_L2(out)
    return out


def exact_search(database: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product search, the reference every ANN index is measured against."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    data = l2_normalized(database)
    flat = faiss.IndexFlatIP(data.shape[1])
    flat.add(data)
    q = l2_normalized(as_float32_rows(queries, flat.d))
    return flat.search(q, min(k, max(flat.ntotal, 1)))
