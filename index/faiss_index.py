"""faiss index building and searching on inner product of L2-normalised vectors."""

from __future__ import annotations

import logging
from pathlib import Path

import faiss
import numpy as np

log = logging.getLogger(__name__)


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
    """Set search-time parameters such as nprobe or efSearch by name."""
    space = faiss.ParameterSpace()
    for name, value in params.items():
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as exc:
            raise ValueError(f"index does not accept search parameter {name}={value}: {exc}") from exc


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, rows) for L2-normalised queries; rows are -1 past the index size."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    q = l2_normalized(as_float32_rows(queries, index.d))
    return index.search(q, min(k, max(index.ntotal, 1)))


def exact_search(database: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product search, the reference every ANN index is measured against."""
    data = l2_normalized(database)
    flat = faiss.IndexFlatIP(data.shape[1])
    flat.add(data)
    return search(flat, queries, k)


def save_index(index: faiss.Index, path: str | Path) -> None:
    faiss.write_index(index, str(path))


def load_index(path: str | Path) -> faiss.Index:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"faiss index not found: {path}")
    return faiss.read_index(str(path))


def reconstruct_all(index: faiss.Index) -> np.ndarray | None:
    """Stored vectors when the index keeps them exactly (Flat/HNSW), else None."""
    if not _stores_exact_vectors(index):
        return None  # PQ/SQ codes only decode to approximations of the vectors
    try:
        return index.reconstruct_n(0, index.ntotal)
    except RuntimeError:
        return None


def _stores_exact_vectors(index: faiss.Index) -> bool:
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexFlat, faiss.IndexIVFFlat)):
        return True
    if isinstance(index, faiss.IndexHNSW):
        return _stores_exact_vectors(index.storage)
    return False
