"""Every neighbour at or above a cosine similarity (`min_score`), not just the top k: near-duplicates.

Two ways, by index type (`by_range_search`):
- **faiss range search** where it finds every row its k-NN search would: Flat (exact), IVF
  (every vector of the probed lists), and IVF-PQ behind `ExactRerank` — there the codes are
  searched at `min_score - score_slack` and the candidates re-scored exactly against the stored
  vectors, so the answer's scores are exact and a row is not lost to its code's error.
- **a widened k-NN** elsewhere (HNSW): faiss's HNSW range search walks the graph with a
  candidate list of efSearch, whatever the number of rows in range, and says nothing of what it
  left: on 2,400 clustered 32-d vectors (tests/index/test_range_search.py's) at efSearch 16 it found
  63% of the rows above 0.3 that exact search finds. A k-NN search deepened (doubling) until
  its last score falls below `min_score`, its walk widened to its depth, found 99%+ — and knows
  when the bound cut it.

An answer holds at most `limit` rows, best first; `truncated` says more rows reached
`min_score` (the range search counts them; the widened k-NN saw at least one more).
Rows that `live` marks False (deleted, still in the index) and each query's `exclude` rows never
answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from core.retrieval.ranking import best_k
from index.search.faiss_index import inner_index
from index.search.faiss_search import ExactRerank
from index.search.merge import MergedIndex

# The widened k-NN's first depth; it doubles from there. Near-duplicates are few: most queries
# stop at the first call, and a deep first call (k = max_k = 1000) costs HNSW a long walk.
FIRST_DEPTH = 32


@dataclass(frozen=True)
class Reaching:
    """One query's rows at or above `min_score`, best first (ties by row), with their scores."""

    rows: np.ndarray  # int64
    scores: np.ndarray  # float32
    truncated: bool = False  # more rows reach min_score than `rows` holds


def by_range_search(index: faiss.Index | ExactRerank) -> bool:
    """Whether `index` answers through faiss's range search (else a widened k-NN): those whose
    range search finds every row their k-NN search would."""
    if isinstance(index, ExactRerank):
        return by_range_search(index.index)
    if isinstance(index, MergedIndex):  # a version's segments or shards: when each part has one
        return all(by_range_search(part) for part in index.inner)
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexPreTransform, faiss.IndexIDMap)):
        return by_range_search(index.index)
    return isinstance(index, (faiss.IndexFlat, faiss.IndexIVF))


def reaching(
    index: faiss.Index | ExactRerank,
    queries: np.ndarray,
    min_score: float,
    limit: int,
    live: np.ndarray | None = None,
    exclude: Sequence[frozenset[int] | set[int]] | None = None,
) -> list[Reaching]:
    """For each of `queries` (L2-normalised float32 rows), the rows of `index` scoring at least
    `min_score` against it: at most `limit`, best first, `truncated` when more reach it."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if not -1.0 <= min_score <= 1.0:
        raise ValueError(f"min_score must be within [-1, 1], got {min_score}")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    exclude = exclude if exclude is not None else [frozenset()] * len(queries)
    if len(queries) == 0 or index.ntotal == 0:
        return [Reaching(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in queries]
    ask = _Ask(queries, min_score, limit, live, exclude)
    return _by_range(index, ask) if by_range_search(index) else _by_widened_knn(index, ask)


@dataclass(frozen=True)
class _Ask:
    """`reaching`'s arguments, as both ways take them."""

    queries: np.ndarray
    min_score: float
    limit: int
    live: np.ndarray | None
    exclude: Sequence[frozenset[int] | set[int]]


def _answering(rows: np.ndarray, live: np.ndarray | None, exclude: frozenset[int] | set[int]) -> np.ndarray:
    """Which of `rows` (all ≥ 0) may answer: live and not excluded."""
    ok = np.ones(len(rows), dtype=bool) if live is None else live[rows]
    if exclude:
        ok &= ~np.isin(rows, np.fromiter(exclude, dtype=np.int64, count=len(exclude)))
    return ok


def _best_first(rows: np.ndarray, scores: np.ndarray, limit: int, truncated: bool) -> Reaching:
    order = best_k(scores, limit, rows)
    return Reaching(rows[order].astype(np.int64), scores[order].astype(np.float32), bool(truncated))


def _by_range(index: faiss.Index | ExactRerank, ask: _Ask) -> list[Reaching]:
    queries, min_score, limit, live, exclude = ask.queries, ask.min_score, ask.limit, ask.live, ask.exclude
    rerank = index if isinstance(index, ExactRerank) else None
    searched = rerank.index if rerank is not None else index
    radius = min_score - (rerank.score_slack if rerank is not None else 0.0)
    # faiss keeps scores strictly above the radius for inner product; a row exactly at
    # min_score must answer, so the radius sits just below it (and the check below is ≥).
    lims, scores, rows = searched.range_search(queries, float(np.nextafter(np.float32(radius), np.float32(-2))))
    answers = []
    for i, query in enumerate(queries):
        r, s = rows[lims[i] : lims[i + 1]].astype(np.int64), scores[lims[i] : lims[i + 1]]
        if rerank is not None and len(r):
            # einsum, not BLAS's matrix-vector product: on a busy 2-core machine OpenBLAS's
            # threads made 424 rows × 1,280 dims take 11 ms, einsum 0.12 ms.
            s = np.einsum("cd,d->c", rerank.gather(r), query)
        keep = (s >= min_score) & _answering(r, live, exclude[i])
        r, s = r[keep], s[keep]
        answers.append(_best_first(r, s, limit, len(r) > limit))
    return answers


def _by_widened_knn(index: faiss.Index | ExactRerank, ask: _Ask) -> list[Reaching]:
    """k-NN searches of doubling depth until each query's deepest score falls below `min_score`,
    the index runs out of rows, or more than `limit` answering rows reach it."""
    queries, min_score, limit, live, exclude = ask.queries, ask.min_score, ask.limit, ask.live, ask.exclude
    n = index.ntotal
    answers: list[Reaching | None] = [None] * len(queries)
    pending = list(range(len(queries)))
    # Excluded and deleted rows take places in a k-NN answer without answering.
    deleted = 0 if live is None else int(len(live) - np.count_nonzero(live))
    widest = limit + 1 + deleted + max((len(e) for e in exclude), default=0)
    depth = min(n, widest, FIRST_DEPTH)
    while pending:
        scores, rows = _knn(index, queries[pending], depth)
        still = []
        for j, i in enumerate(pending):
            found = rows[j] >= 0
            r, s = rows[j][found].astype(np.int64), scores[j][found]
            keep = (s >= min_score) & _answering(r, live, exclude[i])
            complete = depth >= n or not found.all() or (len(s) and s[-1] < min_score)
            if complete or np.count_nonzero(keep) > limit:
                answers[i] = _best_first(r[keep], s[keep], limit, np.count_nonzero(keep) > limit)
            else:
                still.append(i)
        pending, depth = still, min(n, depth * 2)
    return answers  # type: ignore[return-value]


def _knn(index: faiss.Index | ExactRerank, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """k-NN at `depth`; HNSW's walk widened to match it: with its candidate list shorter than
    the answer (efSearch 16, depth 128) it finds about 60% of the exact top 128."""
    if not isinstance(index, ExactRerank):
        graph = inner_index(index)  # a sharded version's merged index: its shards' graphs
        if isinstance(graph, faiss.IndexHNSW) and graph.hnsw.efSearch < depth:
            return index.search(queries, depth, params=faiss.SearchParametersHNSW(efSearch=depth))
    return index.search(queries, depth)
