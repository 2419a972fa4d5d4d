"""A version built from a catalog's rows: stage → tune → gate → publish. The version's units are
staged from the recipe — one index (the one-unit case) or its shards — its search effort tuned,
its quality measured and gated on the staged version and `neighbours.png` drawn; its manifest is
written and the version made live by `index.versions.version_writer.publish_units`, the one
publish path that every add, removal, upsert, ingest and compaction takes too
(`index.versions.change`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from PIL import Image

from core.artifacts.index_manifest import IndexManifest, QualityGate, QualityReport, RowCounts, ShardEntry
from core.artifacts.layout import NEIGHBOURS_FILE
from core.data.catalog import Catalog
from core.data.items import ItemTable
from core.retrieval.metrics import stable_sample
from index.build.contact_sheet import contact_sheet, sample_neighbours
from index.build.gate import (
    GateThresholds,
    ProbeCatalog,
    QualityGateError,
    check_quality,
    describe_quality,
    quality_figures,
)
from index.search.ann_recall import EffortChoice, search_effort, tune_search_effort
from index.search.faiss_index import (
    apply_search_params,
    build_index,
    select_device,
    trained_index,
    with_default_rerank,
)
from index.search.faiss_search import ExactRerank, searchable
from index.search.filters import FieldSpec, FilterIndex, column_values, declared_json
from index.search.grouping import Groups
from index.versions.audit import warn_of_returning_items
from index.versions.sharding import ID_KEY, build_shards, check_shard_count, partition, shard_keys
from index.versions.version import IndexVersion
from index.versions.version_writer import StagedUnits, VersionWriter, publish_units

log = logging.getLogger(__name__)


@dataclass
class NewVersion:
    """What `index build` and `rebuild` each hand to `publish_index_version`."""

    model_id: str
    embeddings: np.ndarray  # the exact vectors, row for row with `items`
    items: Catalog | ItemTable
    catalog: str | Path  # the catalog the rows came from
    rows: RowCounts
    started: float  # time.perf_counter() when the command started
    embed_seconds: float
    engine: dict | None = None  # `index rebuild`: what embedded the catalog
    # A sharded `index rebuild`: what builds and writes the shards (on Ray Data, from the
    # embedding files) given the writer, recipe, device and fields; `embeddings` is then empty.
    shard_builder: Callable[[VersionWriter, IndexRecipe, str, list[FieldSpec]], list[ShardEntry]] | None = None

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


@dataclass(frozen=True)
class IndexRecipe:
    """How the index is built and how hard it is searched."""

    factory: str
    search_params: dict[str, float]  # as the user gave them (--search-params, --nprobe over its nprobe)
    train_size: int | None  # vectors sampled to train IVF/PQ (None: all)
    device: str  # where faiss builds: auto, cpu or gpu
    target_ann_recall: float  # a search effort not given is raised until ANN recall reaches this
    shards: int = 1  # > 1: a sharded version (index.versions.sharding), trained once, its shards added on Ray


@dataclass(frozen=True)
class PublishTarget:
    """Where a version is published, how many are kept, and what its manifest records of the
    command that made it."""

    index_root: str | Path
    keep: int
    model_dir: str
    config: dict  # the command's resolved configuration, as the manifest records it
    text_model_dir: str | None = None  # the text model sharing the model's space, checked
    text_model_id: str | None = None


def publish_index_version(
    new: NewVersion,
    recipe: IndexRecipe,
    gate: GateThresholds,
    probe: ProbeCatalog | None,
    filterable: list[FieldSpec],
    item_field: str | None,
    target: PublishTarget,
) -> Path:
    """A new version of `target.index_root` from `new`'s rows: its units staged — one index
    (the one-unit case), or `recipe.shards` shards — then its search effort tuned and its
    quality measured and gated on the staged version, and its manifest written and published
    through `publish_units`, as every change's is; returns its directory."""
    device = select_device(recipe.device)
    sharded = recipe.shards > 1
    # One index is trained and filled before the root is taken; shards are, in the staging folder.
    index = None if sharded else build_index(new.embeddings, recipe.factory, recipe.search_params,
                                             recipe.train_size, device)  # fmt: skip
    with VersionWriter(target.index_root, target.keep) as writer:
        if sharded:
            units = _stage_shards(writer, new, recipe, device, filterable, item_field)
        else:
            units = _stage_rows(writer, new, filterable)
        measure = functools.partial(_measure, recipe=recipe, gate=gate, probe=probe, target=target, writer=writer,
                                    started=new.started, built=index)  # fmt: skip
        described = _described(new, recipe, device, filterable, item_field, target)
        published, manifest = publish_units(writer, units, described, new.rows, measure=measure)
    if sharded:
        log.info("published index %s (%d items in %d shards) at %s", manifest.version, manifest.live_size,
                 len(units.shards or []), published)  # fmt: skip
    else:
        log.info("published index %s (%d items) at %s", manifest.version, manifest.live_size, published)
    # Where to look first: the sheet says at a glance whether neighbours make sense.
    log.info("sample queries and their neighbours: %s", published / NEIGHBOURS_FILE)
    return published


def _stage_rows(writer: VersionWriter, new: NewVersion, filterable: list[FieldSpec]) -> StagedUnits:
    """A version of one index: its row files at the staging folder's top level, its filters built
    from its own rows — its index file written once its search effort is tuned (`_measure`)."""
    table, _ = version_table(new.items)
    writer.write_vectors(new.embeddings)
    writer.write_items(table)
    writer.write_filters(FilterIndex.build(table, filterable) if filterable else None)
    return StagedUnits(size=len(table))


def _stage_shards(
    writer: VersionWriter,
    new: NewVersion,
    recipe: IndexRecipe,
    device: str,
    filterable: list[FieldSpec],
    item_field: str | None,
) -> StagedUnits:
    """A sharded version's shards written into the staging folder: built on Ray from the trained
    empty index (or by `new.shard_builder`, a rebuild's, on Ray Data from its embedding files)."""
    if new.shard_builder is not None:
        entries = new.shard_builder(writer, recipe, device, list(filterable))
    else:
        table, _ = version_table(new.items)
        check_shard_count(recipe.shards, len(table))
        parts = partition(shard_keys(table, item_field), recipe.shards)
        started = time.perf_counter()
        trained = trained_index(new.embeddings, recipe.factory, recipe.train_size, device)
        if recipe.search_params:  # HNSW's efConstruction shapes each shard's graph as its rows go in
            apply_search_params(trained, recipe.search_params)
        trained_at = time.perf_counter()
        entries = build_shards(writer, trained, new.embeddings, table, parts, filterable)
        log.info(
            "%d shards (%s rows): trained once in %.1f s, added in parallel in %.1f s",
            len(entries), "/".join(str(e.rows) for e in entries), trained_at - started,
            time.perf_counter() - trained_at,
        )  # fmt: skip
    return StagedUnits.of_shards(entries, item_field or ID_KEY)


def _measure(
    folder: Path,
    manifest: IndexManifest,
    recipe: IndexRecipe,
    gate: GateThresholds,
    probe: ProbeCatalog | None,
    target: PublishTarget,
    writer: VersionWriter,
    started: float,
    built: faiss.Index | None,
) -> dict[str, Any]:
    """The staged version's search effort tuned, its quality figures measured and the gate
    applied (QualityGateError when it refuses), its contact sheet drawn: what its manifest
    records of them. Both samples (the tuning's and the gate's) are chosen by the rows' ids,
    not their order. A sharded version is measured on its shards' merged search; one index
    (`built`) as built, and written once tuned (its file keeps the search effort tuned)."""
    staged = IndexVersion(folder, manifest)
    index = built if built is not None else staged.read_index()
    embeddings, table, item_field = staged.vectors, staged.items, manifest.item_field
    labels = list(table.labels) if table.labelled else None
    searched, search_params, tuning = _tune(index, embeddings, table.ids, recipe, gate)
    filters = staged.filters
    item_groups = Groups.of(item_field, filters.fields[item_field], len(table)) if item_field and filters else None
    quality = quality_figures(searched, embeddings, table.ids, labels, gate, item_groups, probe)
    quality.search_tuning = tuning.to_dict() if tuning is not None else None
    log.info("quality: %s; search parameters %s", describe_quality(quality), search_params or "none")
    quality_gate = _gate(quality, gate, target.index_root, manifest.model_id)
    if built is not None:
        writer.write_index(built)
    warn_of_returning_items(target.index_root, table.ids)  # a build from a catalog
    writer.write_contact_sheet(draw_contact_sheet(searched, embeddings, table, item_field))
    return {
        "search_params": search_params,
        "quality": quality,
        "quality_gate": quality_gate,
        "build_seconds": time.perf_counter() - started,
    }


def _described(
    new: NewVersion,
    recipe: IndexRecipe,
    device: str,
    filterable: list[FieldSpec],
    item_field: str | None,
    target: PublishTarget,
) -> IndexManifest:
    """What the new version's manifest says of its model, recipe, catalog and command (its
    names, units, figures and rows are `publish_units`' to set)."""
    return IndexManifest(
        index_id="",
        version="",
        model_id=new.model_id,
        model_dir=str(Path(target.model_dir).resolve()),
        factory=recipe.factory,
        metric="inner_product",
        normalized=True,
        size=0,
        dimension=int(new.embeddings.shape[1]),
        search_params=dict(recipe.search_params),
        built_on=device,
        embed_seconds=new.embed_seconds,
        catalog=str(Path(new.catalog).resolve()),
        config=target.config,
        engine=new.engine,
        filterable=declared_json(filterable),
        item_field=item_field,
        text_model_id=target.text_model_id,
        text_model_dir=target.text_model_dir,
    )


def version_table(items: Catalog | ItemTable) -> tuple[ItemTable, list[str] | None]:
    """The new version's items table (paths made absolute), and its labels (None: unlabelled)."""
    labels = list(items.labels) if items.labelled else None
    paths = [str(Path(p).resolve()) for p in items.paths]
    return ItemTable(ids=list(items.ids), labels=labels, paths=paths, metadata=list(items.metadata)), labels


def _tune(
    index: faiss.Index, embeddings: np.ndarray, ids: list[str], recipe: IndexRecipe, gate: GateThresholds
) -> tuple[faiss.Index | ExactRerank, dict[str, float], EffortChoice | None]:
    """The index as searched, its search parameters (a search effort the recipe does not give
    raised until ANN recall reaches its target) and what the tuning measured (None: not tuned)."""
    search_params = with_default_rerank(index, recipe.search_params)
    searched = searchable(index, search_params, embeddings)
    effort = search_effort(index)
    tuning = None
    if effort is not None and effort[0] not in search_params:
        # Tuned on a sample of its own, so the gate's figure below is measured, not the tuning's.
        queries = embeddings[stable_sample(ids, gate.quality_sample, seed=1)]
        k = min(gate.ann_k, len(embeddings))
        tuning = tune_search_effort(searched, embeddings, queries, k, recipe.target_ann_recall)
        search_params = {**search_params, tuning.parameter: tuning.value}
        (log.info if tuning.reached else log.warning)("search effort: %s", tuning)
    return searched, search_params, tuning


def _gate(quality: QualityReport, gate: GateThresholds, index_root: str | Path, model_id: str) -> QualityGate:
    """The gate's verdict on `quality`, with why it refuses; QualityGateError unless forced."""
    live = IndexVersion.live(Path(index_root))
    # A different model's recall is no baseline for this one.
    baseline = live.manifest if live is not None and live.manifest.model_id == model_id else None
    reasons = check_quality(quality, gate, baseline)
    if reasons and not gate.force:
        raise QualityGateError("quality gate refused to publish: " + "; ".join(reasons))
    return QualityGate(passed=not reasons, forced=bool(reasons), reasons=reasons)


def draw_contact_sheet(
    index: faiss.Index | ExactRerank, embeddings: np.ndarray, table: ItemTable, item_field: str | None
) -> Image.Image:
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
    return contact_sheet([paths[r] for r in picked], query_keys, rows, scores, paths, keys, match=item_field or "label")
