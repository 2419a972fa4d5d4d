"""faiss index building and searching on inner product of L2-normalised vectors."""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from core.ranking import best_k
from core.vectors import RowBlocks, as_float32_rows, exact_search, l2_normalized, unit_rows
from index.search.merge import MergedIndex

log = logging.getLogger(__name__)

# A search parameter of our own beside faiss's (nprobe, efSearch, ...): re-score RERANK×k
# candidates exactly against the stored vectors. 0 turns it off.
RERANK = "rerank"
DEFAULT_RERANK = 10  # for an index of approximate codes (PQ, SQ): docs/benchmarks.md, index choice
# `ExactRerank.score_slack`: rows sampled, candidates each, and the margin over the largest
# shortfall seen (a sample's maximum underestimates the catalog's).
SLACK_SAMPLE, SLACK_DEPTH, SLACK_MARGIN = 256, 64, 1.5


def gpu_count() -> int:
    """GPUs faiss can use (0 for a faiss-cpu build)."""
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return int(get()) if get is not None else 0
    except Exception:  # noqa: BLE001 - a broken CUDA runtime means no GPU, not a crash
        return 0


def select_device(prefer: str = "auto", num_gpus: int | None = None) -> str:
    """'gpu' when asked for (or 'auto') and faiss sees a GPU; 'cpu' otherwise."""
    if prefer not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {prefer!r}")
    available = gpu_count() if num_gpus is None else num_gpus
    if prefer == "gpu" and available == 0:
        raise RuntimeError("device 'gpu' requested but faiss sees no GPU (is faiss-gpu installed?)")
    return "gpu" if prefer != "cpu" and available > 0 else "cpu"


def faiss_message(exc: RuntimeError) -> str:
    """What a faiss RuntimeError says, without the C++ frame it names ("Error in <signature> at
    <file>:<line>: Error: '<condition>' failed: ...")."""
    text = str(exc).strip()
    match = re.match(r"Error in .*? at \S+:\d+: (?:Error: '.*?' failed: ?)?(.*)", text, re.DOTALL)
    return (match.group(1) if match else text).strip() or text


def empty_index(dim: int, factory: str) -> faiss.Index:
    """An empty, untrained inner-product index of `factory` over `dim`-d vectors: the factory
    string checked on no data (a typo fails here, before a catalog is embedded)."""
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"invalid faiss factory string {factory!r} for {dim}-d vectors: {faiss_message(exc)}") from exc


def emptied_index(index: faiss.Index) -> faiss.Index:
    """A copy of `index` holding no rows, its training (quantizer, code books) and search
    parameters kept: a shard that every row has left is such an index, loaded and searched as
    any other (faiss answers -1 for every place)."""
    empty = faiss.clone_index(index)
    empty.reset()
    return empty


def inner_index(index: faiss.Index | MergedIndex) -> faiss.Index:
    """`index` downcast, or for a version's merged parts (`MergedIndex`) its first part's own
    index: every shard has the same structure and search parameters, and a segmented version's
    first segment is of its factory (later ones may be Flat until compaction)."""
    if isinstance(index, MergedIndex):
        return inner_index(index.inner[0])
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return inner_index(index.index)
    return index


def ivf_of(index: faiss.Index) -> faiss.IndexIVF | None:
    """The inverted-file index inside `index` (through pre-transforms), or None when it has none."""
    try:
        return faiss.downcast_index(faiss.extract_index_ivf(inner_index(index)))
    except RuntimeError:
        return None


def suggested_nlist(vectors: int) -> int:
    """A list count for `vectors` vectors: about 4√n (docs/benchmarks.md, index choice), and no
    more than n/39, so that k-means has the 39 training vectors per list faiss asks for."""
    return max(1, min(round(4 * math.sqrt(vectors)), vectors // 39))


# faiss's k-means (ClusteringParameters.min_points_per_centroid) wants this many training vectors
# per centroid — an IVF list, a PQ code — and prints its own warning to stderr with fewer.
KMEANS_POINTS_PER_CENTROID = 39


def _quantizers(index: faiss.Index) -> tuple[faiss.IndexIVF | None, faiss.ProductQuantizer | None]:
    """The IVF inside `index` and its (or its storage's) product quantizer: what k-means trains."""
    ivf = ivf_of(index)
    base = inner_index(ivf if ivf is not None else index)
    if isinstance(base, faiss.IndexHNSW):
        base = faiss.downcast_index(base.storage)
    return ivf, getattr(base, "pq", None)


def check_trainable(index: faiss.Index, factory: str, vectors: int) -> str | None:
    """One rule for every list count (docs/operations.md, "Factory and catalog size"): k-means
    places each IVF list (each code of a product quantizer's code books) from the training
    vectors. Fewer vectors than centroids: ValueError, as k-means cannot run. Fewer than 39 a
    centroid (faiss's floor): the warning line to log, as it runs but places them poorly. Both
    name the list count that fits (~4√n, at most n/39); None when the vectors are enough."""
    ivf, pq = _quantizers(index)
    thin = []
    if ivf is not None and vectors < KMEANS_POINTS_PER_CENTROID * ivf.nlist:
        nlist = suggested_nlist(vectors)
        example = re.sub(r"IVF\d+", f"IVF{nlist}", factory, count=1)
        advice = f"use about {nlist} lists for {vectors} vectors (~4√n, at most n/39), e.g. {example!r}, or Flat"
        if vectors < ivf.nlist:
            raise ValueError(
                f"factory {factory!r} has {ivf.nlist} lists and needs at least as many training vectors, "
                f"but there are {vectors}: {advice}"
            )
        thin.append(
            f"factory {factory!r} has {ivf.nlist} lists and k-means wants {KMEANS_POINTS_PER_CENTROID} training "
            f"vectors a list ({KMEANS_POINTS_PER_CENTROID * ivf.nlist:,}), but there are {vectors}: built, with "
            f"lists placed poorly and recall uneven; {advice}"
        )
    if pq is not None and vectors < KMEANS_POINTS_PER_CENTROID * pq.ksub:
        advice = f"use fewer bits per code (PQ{pq.M}x4: 16 codes) or a Flat or SQ8 index"
        if vectors < pq.ksub:
            raise ValueError(
                f"factory {factory!r} has product-quantizer code books of {pq.ksub} codes and needs at least "
                f"{pq.ksub} training vectors, but there are {vectors}: {advice}"
            )
        thin.append(
            f"factory {factory!r} has product-quantizer code books of {pq.ksub} codes and k-means wants "
            f"{KMEANS_POINTS_PER_CENTROID} training vectors a code ({KMEANS_POINTS_PER_CENTROID * pq.ksub:,}), but "
            f"there are {vectors}: built, with coarser codes than it could have; {advice}"
        )
    return "; and ".join(thin) or None


def _quiet_kmeans(index: faiss.Index) -> None:
    """faiss's own "please provide at least N training points" line off stderr: `check_trainable`
    says it in the project's words, once (the floor only decides faiss's warning, not its k-means)."""
    ivf, pq = _quantizers(index)
    for quantizer in (ivf, pq):
        if quantizer is not None:
            quantizer.cp.min_points_per_centroid = 1


def build_index(
    vectors: np.ndarray,
    factory: str = "Flat",
    search_params: dict[str, float] | None = None,
    train_size: int | None = None,
    device: str = "auto",
    seed: int = 0,
) -> faiss.Index:
    """Build a CPU-resident inner-product index from any faiss factory string.

    Vectors are L2-normalised so inner product is cosine similarity. IVF/PQ indexes are trained
    on a random sample of `train_size` vectors (all when None). On a GPU the index is built there
    and copied back, so the stored artifact is always a CPU index.
    """
    data = l2_normalized(vectors)
    n, dim = data.shape
    if n == 0:
        raise ValueError("cannot build an index over zero vectors")
    index = empty_index(dim, factory)
    on_gpu = select_device(device) == "gpu"
    sample = data
    if not index.is_trained:
        sample = _training_sample(index, factory, data, train_size, seed)
    try:
        if on_gpu:
            index = faiss.index_cpu_to_all_gpus(index)
        if not index.is_trained:
            index.train(sample)
        index.add(data)
        if on_gpu:
            index = faiss.index_gpu_to_cpu(index)
    except RuntimeError as exc:  # what check_trainable does not foresee: faiss's words, without its C++ frame
        raise ValueError(
            f"faiss could not build {factory!r} over {n} vectors of dimension {dim} "
            f"(trained on {len(sample)}): {faiss_message(exc)}"
        ) from exc
    if search_params:
        apply_search_params(index, search_params)
    return index


def _training_sample(
    index: faiss.Index, factory: str, data: np.ndarray, train_size: int | None, seed: int
) -> np.ndarray:
    """The rows `index` is trained on: `train_size` of `data` drawn at random (all when None),
    checked against what its k-means needs."""
    sample = data
    if train_size is not None and train_size < len(data):
        rng = np.random.default_rng(seed)
        sample = data[np.sort(rng.choice(len(data), size=train_size, replace=False))]
    thin = check_trainable(index, factory, len(sample))
    if thin is not None:
        log.warning("%s", thin)
    _quiet_kmeans(index)
    return sample


def trained_index(
    vectors: np.ndarray, factory: str = "Flat", train_size: int | None = None, device: str = "auto", seed: int = 0
) -> faiss.Index:
    """An empty CPU index of `factory`, trained as `build_index` trains one (its coarse quantizer
    and PQ/SQ code books, on the same sample): what each shard of a sharded version is a copy
    of before its own rows are added. Flat and HNSW need no training and come back as made."""
    data = l2_normalized(vectors)
    if len(data) == 0:
        raise ValueError("cannot build an index over zero vectors")
    index = empty_index(data.shape[1], factory)
    if index.is_trained:
        return index
    sample = _training_sample(index, factory, data, train_size, seed)
    on_gpu = select_device(device) == "gpu"
    try:
        if on_gpu:
            index = faiss.index_cpu_to_all_gpus(index)
        index.train(sample)
        if on_gpu:
            index = faiss.index_gpu_to_cpu(index)
    except RuntimeError as exc:
        raise ValueError(f"faiss could not train {factory!r} on {len(sample)} vectors: {faiss_message(exc)}") from exc
    return index


def apply_search_params(index: faiss.Index | MergedIndex, params: dict[str, float], strict: bool = True) -> None:
    """Set search-time parameters such as nprobe or efSearch by name (`rerank` is checked
    here and applied by `ExactRerank`). `strict=False`: a parameter the index has no use for is
    passed over (a segment of Flat rows in an HNSW version has no efSearch). On merged parts:
    on each, a Flat part (rows waiting for compaction) taking none of them."""
    if isinstance(index, MergedIndex):
        for part in index.inner:
            apply_search_params(part, params, strict=strict and not isinstance(part, faiss.IndexFlat))
        return
    space = faiss.ParameterSpace()
    for name, value in params.items():
        if name == RERANK:
            rerank_factor(params)
            continue
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as exc:
            if not strict:
                continue
            raise ValueError(f"index does not accept search parameter {name}={value}: {faiss_message(exc)}") from exc


def rerank_factor(params: dict[str, float]) -> int:
    value = params.get(RERANK, 0)
    if isinstance(value, bool) or not float(value).is_integer() or value < 0:
        raise ValueError(f"search parameter {RERANK} must be a whole number >= 0 (0: off), got {value!r}")
    return int(value)


def with_default_rerank(index: faiss.Index, params: dict[str, float]) -> dict[str, float]:
    """`params`, with re-ranking switched on for an index that keeps only approximate codes
    unless they say otherwise: PQ codes alone lose most of recall@10 on these embeddings."""
    if RERANK in params or stores_exact_vectors(index):
        return dict(params)
    return {**params, RERANK: DEFAULT_RERANK}


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


def save_index(index: faiss.Index, path: str | Path) -> None:
    faiss.write_index(index, str(path))


def load_index(path: str | Path, mapped: bool = False) -> faiss.Index:
    """The index in `path`. `mapped`: its codes (a Flat, PQ or SQ index's, an IVF index's lists,
    an HNSW index's storage) memory-mapped from the file rather than copied into the heap, so
    they stay in the page cache, shared by every process and version that maps the same file
    (a shard's replicas, the versions keeping a segment) and given back under memory pressure.
    A mapped index is read-only: faiss aborts the process on any change to it or to its clone
    (add, reset), so only indexes that are searched, never extended, are mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"faiss index not found: {path}")
    return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mapped else 0)


def stores_exact_vectors(index: faiss.Index) -> bool:
    """Whether the index keeps the vectors themselves (Flat, IVF-Flat, HNSW-Flat), not codes
    that decode only to approximations of them (PQ, SQ)."""
    index = inner_index(index)
    if isinstance(index, (faiss.IndexFlat, faiss.IndexIVFFlat)):
        return True
    if isinstance(index, faiss.IndexHNSW):
        return stores_exact_vectors(index.storage)
    return False


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
