"""The one merge of a version's parts: segments in one process, shards across processes.

A part answers its own best rows for a query, as global rows and their scores. The version's
answer is the best k of every part's, in the one order of hits (`core.retrieval.ranking`: score
descending, then row ascending), so rows that tie answer in the same order whichever parts
hold them and however many there are. `best_rows` takes that top k for a batch of queries at once.

Two levels use it. A version's segments (and a sharded version's shards read into one process:
the build's gate, `index duplicates`) are one `MergedIndex`, searched part by part and merged
here as faiss's index is merged inside one search; a `serve --ray` ingress merges its shard
replicas' answers (`serving.shards.fanout`) in the same order, a shard's own segments
having been merged by this module first.
"""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np

from core.retrieval.ranking import NO_ROW, best_k


def best_rows(rows: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query's best k of its candidates (row i of `rows` and `scores`, nq × m), as faiss
    answers: (scores, rows), nq × k, best first; places past the candidates hold NO_ROW and -inf."""
    rows, scores = np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32)
    top = best_k(scores, k, rows)  # by row where scores tie: the same order whichever part holds a row
    top_rows = np.take_along_axis(rows, top, axis=1)
    top_scores = np.where(top_rows == NO_ROW, -np.inf, np.take_along_axis(scores, top, axis=1)).astype(np.float32)
    if top.shape[1] < k:  # fewer candidates than places
        pad = ((0, 0), (0, k - top.shape[1]))
        top_rows = np.pad(top_rows, pad, constant_values=NO_ROW)
        top_scores = np.pad(top_scores, pad, constant_values=-np.inf)
    return top_scores, top_rows


def _global_rows(part: faiss.Index, offset: int) -> faiss.IndexIDMap:
    """`part` answering global rows (its row r as `offset + r`). An IndexIDMap rather than
    adding the offset afterwards: a search's id selector (a filter's rows, a bitmap over the
    version's global rows) reaches the part through the map, which translates it."""
    # IndexIDMap refuses a non-empty index: made over an empty one, then pointed at the part.
    mapped = faiss.IndexIDMap(faiss.IndexFlatIP(part.d))
    mapped.own_fields = False
    mapped.index, mapped.ntotal, mapped.is_trained = part, part.ntotal, part.is_trained
    faiss.copy_array_to_vector(np.arange(offset, offset + part.ntotal, dtype=np.int64), mapped.id_map)
    mapped.referenced_objects = [part]  # the part lives as long as its map
    return mapped


class MergedIndex:
    """A version's parts (its segments, or its shards) searched as one faiss index answering
    global rows: each part searched with the caller's parameters, the answers merged by
    `best_rows`. Parts are searched one after another: an IndexIDMap swaps its translating
    selector into the caller's parameters for the length of its search, so parts sharing those
    parameters at once would read each other's (faiss parallelises each part over the queries)."""

    def __init__(self, parts: Sequence[faiss.Index | MergedIndex], offsets: Sequence[int] | np.ndarray) -> None:
        if not parts:
            raise ValueError("a merged index needs at least one part")
        if len(parts) != len(offsets):
            raise ValueError(f"{len(parts)} parts but {len(offsets)} offsets")
        # A part that is itself merged (a sharded version's segmented shard) joins with its own
        # parts: a segment is one more level of the same merge, searched as one.
        flat: list[tuple[faiss.Index, int]] = []
        for part, offset in zip(parts, offsets, strict=True):
            if isinstance(part, MergedIndex):
                flat += [(inner, int(offset) + inner_offset) for inner, inner_offset in part.given]
            else:
                flat.append((part, int(offset)))
        dims = {part.d for part, _ in flat}
        if len(dims) != 1:
            raise ValueError(f"parts of different dimensions: {sorted(dims)}")
        self.given = flat
        # The parts' downcast views do not own them: the maps hold the objects given, which do.
        self.parts = [_global_rows(part, offset) for part, offset in flat]
        self.inner = [faiss.downcast_index(part) for part, _ in flat]
        self.d = self.parts[0].d
        self.ntotal = sum(part.ntotal for part in self.parts)
        self.is_trained = all(part.is_trained for part in self.parts)

    def search(
        self, queries: np.ndarray, k: int, params: faiss.SearchParameters | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        found = [part.search(queries, k, params=params) for part in self.parts]
        return best_rows(np.hstack([r for _, r in found]), np.hstack([s for s, _ in found]), k)

    def range_search(self, queries: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """faiss's range search on every part, each query's rows from all of them (unordered, as
        faiss gives them): (lims, scores, rows)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        found = [part.range_search(queries, radius) for part in self.parts]
        every = np.arange(len(queries))
        query_of = np.concatenate([np.repeat(every, np.diff(lims).astype(np.int64)) for lims, _, _ in found])
        order = np.argsort(query_of, kind="stable")  # query by query, each part's rows in turn
        lims = np.concatenate([[0], np.cumsum(np.bincount(query_of, minlength=len(queries)))]).astype(np.int64)
        scores = np.concatenate([part_scores for _, part_scores, _ in found]).astype(np.float32)
        rows = np.concatenate([part_rows for _, _, part_rows in found]).astype(np.int64)
        return lims, scores[order], rows[order]
