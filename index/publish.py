"""Publishing an index version: the faiss index built (unless given), its search effort tuned,
the quality gate applied, and the version's files written, `neighbours.png` among them, and made
live atomically — the one publish path of `index build`, `add` and `rebuild`."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from core import artifacts
from core.artifacts import utc_now
from core.catalog import Catalog
from core.config import to_jsonable
from core.items import ItemTable
from core.manifests import IndexManifest, QualityGate, RowCounts
from index.config import BuildConfig
from index.contact_sheet import contact_sheet, sample_neighbours
from index.faiss_index import (
    build_index,
    save_index,
    search_effort,
    searchable,
    select_device,
    tune_search_effort,
    with_default_rerank,
)
from index.filters import FilterIndex, column_values, declared_json
from index.gate import QualityGateError, check_quality, describe_quality, quality_figures, sample_rows
from index.grouping import Groups
from index.lifecycle import warn_of_returning_items
from index.version import IndexVersion

log = logging.getLogger(__name__)


@dataclass
class NewVersion:
    """What `index build`, `add` and `rebuild` each hand to `publish_index_version`."""

    model_id: str
    embeddings: np.ndarray  # the exact vectors, row for row with `items`
    items: Catalog | ItemTable
    catalog: str | Path  # the catalog the rows came from
    rows: RowCounts
    started: float  # time.perf_counter() when the command started
    embed_seconds: float
    index: faiss.Index | None = None  # None: built from `embeddings` with the config's factory
    parent_version: str | None = None  # `index add`: the version it extends
    engine: dict | None = None  # `index rebuild`: what embedded the catalog
    deleted: np.ndarray | None = None  # rows removed but kept in the index (HNSW tombstones)

    @classmethod
    def of_catalog(
        cls,
        model_id: str,
        catalog_path: str | Path,
        catalog: Catalog,
        embeddings: np.ndarray,
        kept: list[int],
        skipped: dict[str, int],
        started: float,
        embed_seconds: float,
        engine: dict | None = None,
    ) -> NewVersion:
        """A whole catalog embedded (`embed_catalog`'s answer): its `kept` rows, `skipped` counted."""
        return cls(
            model_id=model_id,
            embeddings=embeddings,
            items=catalog.subset(kept),
            catalog=catalog_path,
            rows=RowCounts(catalog=len(catalog), indexed=len(kept), skipped=skipped),
            started=started,
            embed_seconds=embed_seconds,
            engine=engine,
        )


def publish_index_version(cfg: BuildConfig, new: NewVersion) -> Path:
    """Build the faiss index (unless given), gate it on quality, and publish a new version of
    `cfg.index_root`: the one publish path of build, add and rebuild; returns its directory."""
    device = select_device(cfg.device)
    gate = cfg.gate_thresholds
    embeddings = new.embeddings
    index = new.index
    if index is None:
        index = build_index(embeddings, cfg.factory, cfg.given_search_params, cfg.train_size, device)
    search_params = with_default_rerank(index, cfg.given_search_params)
    items = new.items
    labels = list(items.labels) if items.labelled else None
    paths = [str(Path(p).resolve()) for p in items.paths]
    table = ItemTable(ids=list(items.ids), labels=labels, paths=paths, metadata=list(items.metadata))
    # Built from the new version's own rows, whichever command made them (build, add, rebuild,
    # a removal's subset), so a version's structure always describes its rows.
    specs = cfg.filterable_fields
    filter_index = FilterIndex.build(table, specs) if specs else None
    searched = searchable(index, search_params, embeddings)
    effort = search_effort(index)
    tuning = None
    if effort is not None and effort[0] not in search_params:
        # Tuned on a sample of its own, so the gate's figure below is measured, not the tuning's.
        queries = embeddings[sample_rows(len(embeddings), gate.quality_sample, seed=1)]
        k = min(gate.ann_k, len(embeddings))
        tuning = tune_search_effort(searched, embeddings, queries, k, cfg.target_ann_recall)
        search_params = {**search_params, tuning.parameter: tuning.value}
        (log.info if tuning.reached else log.warning)("search effort: %s", tuning)
    item_groups = Groups.of(cfg.item_field, filter_index.fields[cfg.item_field], len(table)) if cfg.item_field else None
    quality = quality_figures(searched, embeddings, labels, gate, item_groups, cfg.probe)
    quality.search_tuning = tuning.to_dict() if tuning is not None else None
    log.info("quality: %s; search parameters %s", describe_quality(quality), search_params or "none")
    root = Path(cfg.index_root)
    live = IndexVersion.live(root)
    # A different model's recall is no baseline for this one.
    baseline = live.manifest if live is not None and live.manifest.model_id == new.model_id else None
    reasons = check_quality(quality, gate, baseline)
    if reasons and not gate.force:
        raise QualityGateError("quality gate refused to publish: " + "; ".join(reasons))

    if new.parent_version is None:  # a build from a whole catalog
        warn_of_returning_items(root, items.ids)
    deleted = new.deleted if new.deleted is not None else np.zeros(0, np.int64)
    staging = artifacts.index_staging_dir(root)
    try:
        save_index(index, staging / artifacts.INDEX_FILE)
        np.save(staging / artifacts.EMBEDDINGS_FILE, np.ascontiguousarray(embeddings, dtype=np.float32))
        if len(deleted):
            np.save(staging / artifacts.DELETED_FILE, np.asarray(deleted, dtype=np.int64))
        table.write(staging / artifacts.ITEMS_FILE)
        if filter_index is not None:
            filter_index.save(staging / artifacts.FILTERS_FILE)
        write_contact_sheet(staging / artifacts.NEIGHBOURS_FILE, searched, embeddings, table, cfg.item_field)
        index_id = artifacts.file_sha256(staging / artifacts.INDEX_FILE)[:16]
        version = artifacts.new_version_name(index_id)
        manifest = IndexManifest(
            index_id=index_id,
            version=version,
            model_id=new.model_id,
            model_dir=str(Path(cfg.model).resolve()),
            factory=cfg.factory,
            metric="inner_product",
            normalized=True,
            size=int(index.ntotal),
            dimension=int(index.d),
            search_params=search_params,
            built_on=device,
            build_seconds=time.perf_counter() - new.started,
            embed_seconds=new.embed_seconds,
            created=utc_now(),
            catalog=str(Path(new.catalog).resolve()),
            quality=quality,
            quality_gate=QualityGate(passed=not reasons, forced=bool(reasons), reasons=reasons),
            config=to_jsonable(cfg),
            parent_version=new.parent_version,
            engine=new.engine,
            deleted_rows=len(deleted),
            filterable=declared_json(specs),
            item_field=cfg.item_field,
        )
        manifest.rows = dataclasses.replace(new.rows, indexed=manifest.live_size)
        manifest.write(staging)
        target = artifacts.publish_version(root, staging, version, parent=new.parent_version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    artifacts.prune_versions(root, cfg.keep)
    masked = f", +{manifest.deleted_rows} removed, masked" if manifest.deleted_rows else ""
    log.info("published index %s (%d items%s) at %s", version, manifest.live_size, masked, target)
    return target


def write_contact_sheet(path: Path, index, embeddings: np.ndarray, table: ItemTable, item_field: str | None) -> None:
    """`neighbours.png`: a dozen catalog items querying the index, their top 8 framed green where
    they match the query: by the item field when the index has one (what grouped answers and
    item Recall@K count as a match; a class label is coarser), else by label, else grey."""
    labels = list(table.labels) if table.labelled else None
    if item_field is not None:
        keys: list[str | None] | None = list(column_values(item_field, labels or [], table.metadata))
    else:
        keys = labels
    picked, rows, scores = sample_neighbours(index, embeddings)
    query_keys = [keys[r] for r in picked] if keys is not None else None
    paths = list(table.paths)
    sheet = contact_sheet(
        [paths[r] for r in picked], query_keys, rows, scores, paths, keys, match=item_field or "label"
    )
    sheet.save(path)
