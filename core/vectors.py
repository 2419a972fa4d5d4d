"""Embedding rows as faiss takes them: float32, C-contiguous, finite, L2-normalised; and exact
inner-product search, the reference every ANN index and every Recall@K is measured against."""

from __future__ import annotations

from collections.abc import Sequence

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


def unit_rows(vectors: np.ndarray, dim: int | None = None) -> np.ndarray:
    """The rows at unit length: the array itself when they already are (a model's embeddings),
    a normalised copy otherwise."""
    array = as_float32_rows(vectors, dim)
    norms = np.einsum("ij,ij->i", array, array)
    if len(array) and np.abs(norms - 1).max() <= 1e-5:
        return array
    return l2_normalized(array)


def exact_search(database: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product search, the reference every ANN index is measured against.

    Searched in place (faiss.knn) rather than through an index that copies the database: the
    ANN-recall check of a build otherwise held the catalog's vectors twice more (a normalised copy
    and the index's), 1.3 GB at SOP size with 1,280-d vectors."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    data = unit_rows(database)
    q = unit_rows(queries, data.shape[1])
    if len(data) == 0:  # as an empty index answers: no rows
        return faiss.IndexFlatIP(data.shape[1]).search(q, 1)
    return faiss.knn(q, data, min(k, len(data)), metric=faiss.METRIC_INNER_PRODUCT)


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
