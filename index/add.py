"""`index add`: a new version = the live one + the catalog rows it lacks (or, with --upsert,
replacing the rows it has), embedding only those."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from core.catalog import Catalog, CatalogError, read_catalog
from core.items import ItemTable
from core.manifests import IndexManifest, RowCounts, check_model_index_pair
from index.config import BuildConfig
from index.embed import check_bad_rows, embed_catalog
from index.embedder import OnnxEmbedder
from index.faiss_index import l2_normalized
from index.filters import parse_filterable, specs_of
from index.lifecycle import drop_rows
from index.publish import NewVersion
from index.sharding import ShardPart, ShardRows, shard_keys, shard_of
from index.version import IndexVersion

log = logging.getLogger(__name__)


def run_add(cfg: BuildConfig, progress: bool = True) -> Path:
    """Publish a new version = the live one + the catalog rows it lacks, embedding only those.

    Existing vectors are reused byte for byte (from the live version's embeddings.npy) and the
    live faiss index is extended in place of a rebuild, so IVF/PQ keep their trained quantisers.
    Rows whose id is already indexed are skipped and counted, not re-embedded — or, with
    `upsert`, replace the indexed ones: those leave the live version as a removal does
    (`index.lifecycle.drop_rows`) and come back at the end with their new vector and metadata.
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
    cfg.check_catalog(catalog, trains_index=False)  # the live index is trained already
    _check_labelled_alike(catalog, live)
    new_rows, replaced, already = _rows_to_embed(cfg, catalog, live)
    fresh = catalog.subset(new_rows)
    vectors, kept, skipped = embed_catalog(
        fresh, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, progress
    )
    check_bad_rows(len(fresh), len(kept), skipped, cfg.max_bad_fraction)
    added = fresh.subset(kept)
    if cfg.upsert and len(replaced):
        # A row that failed to embed keeps its old vector rather than vanishing.
        rows_now = (live.row_of(i) for i in added.ids)
        replaced = np.array(sorted(r for r in rows_now if r is not None), dtype=np.int64)
    added_items = ItemTable(
        ids=added.ids, labels=added.labels, paths=[str(p.resolve()) for p in added.paths], metadata=added.metadata
    )
    if not cfg.upsert:
        replaced = replaced[:0]
    rows = RowCounts(
        catalog=len(catalog),
        indexed=0,  # publish_index_version counts it: the new version's live_size
        skipped=skipped,
        added=len(kept) - len(replaced) if cfg.upsert else len(kept),
        already_indexed=already,
        replaced=int(len(replaced)) if cfg.upsert else None,
    )
    new = NewVersion(
        model_id=embedder.model_id,
        embeddings=vectors,
        items=added_items,
        catalog=cfg.catalog,
        rows=rows,
        started=started,
        embed_seconds=time.perf_counter() - started,
        parent_version=live.manifest.version,
    )
    return cfg.publish(_extended(live, replaced, new))


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
    if catalog.labelled != live.items.labelled:
        has, lacks = (
            (catalog.source, f"version {live.manifest.version}")
            if catalog.labelled
            else (f"version {live.manifest.version}", catalog.source)
        )
        raise CatalogError(f"{has} has labels and {lacks} has none: a version's items are all labelled or none are")


def _rows_to_embed(cfg: BuildConfig, catalog: Catalog, live: IndexVersion) -> tuple[list[int], np.ndarray, int]:
    """The catalog rows to embed, the live rows their ids already hold (sorted), and how many
    catalog rows are skipped as already indexed (none with `upsert`, which replaces them)."""
    indexed_rows = [live.row_of(item_id) for item_id in catalog.ids]
    replaced = np.array(sorted(r for r in indexed_rows if r is not None), dtype=np.int64)
    new_rows = [r for r, row in enumerate(indexed_rows) if row is None or cfg.upsert]
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


def _extended(live: IndexVersion, replaced: np.ndarray, added: NewVersion) -> NewVersion:
    """`added` (the new rows alone) as the whole new version: the live one less its `replaced`
    rows plus these — a sharded version rebuilds only the shards they touch, an unsharded one
    extends the live index."""
    if live.manifest.shards:
        return dataclasses.replace(
            added, shard_parts=add_to_shards(live, replaced, added.embeddings, added.items)
        )  # embeddings: the rows added; the shards hold the rest
    base = drop_rows(live, replaced) if len(replaced) else None
    index = base.index if base is not None and base.index is not None else live.read_index()
    old_vectors = base.vectors if base is not None else live.vectors
    old_items = base.items if base is not None else live.items
    index.add(l2_normalized(added.embeddings))
    return dataclasses.replace(
        added,
        embeddings=np.concatenate([old_vectors, added.embeddings]),
        items=old_items.concat(added.items),
        index=index,
        deleted=base.deleted if base is not None else live.deleted,
    )


def add_to_shards(live: IndexVersion, replaced: np.ndarray, vectors: np.ndarray, added: ItemTable) -> list[ShardPart]:
    """A sharded `live`'s shards once `replaced` (global rows) leave and the `added` rows join
    the shard their item hashes to: only the shards they touch are rebuilt (their indexes
    extended, so IVF/PQ keep the shared quantizer); the others are linked unchanged."""
    entries = live.manifest.shards or []
    placed = np.fromiter(
        (shard_of(key, len(entries)) for key in shard_keys(added, live.manifest.item_field)), np.int64, len(added)
    )
    parts = []
    for number, (entry, offset) in enumerate(zip(entries, live.shard_offsets, strict=True)):
        shard = live.shard(number)
        local = replaced[(replaced >= offset) & (replaced < offset + entry.rows)] - offset
        joining = np.flatnonzero(placed == number)
        if not len(local) and not len(joining):
            parts.append(ShardPart(None, shard.directory, entry))
            continue
        base = drop_rows(shard, local) if len(local) else None
        index = base.index if base is not None and base.index is not None else shard.read_index()
        index.add(l2_normalized(vectors[joining]))
        old_vectors = base.vectors if base is not None else shard.vectors
        old_items = base.items if base is not None else shard.items
        parts.append(
            ShardPart(
                ShardRows(
                    index,
                    np.concatenate([old_vectors, vectors[joining]]),
                    old_items.concat(added.take(joining)),
                    base.deleted if base is not None else shard.deleted,
                )
            )
        )
    return parts


def live_model_dir(manifest: IndexManifest) -> str:
    """The model directory `manifest`'s version was built with, for `index add` without --model."""
    if manifest.model_dir is None or not Path(manifest.model_dir).is_dir():
        where = "records none" if manifest.model_dir is None else f"is {manifest.model_dir}, which no longer exists"
        raise ValueError(f"no --model given, and version {manifest.version}'s model directory {where}: pass --model")
    return manifest.model_dir
