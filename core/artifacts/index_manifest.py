"""An index version's manifest: its rows (counts, shards, segments), its search parameters, and
the quality report and gate a build wrote into it; and the check that an index is searched by
the model that embedded it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from core.artifacts.layout import ArtifactError
from core.artifacts.manifests import NUMBER, SCHEMA_KEY, SCHEMA_VERSION, Manifest, ManifestFields, without_none
from core.artifacts.model_manifests import ModelManifest

# A sharded index version's manifest (its rows in shards/, no index.faiss beside it): a reader
# from before shards reads versions 1 to 1, so it refuses one by this field, naming it, rather
# than failing to find the index file. A version of one index still writes 1, byte for byte.
SHARDED_SCHEMA_VERSION = 2
# A version whose rows lie in immutable segments (`segments`, at the version or in each shard):
# older readers refuse it by this field rather than find no index file.
SEGMENTED_SCHEMA_VERSION = 3


@dataclass
class QualityReport:
    """The `quality` section of an index manifest: figures measured before publishing.

    `ann_recall_at_k`: overlap of the index's top `ann_k` with exact search on a sample;
    `probe_recall_at_k` (by str(k)): Recall@K of probe queries, from `probe_source`; over
    `probe_queries` queries, each figure's 95% Wilson interval in `probe_interval_at_k` ([low,
    high]; absent from manifests written before it was measured);
    `exact_recall_at_k`: Recall@K of exact search over the whole catalog (small catalogs only);
    `search_tuning`: how the build chose a search effort it was not given (nprobe, efSearch): the
    parameter, the value, the recall target and the recall of every value tried."""

    sample_size: int
    ann_k: int
    ann_recall_at_k: float
    labelled: bool = True
    probe_source: str | None = None
    probe_recall_at_k: dict[str, float] | None = None
    exact_recall_at_k: dict[str, float] | None = None
    search_tuning: dict[str, Any] | None = None
    # The same sample's item-level Recall@K, where the catalog has items: its item among the top K
    # items (grouped search), the query's own row left out.
    item_recall_at_k: dict[str, float] | None = None
    probe_queries: int | None = None
    probe_interval_at_k: dict[str, list[float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    _OPTIONAL: ClassVar[tuple[str, ...]] = (
        "probe_source", "probe_recall_at_k", "exact_recall_at_k", "search_tuning", "item_recall_at_k",
        "probe_queries", "probe_interval_at_k",
    )  # fmt: skip

    @property
    def probe_recall_at_1(self) -> float | None:
        return (self.probe_recall_at_k or {}).get("1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | Path = "quality report") -> QualityReport:
        return cls._parse(ManifestFields(data, str(source), "quality"))

    @classmethod
    def _parse(cls, fields: ManifestFields) -> QualityReport:
        return cls(
            sample_size=fields.get("sample_size", int),
            ann_k=fields.get("ann_k", int),
            ann_recall_at_k=float(fields.get("ann_recall_at_k", NUMBER)),
            labelled=fields.get("labelled", bool, required=False, default=True),
            probe_source=fields.get("probe_source", str, required=False),
            probe_recall_at_k=_figures(fields, "probe_recall_at_k"),
            exact_recall_at_k=_figures(fields, "exact_recall_at_k"),
            search_tuning=fields.get("search_tuning", dict, required=False),
            item_recall_at_k=_figures(fields, "item_recall_at_k"),
            probe_queries=fields.get("probe_queries", int, required=False),
            probe_interval_at_k=_intervals(fields, "probe_interval_at_k"),
            extra=fields.rest(),
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **without_none(d, self._OPTIONAL)}


def _figures(fields: ManifestFields, name: str) -> dict[str, float] | None:
    section = fields.section_of(name, required=False)
    if section is None:
        return None
    return {k: float(section.get(k, NUMBER)) for k in section.data}


def _intervals(fields: ManifestFields, name: str) -> dict[str, list[float]] | None:
    """A section of [low, high] pairs by str(k)."""
    section = fields.section_of(name, required=False)
    if section is None:
        return None
    intervals = {}
    for k in section.data:
        pair = section.get(k, list)
        if len(pair) != 2 or not all(isinstance(v, NUMBER) and not isinstance(v, bool) for v in pair):
            raise ArtifactError(f"{section.source}: field '{section.section}.{k}' must be [low, high], got {pair!r}")
        intervals[k] = [float(v) for v in pair]
    return intervals


@dataclass
class QualityGate:
    """Whether a version passed the quality gate, and if not, why it was published anyway."""

    passed: bool
    forced: bool = False
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "forced": self.forced, "reasons": list(self.reasons)}


@dataclass
class RowCounts:
    """Catalog rows of a build: read, indexed, skipped by reason; for `index add`, also the rows
    it added and those it found already indexed."""

    catalog: int
    indexed: int
    skipped: dict[str, int] = field(default_factory=dict)
    added: int | None = None
    already_indexed: int | None = None
    replaced: int | None = None  # `index add --upsert`: indexed rows given a new vector

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("added", "already_indexed", "replaced")

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict[str, Any]:
        return without_none(dataclasses.asdict(self), self._OPTIONAL)


@dataclass
class ShardEntry:
    """One shard of a sharded index version (`versions/<v>/shards/<name>/`): its rows (deleted
    ones included), tombstones, first global row, and the sha256 of each of its files."""

    name: str  # "000", "001", ...: its folder under shards/
    rows: int
    deleted_rows: int
    row_offset: int  # global row = row_offset + the shard's own row
    files: dict[str, str]  # file name → sha256 (a segmented shard's: its tombstones and trained index)
    segments: list[SegmentEntry] | None = None  # a segmented shard's, in row order

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.segments is None:
            del d["segments"]
        return d


@dataclass
class SegmentEntry:
    """One immutable segment of a version (or of a shard): `segments/<name>/` holding its own
    index, vectors, items and filters, shared by hard link between the versions that keep it.
    Its rows are the version's `row_offset` … `row_offset + rows - 1`; which of them are deleted
    is the version's (or shard's) `deleted.npy`, never the segment's."""

    name: str
    rows: int
    row_offset: int
    files: dict[str, str]  # file name → sha256

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _shard_entry(data: Any, source: str, number: int) -> ShardEntry:
    fields = ManifestFields(data, source, f"shards[{number}]")
    files = fields.section_of("files") or ManifestFields({}, source)  # required: section_of raises when missing
    return ShardEntry(
        name=fields.get("name", str),
        rows=fields.get("rows", int),
        deleted_rows=fields.get("deleted_rows", int, required=False, default=0),
        row_offset=fields.get("row_offset", int),
        files={name: files.get(name, str) for name in files.data},
        segments=_segment_entries(fields, f"shards[{number}].segments"),
    )


def _segment_entries(fields: ManifestFields, where: str = "segments") -> list[SegmentEntry] | None:
    entries = fields.get("segments", list, required=False)
    if entries is None:
        return None
    if not entries:
        raise ArtifactError(f"{fields.source}: field {where!r} lists no segment")
    found = []
    for number, data in enumerate(entries):
        entry = ManifestFields(data, fields.source, f"{where}[{number}]")
        files = entry.section_of("files") or ManifestFields({}, fields.source)
        found.append(
            SegmentEntry(
                name=entry.get("name", str),
                rows=entry.get("rows", int),
                row_offset=entry.get("row_offset", int),
                files={name: files.get(name, str) for name in files.data},
            )
        )
    return found


MAX_ANCESTORS = 64  # a server that falls further behind a stream than this reloads as for a rebuild


def _ancestors(fields: ManifestFields) -> list[str] | None:
    names = fields.get("ancestors", list, required=False)
    if names is not None and not all(isinstance(name, str) for name in names):
        raise ArtifactError(f"{fields.source}: field 'ancestors' must be a list of version names, got {names!r}")
    return names


@dataclass
class IndexManifest(Manifest):
    """`manifest.json` of an index version (index/versions/version_writer.py writes it for every version);
    a field without a value (None) is not written."""

    index_id: str
    version: str
    model_id: str
    size: int  # rows in the index (faiss ntotal), deleted ones included: see `live_size`
    dimension: int
    factory: str
    search_params: dict[str, float] = field(default_factory=dict)
    model_dir: str | None = None
    metric: str = "inner_product"
    normalized: bool = True
    built_on: str | None = None
    build_seconds: float | None = None
    embed_seconds: float | None = None
    created: str | None = None
    catalog: str | None = None
    rows: RowCounts | None = None
    quality: QualityReport | None = None
    quality_gate: QualityGate | None = None
    config: dict[str, Any] = field(default_factory=dict)
    parent_version: str | None = None  # `index add`, `remove`: the version it was made from
    # The versions it descends from by changes alone, nearest first (at most MAX_ANCESTORS): a
    # server that skipped versions pruned since still sees that it grew from the one it served.
    ancestors: list[str] | None = None
    deleted_rows: int = 0  # rows removed but still in the index (HNSW tombstones, deleted.npy)
    engine: dict[str, Any] | None = None  # `index rebuild`: what embedded the catalog
    filterable: dict[str, str] = field(default_factory=dict)  # field → string|int|float (filters.npz)
    item_field: str | None = None  # the filterable field naming each row's item: what answers group by
    # A sharded version (`index build --shards S`, S > 1): its shards in order; None: one index.
    shards: list[ShardEntry] | None = None
    shard_key: str | None = None  # what placed a row: "id", or the item field
    # A segmented version of one index: its segments in row order (a sharded one's are its shards').
    segments: list[SegmentEntry] | None = None
    # The text model sharing the image model's space (`index build --text-model`): what answers
    # a query's text. None: this version answers images, vectors and ids only.
    text_model_id: str | None = None
    text_model_dir: str | None = None
    schema_version: int = SCHEMA_VERSION  # written as `_writes()` says: 2 when sharded, 3 when segmented
    extra: dict[str, Any] = field(default_factory=dict)

    _READS: ClassVar[int] = SEGMENTED_SCHEMA_VERSION

    @property
    def segmented(self) -> bool:
        """Its rows lie in segments (schema version 3): at the version, or in its shards."""
        return self.segments is not None or any(entry.segments is not None for entry in self.shards or [])

    @property
    def indexed_rows(self) -> int:
        return self.rows.indexed if self.rows is not None else self.size

    @property
    def live_size(self) -> int:
        """The one size of a version: the items that can answer, its index's rows (`size`, faiss's
        ntotal) less those removed but still in it (`deleted_rows`, HNSW tombstones). What `index
        list`, build/add/remove/rebuild logs and a server report."""
        return self.size - self.deleted_rows

    @classmethod
    def _parse(cls, fields: ManifestFields, version: int) -> IndexManifest:
        rows = fields.section_of("rows", required=False)
        quality = fields.section_of("quality", required=False)
        gate = fields.section_of("quality_gate", required=False)
        params = fields.section_of("search_params", required=False)
        manifest = cls(
            index_id=fields.get("index_id", str),
            version=fields.get("version", str),
            model_id=fields.get("model_id", str),
            size=fields.get("size", int),
            dimension=fields.get("dimension", int),
            factory=fields.get("factory", str),
            search_params={} if params is None else {k: params.get(k, NUMBER) for k in params.data},
            model_dir=fields.get("model_dir", str, required=False),
            metric=fields.get("metric", str, required=False, default="inner_product"),
            normalized=fields.get("normalized", bool, required=False, default=True),
            built_on=fields.get("built_on", str, required=False),
            build_seconds=_float_or_none(fields.get("build_seconds", NUMBER, required=False)),
            embed_seconds=_float_or_none(fields.get("embed_seconds", NUMBER, required=False)),
            created=fields.get("created", str, required=False),
            catalog=fields.get("catalog", str, required=False),
            rows=None if rows is None else _row_counts(rows),
            quality=None if quality is None else QualityReport._parse(quality),
            quality_gate=None if gate is None else _quality_gate(gate),
            config=fields.get("config", dict, required=False, default={}),
            parent_version=fields.get("parent_version", str, required=False),
            ancestors=_ancestors(fields),
            deleted_rows=fields.get("deleted_rows", int, required=False, default=0),
            engine=fields.get("engine", dict, required=False),
            filterable=fields.get("filterable", dict, required=False, default={}),
            item_field=fields.get("item_field", str, required=False),
            shards=_shard_entries(fields),
            shard_key=fields.get("shard_key", str, required=False),
            segments=_segment_entries(fields),
            text_model_id=fields.get("text_model_id", str, required=False),
            text_model_dir=fields.get("text_model_dir", str, required=False),
            schema_version=version,
        )
        if manifest.segments is not None and manifest.shards is not None:
            raise ArtifactError(f"{fields.source}: lists both shards and segments (a shard lists its own segments)")
        if version != manifest._writes():
            holds = "segments" if manifest.segmented else "shards" if manifest.shards else "one index"
            raise ArtifactError(
                f"{fields.source}: field {SCHEMA_KEY!r} is {version}, but the manifest describes {holds} "
                f"(schema version {manifest._writes()})"
            )
        manifest.extra = fields.rest()
        return manifest

    def _writes(self) -> int:
        if self.segmented:
            return SEGMENTED_SCHEMA_VERSION
        return SHARDED_SCHEMA_VERSION if self.shards else SCHEMA_VERSION

    def _dict(self) -> dict[str, Any]:
        d = self._values()
        for name in ("rows", "quality", "quality_gate"):
            if d[name] is not None:
                d[name] = d[name].to_dict()
        if d["shards"] is not None:
            d["shards"] = [entry.to_dict() for entry in self.shards or []]
        if d["segments"] is not None:
            d["segments"] = [entry.to_dict() for entry in self.segments or []]
        if not d["deleted_rows"]:  # written only by the versions that have them
            del d["deleted_rows"]
        if not d["filterable"]:  # none declared: a manifest read back is written back as it was
            d["filterable"] = None
        return {k: v for k, v in d.items() if v is not None}


def _shard_entries(fields: ManifestFields) -> list[ShardEntry] | None:
    entries = fields.get("shards", list, required=False)
    if entries is None:
        return None
    if not entries:
        raise ArtifactError(f"{fields.source}: field 'shards' lists no shard")
    return [_shard_entry(entry, fields.source, number) for number, entry in enumerate(entries)]


def _float_or_none(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def _row_counts(fields: ManifestFields) -> RowCounts:
    skipped = fields.section_of("skipped", required=False)
    return RowCounts(
        catalog=fields.get("catalog", int),
        indexed=fields.get("indexed", int),
        skipped={} if skipped is None else {k: skipped.get(k, int) for k in skipped.data},
        added=fields.get("added", int, required=False),
        already_indexed=fields.get("already_indexed", int, required=False),
        replaced=fields.get("replaced", int, required=False),
    )


def _quality_gate(fields: ManifestFields) -> QualityGate:
    return QualityGate(
        passed=fields.get("passed", bool),
        forced=fields.get("forced", bool, required=False, default=False),
        reasons=fields.get("reasons", list, required=False, default=[]),
    )


def check_model_index_pair(model_manifest: ModelManifest, index_manifest: IndexManifest) -> None:
    """An index answers only for the model that embedded it: ArtifactError when the ids differ.
    Here, not in the build pipeline, because the server checks every pair it loads."""
    if model_manifest.model_id != index_manifest.model_id:
        raise ArtifactError(
            f"index {index_manifest.version} was built with model {index_manifest.model_id}, "
            f"not with model {model_manifest.model_id}, which cannot search it"
        )
