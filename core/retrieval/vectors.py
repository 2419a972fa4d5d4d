"""Embedding rows as faiss takes them: float32, C-contiguous, finite, L2-normalised; and exact
inner-product search, the reference every ANN index and every Recall@K is measured against."""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np

from core.retrieval.ranking import best_k


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


def unit_rows(vectors: np.ndarray, dim: int | None = None) -> np.ndarray:
    """The rows at unit length: the array itself when they already are (a model's embeddings,
    a version's stored vectors — `RowBlocks` included, checked block by block and never
    joined), a normalised copy otherwise."""
    if isinstance(vectors, RowBlocks) and (dim is None or vectors.shape[1] == dim):
        if all(_unit(block) for block in vectors.blocks):
            return vectors  # type: ignore[return-value]
    array = as_float32_rows(vectors, dim)
    if _unit(array):
        return array
    return l2_normalized(array)


def _unit(array: np.ndarray) -> bool:
    """Every row of `array` is at unit length (an empty array — a shard every row has left — is)."""
    if not len(array):
        return True
    norms = np.einsum("ij,ij->i", array, array)
    return bool(np.isfinite(norms).all()) and float(np.abs(norms - 1).max()) <= 1e-5


def exact_search(
    database: np.ndarray, queries: np.ndarray, k: int, live: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product search, the reference every ANN index is measured against:
    (scores, rows) of the top k, rows -1 (score -inf) past the rows there are. `live`: a bool
    per row, False for rows that never answer (a version's deleted rows).

    Searched in place (faiss.knn) rather than through an index that copies the database: the
    ANN-recall check of a build otherwise held the catalog's vectors twice more (a normalised copy
    and the index's), 1.3 GB at SOP size with 1,280-d vectors. `RowBlocks` (a sharded or
    segmented version's vectors) are searched block by block where each lies, the best k kept:
    a sharded build's gate joined every shard's vectors in one process."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    data = unit_rows(database)
    q = unit_rows(queries, data.shape[1])
    if len(data) == 0:  # as an empty index answers: no rows
        return faiss.IndexFlatIP(data.shape[1]).search(q, 1)
    blocks = data.blocks if isinstance(data, RowBlocks) else [data]
    starts = data.starts if isinstance(data, RowBlocks) else np.zeros(1, np.int64)
    dead = int(len(live) - np.count_nonzero(live)) if live is not None else 0
    k = min(k, len(data))
    best_scores = np.full((len(q), k), -np.inf, np.float32)
    best_rows = np.full((len(q), k), -1, np.int64)
    for block, start in zip(blocks, starts, strict=False):
        if not len(block):
            continue
        scores, rows = faiss.knn(q, block, min(k + dead, len(block)), metric=faiss.METRIC_INNER_PRODUCT)
        rows = np.where(rows >= 0, rows + start, -1)
        if live is not None:
            scores = np.where((rows >= 0) & ~live[np.maximum(rows, 0)], -np.inf, scores)
        if len(blocks) == 1 and live is None and scores.shape[1] == k:
            return scores, rows
        scores = np.concatenate([best_scores, scores], axis=1)
        rows = np.concatenate([best_rows, rows], axis=1)
        # Ties by place, not row: a block's tied rows stay in faiss.knn's own order (not row order)
        # after earlier blocks' — as one block answers alone, returned as faiss gives it above.
        top = best_k(scores, k)
        best_scores, best_rows = np.take_along_axis(scores, top, axis=1), np.take_along_axis(rows, top, axis=1)
    return best_scores, np.where(np.isfinite(best_scores), best_rows, -1)


class RowBlocks:
    """float32 rows held in several arrays — a segmented version's vectors, one memory map a
    segment — read as one array of all their rows in order, without concatenating them: a
    version that keeps a million rows of its parent maps the parent's files, so a server that
    loads it holds no second copy. Indexing (an int, a slice, an array of rows, a mask) gathers
    a NumPy array; `@ query` scores every row; `np.asarray` concatenates (a full copy: what the
    hot paths avoid through `take` and `inner_products`)."""

    def __init__(self, blocks: Sequence[np.ndarray]) -> None:
        if not blocks:
            raise ValueError("RowBlocks needs at least one block")
        dims = {block.shape[1] for block in blocks if block.ndim == 2}
        if len(dims) != 1 or any(block.ndim != 2 or block.dtype != np.float32 for block in blocks):
            shapes = ", ".join(f"{block.dtype}{block.shape}" for block in blocks)
            raise ValueError(f"blocks must be float32 rows of one dimension, got {shapes}")
        # Plain arrays over the maps: np.memmap's indexing runs Python for every gather.
        self.blocks = [np.asarray(block) for block in blocks]
        self.starts = np.concatenate([[0], np.cumsum([len(block) for block in self.blocks])]).astype(np.int64)
        self.dtype = np.dtype(np.float32)
        self.ndim = 2

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.starts[-1]), int(self.blocks[0].shape[1])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's block and its row within the block (IndexError past the end)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"row out of range for {len(self)} rows")
        rows = np.where(rows < 0, rows + len(self), rows)
        block = np.searchsorted(self.starts, rows, side="right") - 1
        return block, rows - self.starts[block]

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The rows `rows` (any shape), gathered: shaped rows.shape + (d,)."""
        rows = np.asarray(rows, dtype=np.int64)
        flat = rows.ravel()
        out = np.empty((len(flat), self.shape[1]), dtype=np.float32)
        for block, places, local in self.split(flat):
            out[places] = self.blocks[block][local]
        return out.reshape(*rows.shape, self.shape[1])

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            block, local = self.locate(np.asarray([key]))
            return self.blocks[int(block[0])][int(local[0])]
        if isinstance(key, slice):
            return self.take(np.arange(len(self))[key])
        key = np.asarray(key)
        if key.dtype == bool:
            return self.take(np.flatnonzero(key))
        return self.take(key)

    def __matmul__(self, query: np.ndarray) -> np.ndarray:
        return np.concatenate([block @ query for block in self.blocks])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = np.concatenate(self.blocks) if len(self.blocks) > 1 else np.array(self.blocks[0])
        return joined if dtype is None else joined.astype(dtype)

    def split(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """`rows` (1-D) by block: (block, the places in `rows` it holds, their rows within it)."""
        block, local = self.locate(rows)
        return [(int(b), (at := np.flatnonzero(block == b)), local[at]) for b in np.unique(block)]
