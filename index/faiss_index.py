"""faiss index building and searching on inner product of L2-normalised vectors."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import faiss
import numpy as np

from core.vectors import as_float32_rows, exact_search, l2_normalized

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
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"invalid faiss factory string {factory!r}: {exc}") from exc
    on_gpu = select_device(device) == "gpu"
    if on_gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    if not index.is_trained:
        sample = data
        if train_size is not None and train_size < n:
            rng = np.random.default_rng(seed)
            sample = data[np.sort(rng.choice(n, size=train_size, replace=False))]
        index.train(sample)
    index.add(data)
    if on_gpu:
        index = faiss.index_gpu_to_cpu(index)
    if search_params:
        apply_search_params(index, search_params)
    return index


def apply_search_params(index: faiss.Index, params: dict[str, float]) -> None:
    """Set search-time parameters such as nprobe or efSearch by name (`rerank` is checked
    here and applied by `ExactRerank`)."""
    space = faiss.ParameterSpace()
    for name, value in params.items():
        if name == RERANK:
            rerank_factor(params)
            continue
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as exc:
            raise ValueError(f"index does not accept search parameter {name}={value}: {exc}") from exc


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
        self.index, self.stored, self.factor = index, stored, factor

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

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        depth = min(k * self.factor, self.index.ntotal)
        _, candidates = self.index.search(queries, depth)
        found = candidates >= 0
        scores = np.einsum("qd,qcd->qc", queries, self.gather(np.where(found, candidates, 0)))
        scores[~found] = -np.inf
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        best = np.take_along_axis(scores, top, axis=1).astype(np.float32)
        rows = np.where(np.isfinite(best), np.take_along_axis(candidates, top, axis=1), -1)
        return best, rows

    @functools.cached_property
    def score_slack(self) -> float:
        """How far below a vector's exact score the codes may score it, with a margin: a range
        search over the codes at `min_score - score_slack` holds every row whose exact score
        reaches `min_score` (`index.range_search`). Measured once, on a fixed sample of stored
        rows querying the index (their top candidates: the scores near a threshold that matter)."""
        n = self.index.ntotal
        if n == 0:
            return 0.0
        picked = np.sort(np.random.default_rng(0).choice(n, size=min(SLACK_SAMPLE, n), replace=False))
        queries = self.gather(picked)
        approximate, candidates = self.index.search(queries, min(SLACK_DEPTH, n))
        found = candidates >= 0
        exact = np.einsum("qd,qcd->qc", queries, self.gather(np.where(found, candidates, 0)))
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


def load_index(path: str | Path) -> faiss.Index:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"faiss index not found: {path}")
    return faiss.read_index(str(path))


def stores_exact_vectors(index: faiss.Index) -> bool:
    """Whether the index keeps the vectors themselves (Flat, IVF-Flat, HNSW-Flat), not codes
    that decode only to approximations of them (PQ, SQ)."""
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexFlat, faiss.IndexIVFFlat)):
        return True
    if isinstance(index, faiss.IndexHNSW):
        return stores_exact_vectors(index.storage)
    return False


def ann_recall(index, database: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Fraction of the exact top-k neighbours the ANN index returns (averaged over queries)."""
    _, exact_rows = exact_search(database, queries, k)
    _, ann_rows = search(index, queries, k)
    return float(np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(ann_rows, exact_rows, strict=False)]))
