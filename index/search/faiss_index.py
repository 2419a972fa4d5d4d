"""A faiss index made over inner product of L2-normalised vectors: its factory string checked,
trained (the k-means a factory needs, and what it needs of the catalog), built, given its search
parameters, saved and loaded, and what kind of index it is. Searching it is
`index.search.faiss_search`; its ANN recall and search effort, `index.search.ann_recall`."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import faiss
import numpy as np

from core.retrieval.vectors import l2_normalized
from index.search.merge import MergedIndex

log = logging.getLogger(__name__)

# A search parameter of our own beside faiss's (nprobe, efSearch, ...): re-score RERANK×k
# candidates exactly against the stored vectors. 0 turns it off.
RERANK = "rerank"
DEFAULT_RERANK = 10  # for an index of approximate codes (PQ, SQ): docs/benchmarks.md, index choice


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
    if search_params:  # before the rows go in too: HNSW's efConstruction shapes the graph as it is built
        apply_search_params(index, search_params)
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
