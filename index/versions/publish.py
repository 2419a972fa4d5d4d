"""Publishing an index version: build → tune → gate → write. The faiss index is built (unless
given) from the recipe, its search effort tuned, the quality gate applied, and the version's
files, `neighbours.png` among them, written and made live atomically through the one writer
(`index.versions.version_writer`) — the one publish path of `index build`, `add` and `rebuild`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
from PIL import Image

from core.artifacts import utc_now
from core.catalog import Catalog
from core.index_manifest import IndexManifest, QualityGate, QualityReport, RowCounts, ShardEntry
from core.items import ItemTable
from core.metrics import stable_sample
from index.build.contact_sheet import contact_sheet, sample_neighbours
from index.build.gate import (
    GateThresholds,
    ProbeCatalog,
    QualityGateError,
    check_quality,
    describe_quality,
    quality_figures,
)
from index.build.lifecycle import warn_of_returning_items
from index.search.ann_recall import EffortChoice, search_effort, tune_search_effort
from index.search.faiss_index import build_index, select_device, trained_index, with_default_rerank
from index.search.faiss_search import ExactRerank, searchable
from index.search.filters import FieldSpec, FilterIndex, column_values, declared_json
from index.search.grouping import Groups
from index.versions.sharding import (
    ID_KEY,
    ShardPart,
    build_shards,
    check_shard_count,
    partition,
    shard_keys,
    write_parts,
)
from index.versions.version import IndexVersion
from index.versions.version_writer import VersionWriter

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
    index: faiss.Index | None = None  # None: built from `embeddings` with the recipe's factory
    parent_version: str | None = None  # `index add`: the version it extends
    engine: dict | None = None  # `index rebuild`: what embedded the catalog
    deleted: np.ndarray | None = None  # rows removed but kept in the index (HNSW tombstones)
    # `index add` to a sharded version: each shard's new rows, or its parent folder where unchanged.
    shard_parts: list[ShardPart] | None = None
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
    """Build the faiss index (unless given), tune its search effort, gate it on quality, and
    write and publish a new version of `target.index_root`: the one publish path of build, add
    and rebuild; returns its directory."""
    device = select_device(recipe.device)
    if recipe.shards > 1 or new.shard_parts is not None:
        return _publish_sharded(new, recipe, device, gate, probe, filterable, item_field, target)
    index = new.index
    if index is None:
        index = build_index(new.embeddings, recipe.factory, recipe.search_params, recipe.train_size, device)
    table, labels = version_table(new.items)
    # Built from the new version's own rows, whichever command made them (build, add, rebuild,
    # a removal's subset), so a version's structure always describes its rows.
    filter_index = FilterIndex.build(table, filterable) if filterable else None
    searched, search_params, quality, quality_gate = _measure(
        index, new.embeddings, table.ids, labels, filter_index, recipe, gate, probe, item_field, target, new.model_id
    )

    if new.parent_version is None:  # a build from a whole catalog
        warn_of_returning_items(target.index_root, table.ids)
    deleted = new.deleted if new.deleted is not None else np.zeros(0, np.int64)
    with VersionWriter(target.index_root, target.keep) as writer:
        writer.write_index(index)
        writer.write_vectors(new.embeddings)
        writer.write_deleted(deleted)
        writer.write_items(table)
        writer.write_filters(filter_index)
        writer.write_contact_sheet(draw_contact_sheet(searched, new.embeddings, table, item_field))
        manifest = _manifest(
            new,
            writer.name_version(),
            index,
            recipe.factory,
            device,
            search_params,
            quality,
            quality_gate,
            len(deleted),
            filterable,
            item_field,
            target,
        )
        published = writer.publish(manifest, parent=new.parent_version)
    masked = f", +{manifest.deleted_rows} removed, masked" if manifest.deleted_rows else ""
    log.info("published index %s (%d items%s) at %s", manifest.version, manifest.live_size, masked, published)
    return published


def _measure(
    index: faiss.Index,
    embeddings: np.ndarray,
    ids: list[str],
    labels: list[str] | None,
    filter_index: FilterIndex | None,
    recipe: IndexRecipe,
    gate: GateThresholds,
    probe: ProbeCatalog | None,
    item_field: str | None,
    target: PublishTarget,
    model_id: str,
) -> tuple[faiss.Index | ExactRerank, dict[str, float], QualityReport, QualityGate]:
    """Tune the search effort, measure the quality figures and apply the gate (QualityGateError
    when it refuses): the index as searched, its search parameters, figures and verdict. Both
    samples (the tuning's and the gate's) are chosen by the rows' `ids`, not their order."""
    searched, search_params, tuning = _tune(index, embeddings, ids, recipe, gate)
    rows = len(ids)
    item_groups = Groups.of(item_field, filter_index.fields[item_field], rows) if item_field and filter_index else None
    quality = quality_figures(searched, embeddings, ids, labels, gate, item_groups, probe)
    quality.search_tuning = tuning.to_dict() if tuning is not None else None
    log.info("quality: %s; search parameters %s", describe_quality(quality), search_params or "none")
    return searched, search_params, quality, _gate(quality, gate, target.index_root, model_id)


def _publish_sharded(
    new: NewVersion,
    recipe: IndexRecipe,
    device: str,
    gate: GateThresholds,
    probe: ProbeCatalog | None,
    filterable: list[FieldSpec],
    item_field: str | None,
    target: PublishTarget,
) -> Path:
    """A sharded version: its shards written into the staging folder (built on Ray from the
    trained empty index, or, for `index add`, the parts given), then tuned, gated and measured
    on their merged search, as one index is — and published by one rename."""
    with VersionWriter(target.index_root, target.keep) as writer:
        if new.shard_parts is not None:
            entries = write_parts(writer, new.shard_parts, filterable)
        elif new.shard_builder is not None:
            entries = new.shard_builder(writer, recipe, device, list(filterable))
        else:
            table, _ = version_table(new.items)
            check_shard_count(recipe.shards, len(table))
            parts = partition(shard_keys(table, item_field), recipe.shards)
            started = time.perf_counter()
            trained = trained_index(new.embeddings, recipe.factory, recipe.train_size, device)
            trained_at = time.perf_counter()
            entries = build_shards(writer, trained, new.embeddings, table, parts, filterable)
            log.info(
                "%d shards (%s rows): trained once in %.1f s, added in parallel in %.1f s",
                len(entries), "/".join(str(e.rows) for e in entries), trained_at - started,
                time.perf_counter() - trained_at,
            )  # fmt: skip
        staged = IndexVersion(
            writer.staging,
            IndexManifest(
                index_id="staging",
                version=writer.staging.name,
                model_id=new.model_id,
                size=sum(entry.rows for entry in entries),
                dimension=int(new.embeddings.shape[1]),
                factory=recipe.factory,
                search_params=dict(recipe.search_params),
                deleted_rows=sum(entry.deleted_rows for entry in entries),
                filterable=declared_json(filterable),
                item_field=item_field,
                shards=entries,
            ),
        )
        index, embeddings, table = staged.read_index(), staged.vectors, staged.items
        labels = list(table.labels) if table.labelled else None
        searched, search_params, quality, quality_gate = _measure(
            index, embeddings, table.ids, labels, staged.filters, recipe, gate, probe, item_field, target,
            new.model_id,
        )  # fmt: skip
        if new.parent_version is None:
            warn_of_returning_items(target.index_root, table.ids)
        writer.write_contact_sheet(draw_contact_sheet(searched, embeddings, table, item_field))
        manifest = _manifest(
            new,
            writer.name_version(shards=entries),
            index,
            recipe.factory,
            device,
            search_params,
            quality,
            quality_gate,
            staged.manifest.deleted_rows,
            filterable,
            item_field,
            target,
        )
        manifest.shards, manifest.shard_key = entries, item_field or ID_KEY
        published = writer.publish(manifest, parent=new.parent_version)
    log.info("published index %s (%d items in %d shards) at %s", manifest.version, manifest.live_size,
             len(entries), published)  # fmt: skip
    return published


def _manifest(
    new: NewVersion,
    names: tuple[str, str],
    index: faiss.Index,
    factory: str,
    device: str,
    search_params: dict[str, float],
    quality: QualityReport,
    quality_gate: QualityGate,
    deleted_rows: int,
    filterable: list[FieldSpec],
    item_field: str | None,
    target: PublishTarget,
) -> IndexManifest:
    """The new version's manifest; `names`: its index id and version name (the writer's)."""
    index_id, version = names
    manifest = IndexManifest(
        index_id=index_id,
        version=version,
        model_id=new.model_id,
        model_dir=str(Path(target.model_dir).resolve()),
        factory=factory,
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
        quality_gate=quality_gate,
        config=target.config,
        parent_version=new.parent_version,
        engine=new.engine,
        deleted_rows=deleted_rows,
        filterable=declared_json(filterable),
        item_field=item_field,
        text_model_id=target.text_model_id,
        text_model_dir=target.text_model_dir,
    )
    manifest.rows = dataclasses.replace(new.rows, indexed=manifest.live_size)
    return manifest


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
