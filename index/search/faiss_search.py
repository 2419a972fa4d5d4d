"""A faiss index searched: top k of L2-normalised queries, re-ranked exactly against the stored
vectors (`ExactRerank`), within a filter's rows (the filtered-search planner: exact search over
the rows or the index with an id selector), past a version's deleted rows, and leaving out a
query's own row."""

from __future__ import annotations

import functools

import faiss
import numpy as np

from core.retrieval.ranking import best_k
from core.retrieval.vectors import RowBlocks, as_float32_rows, l2_normalized
from index.search.faiss_index import RERANK, inner_index, rerank_factor

# `ExactRerank.score_slack`: rows sampled, candidates each, and the margin over the largest
# shortfall seen (a sample's maximum underestimates the catalog's).
SLACK_SAMPLE, SLACK_DEPTH, SLACK_MARGIN = 256, 64, 1.5


class ExactRerank:
    """An index whose top k are the best of `factor`×k candidates from `index`, re-scored
    exactly against `stored` (the version's embeddings.npy, memory-mapped) — faiss's
    IndexRefineFlat without a second copy of the vectors in RAM: the compact codes stay the
    resident index, and a query reads only its candidates' rows from the page cache."""

    def __init__(self, index: faiss.Index, stored: np.ndarray, factor: int) -> None:
        if factor < 1:
            raise ValueError(f"rerank factor must be >= 1, got {factor}")
        if stored.shape != (index.ntotal, index.d):
            raise ValueError(f"stored vectors are {stored.shape}, the index {index.ntotal}×{index.d}")
        # The map kept as a plain array: np.memmap's indexing runs Python (its __getitem__ and
        # __array_finalize__) for every gather, a fifth of a one-query re-rank's own cost. A
        # segmented version's `RowBlocks` stays as it is (np.asarray would join its maps).
        self.index, self.factor = index, factor
        self.stored = stored if isinstance(stored, RowBlocks) else np.asarray(stored)

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    @property
    def d(self) -> int:
        return self.index.d

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The stored vectors of `rows` (any shape of row numbers ≥ 0), shaped rows.shape + (d,)."""
        flat = np.asarray(rows).ravel()
        # Rows sorted before the gather: a memory-mapped read then walks the file forwards.
        order = np.argsort(flat, kind="stable")
        gathered = np.empty((len(flat), self.d), dtype=np.float32)
        gathered[order] = self.stored[flat[order]]
        return gathered.reshape(*np.shape(rows), self.d)

    def exact_scores(self, queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each query's inner product with the stored vectors of its `rows` (nq × c, rows ≥ 0).
        Scored by faiss's kernels straight from the rows: the (nq, c, d) gather and NumPy
        product before them were most of a re-ranked search's cost (docs/benchmarks.md,
        "Sharded versions")."""
        stored = self.stored
        if not _in_place(stored):
            return np.einsum("qd,qcd->qc", queries, self.gather(rows)).astype(np.float32)
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        scores = np.empty(rows.shape, dtype=np.float32)
        d, c = self.d, rows.shape[1]
        if len(queries) != 1:
            # A batch: faiss scores every query's rows in place (no copy), across its OpenMP
            # threads — the candidates' search before it forked that team already.
            faiss.fvec_inner_products_by_idx(
                faiss.swig_ptr(scores), faiss.swig_ptr(queries), faiss.swig_ptr(stored), faiss.swig_ptr(rows),
                d, len(queries), c,
            )  # fmt: skip
            return scores
        # One query in the caller's thread: an OpenMP team's barrier, on a busy machine, waits
        # for a descheduled thread (p99 8 ms against 2 µs); its rows are copied out and scored.
        block = stored.take(rows[0], axis=0)
        faiss.fvec_inner_products_ny(faiss.swig_ptr(scores), faiss.swig_ptr(queries), faiss.swig_ptr(block), d, c)
        return scores

    def search(
        self, queries: np.ndarray, k: int, params: faiss.SearchParameters | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`params` (a filter's id selector, widened nprobe/efSearch) go to the candidates' search."""
        depth = min(k * self.factor, self.index.ntotal)
        if depth == 0:  # an empty shard: faiss refuses k = 0; no place has an answer
            return np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64)
        _, candidates = self.index.search(queries, depth, params=params)
        missing = candidates < 0
        short = bool(missing.any())  # a filter or a small list: fewer candidates than asked
        scores = self.exact_scores(queries, np.where(missing, 0, candidates) if short else candidates)
        if short:
            scores[missing] = -np.inf
        top = best_k(scores, k)  # ties by place: in the order the index found its candidates
        each = np.arange(len(queries))[:, None]
        best, rows = scores[each, top], candidates[each, top]
        if short:
            rows = np.where(np.isfinite(best), rows, -1)
        return best, rows

    @functools.cached_property
    def score_slack(self) -> float:
        """How far below a vector's exact score the codes may score it, with a margin: a range
        search over the codes at `min_score - score_slack` holds every row whose exact score
        reaches `min_score` (`index.search.range_search`). Measured once, on a fixed sample of stored
        rows querying the index (their top candidates: the scores near a threshold that matter)."""
        n = self.index.ntotal
        if n == 0:
            return 0.0
        picked = np.sort(np.random.default_rng(0).choice(n, size=min(SLACK_SAMPLE, n), replace=False))
        queries = self.gather(picked)
        approximate, candidates = self.index.search(queries, min(SLACK_DEPTH, n))
        found = candidates >= 0
        exact = self.exact_scores(queries, np.where(found, candidates, 0))
        shortfall = (exact - approximate)[found]
        return float(SLACK_MARGIN * max(float(shortfall.max(initial=0.0)), 0.0) + 1e-3)


def searchable(index: faiss.Index, params: dict[str, float], stored: np.ndarray | None) -> faiss.Index | ExactRerank:
    """The index as searched with `params`: wrapped in `ExactRerank` when they ask for it."""
    factor = rerank_factor(params)
    if not factor:
        return index
    if stored is None:
        raise ValueError(f"search parameter {RERANK}={factor} needs the stored vectors")
    return ExactRerank(index, stored, factor)


# -- filtered search ---------------------------------------------------------------------------
#
# A filter's rows are a bool mask. Below a fraction of the index (per index family, measured by
# benchmarks/bench_filter.py: docs/benchmarks.md, filtered search) the rows are searched
# exactly — a gather of their stored vectors and one product, cheap when they are few and exact
# by construction. Above it the index searches itself with an id selector over the mask, so
# rows outside the filter never take a place in the top k; nprobe / efSearch are widened by
# the inverse selectivity (to the power WIDEN_POWER), since only that fraction of what the
# search visits can answer. HNSW's walk follows the whole graph but only matching nodes enter
# the answer, so at low selectivity it runs out of effort before it finds k of them (Qdrant's
# filterable-HNSW and ACORN notes): its threshold sits higher.
EXACT, INDEX = "exact", "index"


# Measured at 1M (docs/benchmarks.md): Flat's scan with a selector is 10× slower than exact search
# over the rows at every selectivity. For IVF and HNSW, exact search costs in proportion to the
# matching rows and the index's search barely changes: with many queries of one filter in one
# call (the rows gathered once) exact search wins at 10% and loses at 50%, crossing between 15%
# and 20%; a query alone reads its rows by itself, and the crossing falls to about 1% (IVF) and
# a few percent (HNSW, whose own search is costlier per query).
EXACT_BELOW = {"flat": 1.0, "ivf": 0.15, "hnsw": 0.15}


EXACT_BELOW_ALONE = {"flat": 1.0, "ivf": 0.01, "hnsw": 0.02}  # up to IN_PLACE_QUERIES queries of a filter


WIDEN_POWER = 0.5


MAX_EF_SEARCH = 2048


def index_family(index: faiss.Index | ExactRerank) -> str | None:
    """'flat', 'ivf' or 'hnsw': how an index takes an id selector; None when it takes none here
    (wrapped indexes such as a PCA pre-transform: those are searched exactly within a filter)."""
    base = inner_index(index.index if isinstance(index, ExactRerank) else index)
    if isinstance(base, faiss.IndexIVF):
        return "ivf"
    if isinstance(base, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(base, faiss.IndexFlatCodes):
        return "flat"
    return None


def selector_params(
    index: faiss.Index | ExactRerank, allowed: np.ndarray | None, k: int, effort: float = 1.0
) -> faiss.SearchParameters:
    """Search parameters restricting `index` to the rows `allowed` marks (None: every row), with
    the index's own nprobe / efSearch carried over (params given to a search replace them) and
    widened for the filter's selectivity, times `effort` (a grouped search's later rounds)."""
    base = inner_index(index.index if isinstance(index, ExactRerank) else index)
    # A bitmap, least significant bit first, is one load and a shift per test (IDSelectorBitmap).
    selector = None if allowed is None else faiss.IDSelectorBitmap(np.packbits(allowed, bitorder="little"))
    widen = effort
    if allowed is not None:
        widen *= (len(allowed) / max(int(np.count_nonzero(allowed)), 1)) ** WIDEN_POWER
    if isinstance(base, faiss.IndexIVF):
        nprobe = min(base.nlist, int(np.ceil(base.nprobe * widen)))
        return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe, max_codes=base.max_codes)
    if isinstance(base, faiss.IndexHNSW):
        ef = min(MAX_EF_SEARCH, int(np.ceil(max(base.hnsw.efSearch, k) * widen)))
        return faiss.SearchParametersHNSW(sel=selector, efSearch=max(ef, k))
    return faiss.SearchParameters(sel=selector)


# Up to this many queries of one filter are scored row by row in place (no gather); more share
# one gather of the rows, which then costs less than scoring them in place again for each query.
IN_PLACE_QUERIES = 16


def inner_products(stored: np.ndarray, query: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """`stored[rows] @ query` (every row when None) by faiss's kernels, where the rows lie (a
    memory map too): NumPy's BLAS product starts threads that a busy machine stalls (7 ms for
    10k rows under load, against 0.1 ms here)."""
    query = np.ascontiguousarray(query, dtype=np.float32)
    if isinstance(stored, RowBlocks):  # each segment's rows scored where they lie
        if rows is None:
            return np.concatenate([inner_products(block, query) for block in stored.blocks])
        out = np.empty(len(rows), dtype=np.float32)
        for block, places, local in stored.split(np.asarray(rows, dtype=np.int64)):
            out[places] = inner_products(stored.blocks[block], query, local)
        return out
    if stored.dtype != np.float32 or not stored.flags.c_contiguous:
        return np.asarray((stored if rows is None else stored[rows]) @ query, dtype=np.float32)
    dim = stored.shape[1]
    if rows is None:
        out = np.empty(len(stored), dtype=np.float32)
        faiss.fvec_inner_products_ny(
            faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(stored), dim, len(stored)
        )
        return out
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(len(rows), dtype=np.float32)
    faiss.fvec_inner_products_by_idx(
        faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(stored), faiss.swig_ptr(rows), dim, 1, len(rows)
    )
    return out


def _in_place(stored: np.ndarray | RowBlocks) -> bool:
    """faiss's kernels can score `stored`'s rows where they lie (one float32 C-contiguous array)."""
    return isinstance(stored, np.ndarray) and stored.dtype == np.float32 and stored.flags.c_contiguous


def exact_within(stored: np.ndarray, queries: np.ndarray, k: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of `queries` among `rows` of `stored`: (scores, rows), -1 rows (score -inf)
    past the rows there are."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = np.full((len(queries), k), -1, dtype=np.int64)
    depth = min(k, len(rows))
    if not depth:
        return scores, found
    if len(queries) <= IN_PLACE_QUERIES and (isinstance(stored, RowBlocks) or _in_place(stored)):
        # faiss scores the rows where they lie (the memory map itself): copying 100k rows out
        # first costs 20× the scoring at 1M items, and a lone query cannot share the copy.
        for i, query in enumerate(queries):
            products = inner_products(stored, query, rows)
            top = best_k(products, depth)  # rows ascending: ties to the lower row
            scores[i, :depth], found[i, :depth] = products[top], rows[top]
        return scores, found
    gathered = np.ascontiguousarray(stored[rows], dtype=np.float32)  # rows ascending: the map is read forwards
    # faiss.knn rather than a NumPy product and argpartition: its blocked product and heaps
    # cost a third as much, and a busy machine does not stall it as multi-threaded NumPy BLAS.
    part_scores, part = faiss.knn(queries, gathered, depth, metric=faiss.METRIC_INNER_PRODUCT)
    scores[:, :depth] = part_scores
    found[:, :depth] = np.where(part >= 0, rows[np.maximum(part, 0)], -1)
    return scores, found


def search_within(
    index: faiss.Index | ExactRerank,
    stored: np.ndarray,
    queries: np.ndarray,
    k: int,
    allowed: np.ndarray,
    exact_below: float | None = None,
    rows: np.ndarray | None = None,
    effort: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Top-k (scores, rows) of L2-normalised `queries` among the rows `allowed` marks, and the
    path the planner took (EXACT or INDEX): exact search over those rows when they are at most
    `exact_below` of the index (default: its family's EXACT_BELOW, or EXACT_BELOW_ALONE for a
    few queries, which cannot share the reading of the rows), else the index's own
    search with a selector. Places past the matching rows hold row -1. `rows`: the mask's rows
    (`np.flatnonzero(allowed)`) when the caller keeps them for a mask it reuses; `effort`
    multiplies the widened nprobe / efSearch (`selector_params`)."""
    family = index_family(index)
    thresholds = EXACT_BELOW_ALONE if len(queries) <= IN_PLACE_QUERIES else EXACT_BELOW
    threshold = exact_below if exact_below is not None else thresholds.get(family or "", 1.0)
    count = len(rows) if rows is not None else int(np.count_nonzero(allowed))
    if family is None or count <= threshold * len(allowed) or count <= k:
        return (*exact_within(stored, queries, k, np.flatnonzero(allowed) if rows is None else rows), EXACT)
    params = selector_params(index, allowed, k, effort)
    scores, rows = index.search(queries, min(k, index.ntotal), params=params)
    return scores, rows, INDEX


# Up to this many deleted rows (a version's tombstones) a search asks the index for that many more
# places and drops them (Lucene's live-docs check, as it collects): exact as the index is, and
# the index's own kernel — a scan with a selector of 999,990 live rows in 1M costs Flat ~10×
# (EXACT_BELOW's measure), the planner's exact path over them a gather of every row.
OVERFETCH_DELETED = 4096


def search_live(
    index: faiss.Index | ExactRerank,
    stored: np.ndarray,
    queries: np.ndarray,
    depth: int,
    live: np.ndarray | None,
    deleted: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-`depth` (scores, rows) of `queries` among the rows `live` marks (None: every row),
    `deleted` of them not: the index asked `deleted` places deeper and those rows dropped, or
    with more than OVERFETCH_DELETED the filtered-search planner over the live rows. Places past
    the rows found hold row -1 (score -inf)."""
    if live is None or not deleted:
        return search(index, queries, depth)
    if deleted > OVERFETCH_DELETED:
        scores, rows, _ = search_within(index, stored, queries, depth, live)
        return scores, rows
    scores, rows = search(index, queries, depth + deleted)
    kept = (rows >= 0) & live[np.maximum(rows, 0)]
    order = np.argsort(~kept, axis=1, kind="stable")[:, :depth]  # kept places first, in rank order
    scores, rows, kept = (np.take_along_axis(a, order, axis=1) for a in (scores, rows, kept))
    return np.where(kept, scores, -np.inf).astype(np.float32), np.where(kept, rows, -1)


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, rows) for L2-normalised queries; rows are -1 past the index size."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    q = l2_normalized(as_float32_rows(queries, index.d))
    return index.search(q, min(k, max(index.ntotal, 1)))


def search_leaving_out_self(
    index: faiss.Index, vectors: np.ndarray, query_rows: np.ndarray, depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """Items of the index querying it by their own vectors (`vectors[query_rows]`): the top
    `depth` (scores, rows) of each, its own row left out; places past the answers hold -1 (score 0)."""
    scores, rows = search(index, vectors[query_rows], min(depth + 1, max(index.ntotal, 1)))
    found_rows = np.full((len(query_rows), depth), -1, dtype=np.int64)
    found_scores = np.zeros((len(query_rows), depth), dtype=np.float32)
    for i, query_row in enumerate(query_rows):
        keep = (rows[i] >= 0) & (rows[i] != query_row)
        others, their_scores = rows[i][keep][:depth], scores[i][keep][:depth]
        found_rows[i, : len(others)], found_scores[i, : len(others)] = others, their_scores
    return found_scores, found_rows
