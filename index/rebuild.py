"""Batch index rebuild on Ray Data: read the catalog, decode and embed on the cluster, publish.

The catalog becomes a Ray Dataset; `map_batches` decodes and preprocesses with the one
preprocessing implementation (`core.preprocess`), an actor pool embeds with ONNX Runtime
(one GPU per actor when the cluster has GPUs, CPU actors otherwise), and the embeddings are
written as Parquet shards to a work directory keyed by catalog and model. The driver then
builds the faiss index and publishes it through the same quality gate and atomic publish as
`index build`. Unreadable rows are marked, skipped and counted, never fatal below the allowed
fraction. A crashed run is safe to re-run: shards without a completion marker are discarded and
rewritten, completed shards are reused, and nothing is published until the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.artifacts import utc_now, write_json_atomic
from core.catalog import BBOX_COLUMN, Catalog, CatalogError, parse_bbox, read_catalog
from core.cli import init_ray
from core.config import option
from core.manifests import ModelManifest
from core.preprocess import ImageDecodeError, RegionError, load_image
from index.config import DEFAULT_MODEL, BuildConfig, default_catalog
from index.embed import check_bad_rows
from index.publish import NewVersion, publish_index_version

log = logging.getLogger(__name__)

DONE = "DONE"


@dataclass
class RebuildConfig(BuildConfig):
    """`index rebuild`: `index build`'s options, embedded by a pool of Ray Data actors."""

    workers: int = option(2, help="embedding actors, each decoding its own images")
    work_dir: str | None = option(None, help="where embedding shards go (default: INDEX_ROOT/.rebuild)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


def embed_actor_resources(cluster_gpus: float, provider: str = "auto") -> dict[str, float]:
    """One GPU per embedding actor when the cluster has GPUs (and CUDA is allowed), else a CPU."""
    if provider == "gpu" and cluster_gpus < 1:
        raise RuntimeError(f"provider {provider!r} requested but the Ray cluster reports no GPUs")
    if provider != "cpu" and cluster_gpus >= 1:
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": 1}


class EmbedImages:
    """Ray Data actor: paths → embeddings, decoding in a thread pool beside one ONNX Runtime
    session reused across batches; bad rows are flagged with their reason, never raised.

    Decoding lives in the embedding actor, not in a stage of its own: decoded float32 pixels
    never cross the object store (at 224 px a 256-row batch is 154 MB, and decoding outran
    embedding until Ray Data's budget was spent on queued pixels), and a 2-CPU cluster is not
    asked for more actors than it has CPUs (two decoders and two embedders deadlocked there)."""

    def __init__(self, model_dir: str, provider: str, threads: int, max_pixels: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from index.embedder import OnnxEmbedder

        self.embedder = OnnxEmbedder(model_dir, provider=provider, intra_op_threads=threads)
        self.max_pixels = max_pixels
        self.decoders = ThreadPoolExecutor(max_workers=max(2, threads))

    def decode(self, path: str, bbox: str) -> np.ndarray | str:
        try:
            return load_image(path, self.embedder.contract, self.max_pixels, parse_bbox(bbox) if bbox else None)
        except ImageDecodeError as exc:
            return exc.reason

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        decoded = list(self.decoders.map(self.decode, (str(p) for p in batch["path"]), map(str, batch["bbox"])))
        reasons = np.asarray([d if isinstance(d, str) else "" for d in decoded], dtype=object)
        ok = reasons == ""
        embeddings = np.zeros((len(decoded), self.embedder.dim), dtype=np.float32)
        if ok.any():
            embeddings[ok] = self.embedder.embed(np.stack([d for d in decoded if not isinstance(d, str)]))
        return {"row": batch["row"], "reason": reasons.astype(str), "embedding": embeddings}


def work_key(catalog: Catalog, model_id: str) -> str:
    """Where a catalog's shards for a model go: its rows (id and path), not its file's bytes, so a
    folder of images has a key too."""
    digest = hashlib.sha256(model_id.encode())
    for item_id, path, meta in zip(catalog.ids, catalog.paths, catalog.metadata, strict=True):
        bbox = f"\t{meta[BBOX_COLUMN]}" if BBOX_COLUMN in meta else ""  # a new crop is a new embedding
        digest.update(f"{item_id}\t{path}{bbox}\n".encode())
    return digest.hexdigest()[:16]


def embed_with_ray_data(
    catalog_path: Path,
    model_dir: Path,
    work: Path,
    workers: int,
    batch_size: int,
    provider: str,
    max_pixels: int,
    progress: bool,
) -> None:
    import ray

    init_ray(log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    catalog = read_catalog(catalog_path)
    resources = embed_actor_resources(ray.cluster_resources().get("GPU", 0), provider)
    threads = max(1, (os.cpu_count() or 1) // max(workers, 1))
    rows = [
        {"row": i, "path": str(p), "bbox": meta.get(BBOX_COLUMN, "")}
        for i, (p, meta) in enumerate(zip(catalog.paths, catalog.metadata, strict=True))
    ]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows) // batch_size + 1, workers * 8)))
    ds = ds.map_batches(
        EmbedImages,
        fn_constructor_kwargs={
            "model_dir": str(model_dir.resolve()),
            "provider": provider if resources["num_gpus"] else "cpu",
            "threads": threads,
            "max_pixels": max_pixels,
        },
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=workers),
        **resources,
    )
    shards = work / "shards"
    ds.write_parquet(str(shards))
    write_json_atomic(work / DONE, {"rows": len(rows), "created": utc_now()})


def _embedding_rows(column) -> np.ndarray:
    """An Arrow column of fixed-width embeddings as an (n, d) float32 array, without a Python
    object per row (Ray Data stores a tensor column as an extension type over a list array)."""
    import pyarrow as pa

    if isinstance(column.type, pa.ExtensionType):
        column = column.storage
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
        flat = column.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(len(column), -1).astype(np.float32, copy=False)
    values = column.to_numpy(zero_copy_only=False)
    return np.stack(values).astype(np.float32, copy=False) if values.dtype == object else values


def read_shards(work: Path, n_rows: int) -> tuple[np.ndarray, list[int], dict[str, int]]:
    """The embeddings of every readable row, in catalog order, read shard batch by shard batch
    into one array: memory is the catalog's embeddings once, plus a batch (at SOP size with
    1,280-d vectors, reading the whole table and stacking it held five copies, 3.3 GB)."""
    import pyarrow.dataset as pads

    vectors: np.ndarray | None = None
    reasons = np.full(n_rows, "", dtype=object)
    seen = np.zeros(n_rows, dtype=bool)
    for batch in pads.dataset(str(work / "shards"), format="parquet").to_batches():
        rows = batch.column("row").to_numpy()
        if len(rows) and (rows.min() < 0 or rows.max() >= n_rows or seen[rows].any()):
            raise RuntimeError(f"{work}: shards hold rows the catalog of {n_rows} does not; delete the work dir")
        embeddings = _embedding_rows(batch.column("embedding"))
        if vectors is None:
            vectors = np.empty((n_rows, embeddings.shape[1]), dtype=np.float32)
        vectors[rows] = embeddings
        reasons[rows] = batch.column("reason").to_pylist()
        seen[rows] = True
    if vectors is None or not seen.all():
        raise RuntimeError(f"{work}: shards hold {int(seen.sum())} rows, the catalog {n_rows}; delete the work dir")
    misfits = np.flatnonzero(reasons == RegionError.reason)
    if len(misfits):  # the catalog's mistake, not unreadable files: refused, naming the rows
        shown = ", ".join(str(r + 1) for r in misfits[:5]) + (" ..." if len(misfits) > 5 else "")
        raise CatalogError(f"{len(misfits)} row(s) whose bbox does not fit the image: row {shown}")
    bad = reasons != ""
    kept = [int(r) for r in np.flatnonzero(~bad)]
    skipped: dict[str, int] = {}
    for reason in reasons[bad]:
        skipped[reason] = skipped.get(reason, 0) + 1
    return (vectors if not bad.any() else vectors[~bad]), kept, skipped


def run_rebuild(cfg: RebuildConfig, progress: bool = True) -> Path:
    """Embed the catalog with Ray Data, then build, gate and publish like `index build`."""
    cfg = dataclasses.replace(cfg, model=cfg.model or DEFAULT_MODEL)
    cfg.check_inputs()
    started = time.perf_counter()
    model_dir = Path(cfg.model)
    model = ModelManifest.read(model_dir)
    catalog_path = Path(cfg.catalog or default_catalog(model))
    catalog = read_catalog(catalog_path)
    cfg = cfg.with_item_field(catalog)
    cfg.check_catalog(catalog)
    work = Path(cfg.work_dir or Path(cfg.index_root) / ".rebuild") / work_key(catalog, model.model_id)
    if (work / DONE).is_file():
        log.info("reusing completed embedding shards in %s", work)
    else:
        shutil.rmtree(work, ignore_errors=True)  # a crashed run's partial shards are not trusted
        work.mkdir(parents=True)
        embed_with_ray_data(
            catalog_path, model_dir, work, cfg.workers, cfg.batch_size, cfg.provider, cfg.max_pixels, progress
        )
    embed_seconds = time.perf_counter() - started
    embeddings, kept, skipped = read_shards(work, len(catalog))
    check_bad_rows(len(catalog), len(kept), skipped, cfg.max_bad_fraction)
    engine = {"name": "ray_data", "workers": cfg.workers}
    new = NewVersion.of_catalog(
        model.model_id, catalog_path, catalog, embeddings, kept, skipped, started, embed_seconds, engine
    )
    target = publish_index_version(
        new,
        cfg.index_recipe,
        cfg.gate_thresholds,
        cfg.probe,
        cfg.filterable_fields,
        cfg.item_field,
        cfg.publish_target,
    )
    shutil.rmtree(work, ignore_errors=True)
    return target
