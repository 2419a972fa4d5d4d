"""Batch index rebuild on Ray Data: read the catalog, decode and embed on the cluster, publish.

The catalog becomes a Ray Dataset; `map_batches` decodes and preprocesses with the one
preprocessing implementation (`core.data.preprocess`), an actor pool embeds with ONNX Runtime
(one GPU per actor when the cluster has GPUs, CPU actors otherwise), and the embeddings are
written as Parquet shards to a work directory keyed by catalog and model. The driver then
builds the faiss index and publishes it through the same quality gate and atomic publish as
`index build`. With `--shards S` the driver never gathers the vectors: a `map_batches` step
computes each row's shard from its item (or id), and `map_groups` builds each shard from its
own rows into a copy of the index trained once on the build's sample (`build_shards_on_ray_data`);
the quality gate then measures the merged search (which reads every shard's vectors: the gate's
cost, not the build's). Unreadable rows are marked, skipped and counted, never fatal below the
allowed fraction. A crashed run is safe to re-run: shards without a completion marker are discarded and
rewritten, completed shards are reused, and nothing is published until the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from core.artifacts.index_manifest import ShardEntry
from core.artifacts.layout import utc_now, write_json_atomic
from core.artifacts.model_manifests import ModelManifest
from core.cli import init_ray
from core.config import option
from core.data.catalog import BBOX_COLUMN, Catalog, CatalogError, parse_bbox, read_catalog
from core.data.preprocess import ImageDecodeError, RegionError, load_image
from index.build.config import DEFAULT_MODEL, BuildConfig, default_catalog
from index.build.embed import check_bad_rows
from index.build.publish import IndexRecipe, NewVersion, version_table
from index.search.faiss_index import apply_search_params, empty_index, trained_index
from index.search.filters import FieldSpec
from index.versions.sharding import build_shard_group, check_shard_count, empty_shard, shard_keys, shard_of
from index.versions.version_writer import VersionWriter

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
        out = {"row": batch["row"], "reason": reasons.astype(str), "embedding": embeddings}
        if "key" in batch:  # a sharded rebuild: each row's shard key, for placing it
            out["key"] = batch["key"]
        return out


def work_key(catalog: Catalog, model_id: str, keys: list[str] | None = None) -> str:
    """Where a catalog's shards for a model go: its rows (id and path), not its file's bytes, so a
    folder of images has a key too. `keys`: a sharded rebuild's shard keys, which its shards
    hold beside the embeddings (another item field is other shards to reuse)."""
    digest = hashlib.sha256(model_id.encode())
    for item_id, path, meta in zip(catalog.ids, catalog.paths, catalog.metadata, strict=True):
        bbox = f"\t{meta[BBOX_COLUMN]}" if BBOX_COLUMN in meta else ""  # a new crop is a new embedding
        digest.update(f"{item_id}\t{path}{bbox}\n".encode())
    if keys is not None:
        digest.update(b"\nshard keys\n")
        digest.update("\n".join(keys).encode())
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
    keys: list[str] | None = None,
) -> None:
    """`keys`: each catalog row's shard key, carried through to the shards (a sharded rebuild)."""
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
    if keys is not None:
        for row, key in zip(rows, keys, strict=True):
            row["key"] = key
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


def read_shards(
    work: Path, n_rows: int, with_vectors: bool = True
) -> tuple[np.ndarray | None, list[int], dict[str, int]]:
    """The embeddings of every readable row, in catalog order, read shard batch by shard batch
    into one array: memory is the catalog's embeddings once, plus a batch (at SOP size with
    1,280-d vectors, reading the whole table and stacking it held five copies, 3.3 GB).
    `with_vectors` False: the rows kept and skipped only (a sharded rebuild's shards read the
    embeddings themselves), the embeddings None."""
    import pyarrow.dataset as pads

    vectors: np.ndarray | None = None
    reasons = np.full(n_rows, "", dtype=object)
    seen = np.zeros(n_rows, dtype=bool)
    columns = ["row", "reason", "embedding"] if with_vectors else ["row", "reason"]
    for batch in pads.dataset(str(work / "shards"), format="parquet").to_batches(columns=columns):
        rows = batch.column("row").to_numpy()
        if len(rows) and (rows.min() < 0 or rows.max() >= n_rows or seen[rows].any()):
            raise RuntimeError(f"{work}: shards hold rows the catalog of {n_rows} does not; delete the work dir")
        if with_vectors:
            embeddings = _embedding_rows(batch.column("embedding"))
            if vectors is None:
                vectors = np.empty((n_rows, embeddings.shape[1]), dtype=np.float32)
            vectors[rows] = embeddings
        reasons[rows] = batch.column("reason").to_pylist()
        seen[rows] = True
    if (with_vectors and vectors is None) or not seen.all():
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
    if vectors is not None and bad.any():
        vectors = vectors[~bad]
    return vectors, kept, skipped


def read_rows(work: Path, rows: np.ndarray, dim: int) -> np.ndarray:
    """The embeddings of catalog `rows` (ascending), in that order, read batch by batch: the
    training sample of a sharded rebuild, without the rest of the catalog's vectors."""
    import pyarrow.dataset as pads

    out = np.empty((len(rows), dim), dtype=np.float32)
    for batch in pads.dataset(str(work / "shards"), format="parquet").to_batches(columns=["row", "embedding"]):
        batch_rows = batch.column("row").to_numpy()
        wanted = np.isin(batch_rows, rows)
        if wanted.any():
            picked = np.flatnonzero(wanted)
            out[np.searchsorted(rows, batch_rows[picked])] = _embedding_rows(batch.column("embedding").take(picked))
    return out


def place_rows(batch: dict[str, np.ndarray], shards: int) -> dict[str, np.ndarray]:
    """Ray Data `map_batches`: each readable row's shard, from its shard key (unreadable rows
    dropped: they are counted, never indexed)."""
    ok = batch["reason"] == ""
    placed = np.fromiter((shard_of(str(key), shards) for key in batch["key"][ok]), np.int64, int(ok.sum()))
    return {"row": batch["row"][ok], "embedding": batch["embedding"][ok], "shard": placed}


def build_shards_on_ray_data(
    work: Path,
    catalog: Catalog,
    kept: list[int],
    shards: int,
    dim: int,
    item_field: str | None,
) -> Callable[[VersionWriter, IndexRecipe, str, list[FieldSpec]], list[ShardEntry]]:
    """A sharded rebuild's shards, built from the embedding files by Ray Data: the quantizer
    trained once on the sample `index build` would draw (read alone from the files), each row's
    shard computed in `map_batches` (`place_rows`), and each shard's rows — only those — built
    and written by one `map_groups` call (`sharding.build_shard_group`). The driver holds the
    items table and the training sample, never every row's vector."""

    def build(writer: VersionWriter, recipe: IndexRecipe, device: str, specs: list[FieldSpec]) -> list[ShardEntry]:
        import ray

        check_shard_count(shards, len(kept))
        kept_rows = np.asarray(kept, dtype=np.int64)
        started = time.perf_counter()
        trained = empty_index(dim, recipe.factory)
        if not trained.is_trained:  # the rows `trained_index` would sample from all the kept rows
            chosen = np.arange(len(kept_rows))
            if recipe.train_size is not None and recipe.train_size < len(kept_rows):
                rng = np.random.default_rng(0)
                chosen = np.sort(rng.choice(len(kept_rows), size=recipe.train_size, replace=False))
            sample = read_rows(work, kept_rows[chosen], dim)
            trained = trained_index(sample, recipe.factory, None, device)
        if recipe.search_params:  # HNSW's efConstruction shapes each shard's graph as its rows go in
            apply_search_params(trained, recipe.search_params)
        trained_at = time.perf_counter()
        table, _ = version_table(catalog.subset(kept))
        arrow = table.to_arrow()
        writers = [writer.shard(number) for number in range(shards)]
        refs = {
            "writers": writers,
            "trained_ref": ray.put(faiss.serialize_index(trained)),
            "table_ref": ray.put(arrow),
            "kept_ref": ray.put(kept_rows),
            "specs": list(specs),
        }
        ds = ray.data.read_parquet(str(work / "shards"))
        ds = ds.map_batches(place_rows, fn_kwargs={"shards": shards}, batch_format="numpy")
        built = ds.groupby("shard").map_groups(build_shard_group, fn_kwargs=refs, batch_format="numpy", num_cpus=1)
        found = {int(row["shard"]): ShardEntry(**json.loads(row["entry"])) for row in built.take_all()}
        entries, offset = [], 0
        for number in range(shards):  # a shard no row hashes to is empty, not missing
            entry = found.get(number) or empty_shard(writers[number], trained, dim, arrow.slice(0, 0), list(specs))
            entries.append(dataclasses.replace(entry, row_offset=offset))
            offset += entry.rows
        log.info(
            "%d shards (%s rows) on Ray Data: trained once in %.1f s, placed and added in %.1f s",
            shards, "/".join(str(e.rows) for e in entries), trained_at - started, time.perf_counter() - trained_at,
        )  # fmt: skip
        return entries

    return build


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
    sharded = cfg.shards > 1
    # A sharded rebuild carries each row's shard key through Ray Data, to place it there.
    keys = shard_keys(catalog, cfg.item_field) if sharded else None
    work = Path(cfg.work_dir or Path(cfg.index_root) / ".rebuild") / work_key(catalog, model.model_id, keys)
    if (work / DONE).is_file():
        log.info("reusing completed embedding shards in %s", work)
    else:
        shutil.rmtree(work, ignore_errors=True)  # a crashed run's partial shards are not trusted
        work.mkdir(parents=True)
        embed_with_ray_data(
            catalog_path, model_dir, work, cfg.workers, cfg.batch_size, cfg.provider, cfg.max_pixels, progress, keys
        )
    embed_seconds = time.perf_counter() - started
    embeddings, kept, skipped = read_shards(work, len(catalog), with_vectors=not sharded)
    check_bad_rows(len(catalog), len(kept), skipped, cfg.max_bad_fraction)
    engine = {"name": "ray_data", "workers": cfg.workers}
    if embeddings is None:  # sharded: the rows go from the files to their shards on Ray Data
        embeddings = np.zeros((0, model.embedding_dim), dtype=np.float32)
    new = NewVersion.of_catalog(
        model.model_id, catalog_path, catalog, embeddings, kept, skipped, started, embed_seconds, engine
    )
    if sharded:
        new.shard_builder = build_shards_on_ray_data(
            work, catalog, kept, cfg.shards, model.embedding_dim, cfg.item_field
        )
    target = cfg.publish(new)
    shutil.rmtree(work, ignore_errors=True)
    return target
