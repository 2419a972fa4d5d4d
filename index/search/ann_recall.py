"""ANN recall against exact search, rows tied with the exact k-th best counted as equal, and the
search effort (nprobe, efSearch) a build tunes to reach a recall target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from core.retrieval.vectors import RowBlocks, exact_search, unit_rows
from index.search.faiss_index import apply_search_params, inner_index, ivf_of
from index.search.faiss_search import MAX_EF_SEARCH, ExactRerank, search

# -- ANN recall ---------------------------------------------------------------------------------
#
# Rows scoring the same as the exact k-th best are interchangeable: which of them an exact search
# lists is its tie order (row order, a shard merge's order), not quality. A catalog with 211 rows
# sharing their vector with another row measured a Flat index (4 shards merged) at 0.9995 and the
# server's live fidelity R@1 at 0.982 while counting tied rows by identity. So an answer's entry
# is a hit when it is among the exact top k or its exact score reaches the k-th best's.
#
# Scores are inner products of unit vectors, so their rounding is relative to |q|·|x| = 1, not to
# the score: float32's spacing near 1 is 6e-8 to 1.2e-7, and the same product computed by two
# kernels (faiss.knn's blocked BLAS, a gather by row ids, NumPy) differs by up to 2e-7 over 64 to
# 1,280 dimensions. 1e-6 of that scale holds the disagreement with a margin of five; distinct
# rows closer than that to the k-th best are below what float32 scores can rank anyway.
TIE_TOLERANCE = 1e-6


def recall_with_ties(
    found: Sequence[int], found_scores: Sequence[float], exact: Sequence[int], exact_scores: Sequence[float], k: int
) -> float:
    """The share of the exact top k that one answer's first k entries (rows, or a grouped answer's
    groups) hold, ties counted as equal: an entry is a hit when it is in `exact[:k]` or its exact
    score (`found_scores`: scored against the stored vectors, never the index's own approximate
    score; -inf when unknown) reaches the lowest of the exact top k's, less TIE_TOLERANCE. With
    fewer than k exact entries (a filter's few rows) only they count. `exact` is best first."""
    top = exact[:k]
    bound = math.inf
    if len(top) >= k:
        lowest = float(min(exact_scores[:k]))
        bound = lowest - TIE_TOLERANCE * max(1.0, abs(lowest))
    members = set(top)
    return sum(1 for f, s in zip(found[:k], found_scores[:k], strict=True) if f in members or s >= bound) / k


def scores_of_rows(stored: np.ndarray, queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Each query's exact inner product with the `stored` vectors of its line of `rows` (nq × c),
    -inf where a row is -1 (no answer)."""
    rows = np.asarray(rows, dtype=np.int64)
    found = rows >= 0
    picked = np.ascontiguousarray(np.where(found, rows, 0))
    if isinstance(stored, RowBlocks):  # the rows gathered from their segments, not the maps joined
        gathered = stored.take(picked)
        return np.where(found, np.einsum("qd,qcd->qc", queries, gathered).astype(np.float32), -np.inf)
    data = np.ascontiguousarray(stored, dtype=np.float32)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    scores = np.empty(picked.shape, dtype=np.float32)
    faiss.fvec_inner_products_by_idx(
        faiss.swig_ptr(scores), faiss.swig_ptr(queries), faiss.swig_ptr(data), faiss.swig_ptr(picked),
        data.shape[1], len(queries), picked.shape[1],
    )  # fmt: skip
    return np.where(found, scores, -np.inf)


def ann_recall(index, database: np.ndarray, queries: np.ndarray, k: int) -> float:
    """ANN recall@k: the share of the exact top-k neighbours the index returns, averaged over
    queries, rows tied with the k-th counted as equal (`recall_with_ties`)."""
    data = unit_rows(database)
    q = unit_rows(queries, data.shape[1])
    _, exact_rows = exact_search(data, q, k)
    return recall_against(search(index, q, k)[1], exact_rows, data, q)


def recall_against(found_rows: np.ndarray, exact_rows: np.ndarray, data: np.ndarray, queries: np.ndarray) -> float:
    """Mean `recall_with_ties` of the index's rows against the exact ones, both scored exactly
    by the same kernel (so a vector and its copy score alike)."""
    found_scores, exact_scores = scores_of_rows(data, queries, found_rows), scores_of_rows(data, queries, exact_rows)
    k = exact_rows.shape[1]
    lines = zip(found_rows.tolist(), found_scores.tolist(), exact_rows.tolist(), exact_scores.tolist(), strict=True)
    return float(np.mean([recall_with_ties(*line, k) for line in lines]))


# -- search effort -----------------------------------------------------------------------------
#
# An IVF index searched with faiss's default nprobe (1) visits one list of nlist: at k = 1000 on
# 11k images it answered 58 rows, and its ANN recall@10 was 0.56-0.62. A build not told how hard
# to search measures it instead: the index family's parameter is raised along its ladder (nprobe
# 1, 2, 4, ... every list; efSearch from faiss's default 16 to MAX_EF_SEARCH) until ANN recall
# against exact search reaches a target, and the value chosen goes into the manifest's search
# parameters, which every loader applies.
EFFORT_PLATEAU = 0.005  # target out of reach: the least effort within this of the best recall seen


def search_effort(index: faiss.Index | ExactRerank) -> tuple[str, list[int]] | None:
    """The search parameter that trades `index`'s speed for recall and the values a build tries,
    in order; None for an index that searches every row it has (Flat, PQ, SQ)."""
    base = index.index if isinstance(index, ExactRerank) else index
    ivf = ivf_of(base)
    if ivf is not None:
        return "nprobe", _doubling(1, ivf.nlist)
    if isinstance(inner_index(base), faiss.IndexHNSW):
        return "efSearch", _doubling(16, MAX_EF_SEARCH)
    return None


def _doubling(start: int, stop: int) -> list[int]:
    values = [start]
    while values[-1] < stop:
        values.append(min(2 * values[-1], stop))
    return values


@dataclass
class EffortChoice:
    """What `tune_search_effort` chose: `parameter` = `value`, its ANN recall@`k`, and the recall
    of every value tried; `reached`: whether any reached `target`."""

    parameter: str
    value: int
    recall: float
    k: int
    target: float
    tried: dict[int, float]

    @property
    def reached(self) -> bool:
        return self.recall >= self.target

    def to_dict(self) -> dict[str, Any]:
        return {
            "parameter": self.parameter,
            "value": self.value,
            "target": self.target,
            "k": self.k,
            "tried": {str(v): round(r, 4) for v, r in self.tried.items()},
        }

    def __str__(self) -> str:
        tried = ", ".join(f"{v}: {r:.3f}" for v, r in self.tried.items())
        if self.reached:
            return (
                f"{self.parameter} {self.value} chosen: the least reaching ANN recall@{self.k} {self.target} "
                f"against exact search ({self.parameter} → recall: {tried})"
            )
        return (
            f"{self.parameter} {self.value} chosen, but no {self.parameter} reached ANN recall@{self.k} "
            f"{self.target} against exact search ({self.parameter} → recall: {tried}): the index's codes, not "
            "its search, lose the rest"
        )


def tune_search_effort(
    index: faiss.Index | ExactRerank, database: np.ndarray, queries: np.ndarray, k: int, target: float
) -> EffortChoice | None:
    """Set on `index` the least search effort (`search_effort`) whose ANN recall@k of `queries`
    against exact search over `database` reaches `target` — or, when none does, the least within
    EFFORT_PLATEAU of the best; None (nothing set) for an index with no such parameter."""
    effort = search_effort(index)
    if effort is None:
        return None
    parameter, ladder = effort
    base = index.index if isinstance(index, ExactRerank) else index
    data = unit_rows(database)
    queries = unit_rows(queries, data.shape[1])
    _, exact_rows = exact_search(data, queries, k)  # once: only the index's effort changes
    tried: dict[int, float] = {}
    for value in ladder:
        apply_search_params(base, {parameter: value})
        tried[value] = recall_against(search(index, queries, k)[1], exact_rows, data, queries)
        if tried[value] >= target:
            break
    best = max(tried.values())
    value = next(v for v, r in tried.items() if r >= (target if best >= target else best - EFFORT_PLATEAU))
    apply_search_params(base, {parameter: value})
    return EffortChoice(parameter, value, tried[value], k, target, tried)
