"""`index add`: a new version = the live one + the catalog rows it lacks (or, with --upsert,
replacing the rows it has), embedding only those."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, RowCounts, check_model_index_pair
from core.artifacts.layout import ArtifactError
from core.data.catalog import Catalog, CatalogError, read_catalog
from core.data.items import ItemTable
from core.retrieval.vectors import unit_rows
from index.build.config import BuildConfig
from index.build.embed import check_bad_rows, embed_catalog
from index.build.gate import GateThresholds, gate_change
from index.changes.lifecycle import compact_if_due
from index.changes.merges import merge_after_change
from index.embedder import OnnxEmbedder
from index.search.filters import parse_filterable, specs_of
from index.versions.change import ChangeReport, publish_change
from index.versions.merge_policy import TIERED, TieredMergePolicy
from index.versions.segments import MAX_DELETED_FRACTION, MAX_SEGMENTS, UnitChange
from index.versions.sharding import shard_keys, shard_of
from index.versions.version import IndexVersion

log = logging.getLogger(__name__)


def run_add(cfg: BuildConfig, progress: bool = True) -> Path:
    """Publish a new version = the live one + the catalog rows it lacks, embedding only those.

    The live version's segments are hard-linked and the new rows written as one new segment a
    shard they touch (`index.versions.change`: IVF/PQ rows coded by the version's trained quantiser),
    so an add writes the new rows and a few kilobytes, whatever the catalog's size. Rows whose
    id is already indexed are skipped and counted, not re-embedded — or, with `upsert`, replace
    the indexed ones: those are tombstoned as a removal tombstones them and come back in the
    new segment with their new vector and metadata. The gate measures the new rows
    (`index.build.gate.gate_change`); the merges the tiered policy has due then run in the
    background (`index.changes.merges`), or with `--merges whole` a shard past its segment count or
    deleted share is compacted before it returns (`index.changes.lifecycle.compact_if_due`).
    The live version's model (unless --model names another directory of it), factory, search
    parameters and filterable fields hold for the rows it gains.
    """
    started = time.perf_counter()
    if cfg.catalog is None:
        raise ValueError("index add needs --catalog with the new rows")
    live = IndexVersion.open(cfg.index_root)
    cfg = _as_live(cfg, live)
    cfg.check_inputs()
    embedder = OnnxEmbedder(cfg.model, provider=cfg.provider)
    check_model_index_pair(embedder.manifest, live.manifest)
    catalog = read_catalog(cfg.catalog)
    cfg.check_catalog(catalog, trains_index=False, root_fixes_fields=True)  # the live index is trained already
    _check_labelled_alike(catalog, live)
    new_rows, _, already = _rows_to_embed(cfg, catalog, live)
    fresh = catalog.subset(new_rows)
    vectors, kept, skipped = embed_catalog(
        fresh, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, progress
    )
    check_bad_rows(len(fresh), len(kept), skipped, cfg.max_bad_fraction)
    log.info("embedded %d new rows in %.1f s", len(kept), time.perf_counter() - started)
    added = fresh.subset(kept)
    added_items = ItemTable(
        ids=added.ids, labels=added.labels, paths=[str(p.resolve()) for p in added.paths], metadata=added.metadata
    )
    report = add_vectors(
        cfg.index_root,
        vectors,
        added_items,
        upsert=cfg.upsert,
        gate=cfg.gate_thresholds,
        keep=cfg.keep,
        max_segments=cfg.max_segments,
        max_deleted_fraction=cfg.max_deleted_fraction,
        tiers=TieredMergePolicy() if cfg.merges == TIERED else None,
        catalog_rows=len(catalog),
        skipped=skipped,
        already_indexed=already,
        model_id=embedder.model_id,
    )
    return report.live_version


def add_vectors(
    index_root: str | Path,
    vectors: np.ndarray,
    items: ItemTable,
    *,
    upsert: bool = False,
    gate: GateThresholds | None = None,
    keep: int = 5,
    max_segments: int = MAX_SEGMENTS,
    max_deleted_fraction: float = MAX_DELETED_FRACTION,
    catalog_rows: int | None = None,
    skipped: dict[str, int] | None = None,
    already_indexed: int | None = None,
    model_id: str | None = None,
    compact: bool = True,
    tiers: TieredMergePolicy | None = None,
    opened: IndexVersion | None = None,
) -> ChangeReport:
    """Publish the live version of `index_root` + these rows (embedded already: `vectors`, row
    for row with `items`) as one new segment a shard they touch, and compact the shards then
    past `max_segments` or `max_deleted_fraction`. An id the live version holds is refused
    unless `upsert`, which tombstones its old row. `gate`: the add's gate on its new rows
    (none: not gated). `model_id`: the model that embedded them, which the live version must
    have been built with. `compact=False`: the caller compacts (a server, after the call's answer).
    `tiers`: the merges this policy has due run after, in a background process
    (`report.merge_pid`), instead of a whole shard's compaction before the return.
    `opened`: the live version, open already (a server's, whose id lookups are built: at 1M rows
    building them costs an add ~0.6 s), used only if CURRENT still names it.
    Writers of the root take their turns (`artifacts.writer_lock`): the
    live version is read, changed and published by this writer alone."""
    with artifacts.writer_lock(index_root):
        current = artifacts.current_version(index_root)
        usable = isinstance(opened, IndexVersion) and opened.name == current  # not a sharded ingress's view
        live = opened if usable else IndexVersion.open(index_root, current)
        vectors, replaced = _checked_rows(live, vectors, items, upsert, model_id)
        rows = RowCounts(
            catalog=catalog_rows if catalog_rows is not None else len(items),
            indexed=0,  # publish_change counts it: the new version's live_size
            skipped=skipped or {},
            added=len(items) - len(replaced),
            already_indexed=already_indexed,
            replaced=int(len(replaced)) if upsert else None,
        )
        verdict = None
        if gate is not None:
            verdict = lambda staged, new_rows: gate_change(  # noqa: E731
                staged, new_rows, gate.ann_k, gate.min_ann_recall, gate.force
            )[1]
        report = publish_change(
            index_root,
            live,
            unit_changes(live, replaced, unit_rows(vectors), items),
            keep,
            f"added {len(items)} items" + (f", replacing {len(replaced)}" if len(replaced) else ""),
            rows=rows,
            model_id=model_id,
            gate=verdict,
        )
    # After the lock is let go: a compaction takes the root only to publish.
    if compact and tiers is not None:
        merging = merge_after_change(index_root, keep, tiers)
        report.merge_pid = merging.pid if merging is not None else None
        return report
    compacted = compact_if_due(index_root, keep, max_segments, max_deleted_fraction) if compact else None
    if compacted is not None:
        report.compacted_to = compacted.version
    return report


def _checked_rows(
    live: IndexVersion, vectors: np.ndarray, items: ItemTable, upsert: bool, model_id: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """The new rows' vectors as float32, and the live rows their ids replace (sorted; an upsert's)
    — or the precise error: another model, a wrong shape, NaN, an id twice or already there
    without `upsert`, labels on some rows or unlike the version's."""
    if model_id is not None and live.manifest.model_id != model_id:
        raise ArtifactError(
            f"the new rows were embedded by model {model_id}; the live version {live.name} was built with model "
            f"{live.manifest.model_id} (it changed meanwhile)"
        )
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != live.manifest.dimension:
        raise ValueError(
            f"the new rows are vectors of shape {vectors.shape}; version {live.name} holds {live.manifest.dimension}-d "
            "vectors"
        )
    if len(vectors) != len(items) or not len(items):
        raise ValueError(f"{len(vectors)} vectors for {len(items)} items: one vector a row, at least one row")
    if not np.isfinite(vectors).all():
        raise ValueError("the new rows' vectors hold NaN or infinity")
    ids = list(items.ids)
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"item id {twice!r} comes twice among the new rows")
    held = [(item_id, row) for item_id, row in live.rows_of_ids(ids).items() if row is not None]
    if held and not upsert:
        raise ValueError(
            f"{len(held)} of the {len(ids)} new ids are already in version {live.name}, e.g. {held[0][0]!r}: "
            "pass upsert to replace them"
        )
    if not items.labelled and any(label is not None for label in items.labels):
        unlabelled = next(i for i, label in zip(items.ids, items.labels, strict=True) if label is None)
        raise ValueError(f"some new rows have labels and {unlabelled!r} has none: label all of them or none")
    if items.labelled != live.labelled and live.manifest.size:
        raise ValueError(
            f"the new rows {'have' if items.labelled else 'lack'} labels and version {live.name}'s "
            f"{'lack' if items.labelled else 'have'} them: a version's items are all labelled or none are"
        )
    return vectors, np.array(sorted(row for _, row in held), dtype=np.int64)


def _as_live(cfg: BuildConfig, live: IndexVersion) -> BuildConfig:
    """`cfg` with the live version's model (unless given), factory, search parameters,
    filterable fields and item field: what the rows it gains are indexed with."""
    declared = [str(spec) for spec in specs_of(live.manifest.filterable)]
    if cfg.filterable and parse_filterable(cfg.filterable) != parse_filterable(declared):
        log.warning("index add keeps the live version's filterable fields %s, not %s", declared, cfg.filterable)
    return dataclasses.replace(
        cfg,
        model=cfg.model or live_model_dir(live.manifest),
        factory=live.manifest.factory,
        search_params=live.manifest.search_params,
        nprobe=None,
        filterable=declared,
        item_field=live.manifest.item_field,
    )


def _check_labelled_alike(catalog: Catalog, live: IndexVersion) -> None:
    if catalog.labelled != live.labelled:
        has, lacks = (
            (catalog.source, f"version {live.manifest.version}")
            if catalog.labelled
            else (f"version {live.manifest.version}", catalog.source)
        )
        raise CatalogError(f"{has} has labels and {lacks} has none: a version's items are all labelled or none are")


def _rows_to_embed(cfg: BuildConfig, catalog: Catalog, live: IndexVersion) -> tuple[list[int], np.ndarray, int]:
    """The catalog rows to embed, the live rows their ids already hold (sorted), and how many
    catalog rows are skipped as already indexed (none with `upsert`, which replaces them)."""
    indexed_rows = live.live_rows(catalog.ids)
    replaced = np.sort(indexed_rows[indexed_rows >= 0])
    new_rows = list(range(len(catalog))) if cfg.upsert else np.flatnonzero(indexed_rows < 0).tolist()
    already = 0 if cfg.upsert else len(replaced)
    if not new_rows:
        raise ValueError(
            f"all {len(catalog)} rows of {cfg.catalog} are already in version {live.manifest.version} (by id: "
            f"the catalog's id column, or for a folder the image's path relative to it, e.g. {catalog.ids[0]!r}): "
            "pass --upsert to replace them with these images"
        )
    if already:
        log.warning(
            "%d of %d rows of %s are already in version %s and are skipped, e.g. %r (--upsert replaces them)",
            already, len(catalog), cfg.catalog, live.manifest.version, live.items.ids[int(replaced[0])],
        )  # fmt: skip
    return new_rows, replaced, already


def unit_changes(live: IndexVersion, replaced: np.ndarray, vectors: np.ndarray, added: ItemTable) -> list[UnitChange]:
    """What an add (or an upsert) changes in each unit of `live` — the version, or each shard:
    the `replaced` rows (global) leave, the `added` rows join the shard their item hashes to."""
    if not live.manifest.shards:
        return [UnitChange(removed=replaced, vectors=vectors, items=added)]
    units = live.units()
    placed = np.fromiter(
        (shard_of(key, len(units)) for key in shard_keys(added, live.manifest.item_field)), np.int64, len(added)
    )
    changes = []
    for unit in units:
        joining = np.flatnonzero(placed == unit.number)
        changes.append(
            UnitChange(
                removed=unit.own(replaced),
                vectors=vectors[joining],
                items=added.take(joining) if len(joining) else None,
            )
        )
    return changes


def live_model_dir(manifest: IndexManifest) -> str:
    """The model directory `manifest`'s version was built with, for `index add` without --model."""
    if manifest.model_dir is None or not Path(manifest.model_dir).is_dir():
        where = "records none" if manifest.model_dir is None else f"is {manifest.model_dir}, which no longer exists"
        raise ValueError(f"no --model given, and version {manifest.version}'s model directory {where}: pass --model")
    return manifest.model_dir
