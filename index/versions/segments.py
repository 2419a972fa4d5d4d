"""Segments: a change to a version costs the change, not the catalog.

A segmented version (schema 3) keeps its rows — or each shard its rows — in immutable segments,
`segments/<NNNNNN>/` with an index, vectors, items and filters of their own, plus one
`deleted.npy` of the rows that no longer answer (tombstones), as Lucene keeps segments and
live-docs, and Milvus and Qdrant sealed segments and delete logs. A new version hard-links the
segments it keeps and writes only what changed:

- an add writes one new segment in each shard its rows hash to: Flat while small or while the
  version is a graph (`flat_until_compaction`: Milvus's growing segments), else IVF/PQ/SQ rows
  coded by the version's trained quantizer and code books (`trained.faiss`, kept beside the
  segments once a segment has copied it);
- a removal writes only the tombstones of the shards it touches; an upsert both;
- compaction (`compact`) merges a shard's segments into one, its deleted rows dropped and an
  HNSW graph rebuilt, one Ray task a shard — beside other writers: it merges a snapshot and is
  rebased onto what they published meanwhile (`_rebased`), taking the root only to publish.

A version of the older formats becomes segmented on its first change without copying a row:
its row files are hard-linked as segment 000000. Opened whole, a segmented version is the
merged view `index.versions.version.IndexVersion` gives shards (one faiss index over its segments'
global rows, their items and filters concatenated, their vectors read in place as one array).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from core import artifacts
from core.artifacts import utc_now
from core.index_manifest import IndexManifest, QualityGate, RowCounts, SegmentEntry, ShardEntry
from core.items import ItemTable, string_hashes
from core.metrics import stable_sample
from core.vectors import exact_search, l2_normalized
from index.search.ann_recall import recall_against
from index.search.faiss_index import build_index, emptied_index, empty_index, load_index
from index.search.faiss_search import index_family, search
from index.search.filters import FieldSpec, FilterIndex, specs_of
from index.versions.units import segment_counts
from index.versions.version import IndexVersion
from index.versions.version_writer import ShardWriter, VersionWriter, rows_as_segment, segment_name, shard_name

log = logging.getLogger(__name__)

# Compaction runs on its own once a shard has more segments than this, or more deleted rows
# than this share of its rows (`index add`/`remove` --max-segments/--max-deleted-fraction).
MAX_SEGMENTS = 16
MAX_DELETED_FRACTION = 0.2
FLAT_SEGMENT_ROWS = 10_000  # a new segment of fewer rows is Flat until compaction (`flat_until_compaction`)
GATE_QUERIES = 200  # an add's gate: at most this many new rows query the new version, and half as many kept rows


@dataclass
class UnitChange:
    """What one unit — a version of one index, or one shard — becomes in a new version: unit
    rows that leave (`removed`), rows that join (`vectors`, `items`: a new segment), or its
    segments merged into one (`compact`)."""

    removed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    vectors: np.ndarray | None = None
    items: ItemTable | None = None
    compact: bool = False

    @property
    def touches(self) -> bool:
        return bool(len(self.removed)) or (self.items is not None and len(self.items) > 0) or self.compact


@dataclass
class UnitWritten:
    """A unit as written: its segments, tombstones, and its own files' sha256."""

    segments: list[SegmentEntry]
    deleted: int
    files: dict[str, str]
    peak_rss: int = 0  # written by a Ray task: that worker's peak resident bytes

    @property
    def rows(self) -> int:
        return sum(entry.rows for entry in self.segments)


def needs_training(manifest: IndexManifest) -> bool:
    """The version's factory trains a quantizer or code books (IVF, PQ, SQ, a PCA)."""
    return not empty_index(manifest.dimension, manifest.factory).is_trained


def graph_factory(manifest: IndexManifest) -> bool:
    """The version's index is a graph (HNSW): new rows wait in Flat segments for compaction."""
    return index_family(empty_index(manifest.dimension, manifest.factory)) == "hnsw"


def _trained(unit: IndexVersion) -> faiss.Index | None:
    """The unit's trained empty index (None when its factory trains nothing): its
    `trained.faiss`, or for an unsegmented unit its index emptied."""
    if not needs_training(unit.manifest):
        return None
    path = unit.directory / artifacts.TRAINED_FILE
    if path.is_file():
        return load_index(path)
    for number in range(len(unit.segment_entries)):  # the first segment of the factory's own kind
        index = unit.segment(number).read_index(mapped=False)  # emptied below: a copy of its own
        if not isinstance(faiss.downcast_index(index), faiss.IndexFlat):
            return emptied_index(index)
    if unit.segment_entries:
        raise ValueError(f"{unit.name}: no segment holds the trained {unit.manifest.factory} index to copy")
    return emptied_index(unit.read_index(mapped=False))


def flat_until_compaction(manifest: IndexManifest, rows: int) -> bool:
    """A new segment of `rows` rows is Flat until compaction: a graph version's (HNSW is built
    once, over every row, by compaction), and any version's below FLAT_SEGMENT_ROWS — scanning
    a few thousand rows costs a query less than a search of the coarse quantizer, which an
    IVF segment of any size pays in full."""
    return graph_factory(manifest) or rows < FLAT_SEGMENT_ROWS


def segment_index(unit: IndexVersion, vectors: np.ndarray, final: bool) -> tuple[faiss.Index, faiss.Index | None]:
    """The index of a segment of `vectors` in `unit` and the trained empty index it copied
    (None: none): Flat while it grows (`flat_until_compaction`); else, and at compaction
    (`final`), the version's factory — a copy of its trained quantizer and code books with the
    rows added, or built (HNSW's graph)."""
    manifest = unit.manifest
    data = l2_normalized(vectors) if len(vectors) else np.zeros((0, manifest.dimension), np.float32)
    if not final and flat_until_compaction(manifest, len(data)):
        index = faiss.IndexFlatIP(manifest.dimension)
        index.add(data)
        return index, None
    trained = _trained(unit)
    if trained is not None:
        index = faiss.clone_index(trained)
        index.add(data)
        return index, trained
    if not len(data):  # a shard every row has left: its factory's empty index
        return empty_index(manifest.dimension, manifest.factory), None
    return build_index(data, manifest.factory, None, None, "cpu"), None


def write_unit(
    writer: VersionWriter | object,
    unit: IndexVersion,
    change: UnitChange,
    specs: Sequence[FieldSpec],
    unit_sums: dict[str, str] | None = None,
) -> UnitWritten:
    """Write one unit of a new version through `writer` (a `VersionWriter` or a `ShardWriter`):
    `unit`'s segments hard-linked (an unsegmented unit's row files as segment 000000), then the
    change — a new segment of its rows, its tombstones, or its segments compacted into one.
    `unit_sums`: the sha256 of an unsegmented shard's files, as its manifest lists them."""
    if change.compact:
        return _compacted(writer, unit, specs, change.removed)
    entries = _kept_segments(writer, unit, unit_sums)
    offset = sum(entry.rows for entry in entries)
    if change.items is not None and len(change.items):
        number = int(entries[-1].name) + 1 if entries else 0
        segment = writer.segment(segment_name(number))
        vectors = np.ascontiguousarray(change.vectors, dtype=np.float32)
        index, trained = segment_index(unit, vectors, final=False)
        segment.write_index(index)
        segment.write_vectors(vectors)
        segment.write_items(change.items)
        segment.write_filters(FilterIndex.build(change.items, specs) if specs else None)
        entries.append(segment.entry(len(change.items), offset))
    else:
        trained = None
    deleted = np.union1d(unit.deleted, np.asarray(change.removed, dtype=np.int64))
    return _finish(writer, unit, trained, entries, deleted)


def _kept_segments(writer, unit: IndexVersion, unit_sums: dict[str, str] | None) -> list[SegmentEntry]:
    for entry in unit.segment_entries:
        writer.link_segment(unit.directory, entry)
    return unit.segment_entries or [
        writer.link_rows_as_segment(unit.directory, segment_name(0), len(unit.items), unit_sums)
    ]


def _finish(writer, unit: IndexVersion, trained: faiss.Index | None, entries, deleted: np.ndarray) -> UnitWritten:
    """The unit's own files: its tombstones, and the trained empty index — the parent's linked,
    or, the first time a segment copied it, written."""
    writer.write_deleted(deleted)
    if (unit.directory / artifacts.TRAINED_FILE).is_file():
        writer.link_file(unit.directory, artifacts.TRAINED_FILE)
    elif trained is not None:
        writer.write_trained(trained)
    return UnitWritten(entries, len(deleted), _unit_files(writer))


def _unit_files(writer) -> dict[str, str]:
    """The sha256 of the unit's own files as written: its tombstones and trained index."""
    return {
        name: artifacts.file_sha256(writer.folder / name)
        for name in (artifacts.DELETED_FILE, artifacts.TRAINED_FILE)
        if (writer.folder / name).is_file()
    }


def _compacted(writer, unit: IndexVersion, specs: Sequence[FieldSpec], removed: np.ndarray) -> UnitWritten:
    """`unit`'s live rows, less `removed`, in one segment: deleted rows dropped, a graph rebuilt."""
    live = np.setdiff1d(np.arange(len(unit.items), dtype=np.int64), np.union1d(unit.deleted, removed))
    vectors = np.asarray(unit.vectors[live])  # gathered segment by segment (RowBlocks)
    items = unit.items.take(live)
    last = int(unit.segment_entries[-1].name) if unit.segment_entries else 0
    segment = writer.segment(segment_name(last + 1))
    index, trained = segment_index(unit, vectors, final=True)
    segment.write_index(index)
    segment.write_vectors(vectors)
    segment.write_items(items)
    segment.write_filters(FilterIndex.build(items, specs) if specs else None)
    return _finish(writer, unit, trained, [segment.entry(len(items), 0)], np.zeros(0, np.int64))


def wants_compaction(unit: IndexVersion, change: UnitChange, max_segments: int, max_deleted_fraction: float) -> bool:
    """After `change`, the unit would hold more than `max_segments` segments or more than
    `max_deleted_fraction` of its rows deleted."""
    segments = max(len(unit.segment_entries), 1) + (1 if change.items is not None and len(change.items) else 0)
    rows = unit.manifest.size + (len(change.items) if change.items is not None else 0)  # `load` checks the items agree
    deleted = len(np.union1d(unit.deleted, change.removed))
    return _past(segments, rows, deleted, max_segments, max_deleted_fraction)


def _past(segments: int, rows: int, deleted: int, max_segments: int, max_deleted_fraction: float) -> bool:
    return segments > max_segments or (rows > 0 and deleted > max_deleted_fraction * rows)


# -- a new version ----------------------------------------------------------------------------


@dataclass
class ChangeReport:
    """What a segmented change wrote: the version, and how many bytes it wrote (new files; hard
    links cost none)."""

    version: Path
    bytes_written: int
    seconds: float
    peak_task_rss: int = 0  # the largest peak resident bytes of the Ray tasks that wrote the units
    compacted_to: Path | None = None  # a compaction published right after it (what CURRENT then names)

    @property
    def live_version(self) -> Path:
        """The version this change left live: its own, or the compaction's that followed it."""
        return self.compacted_to or self.version


class Superseded(artifacts.ArtifactError):
    """A compaction's snapshot is no longer what the live version grew from (a rollback, another
    compaction, a rebuild): its work does not apply, and nothing is published."""


def publish_change(
    index_root: str | Path,
    live: IndexVersion,
    changes: list[UnitChange],
    keep: int,
    what: str,
    rows: RowCounts | None = None,
    model_id: str | None = None,
    current: str | None = None,
    on_ray: bool = False,
    gate: Callable[[IndexVersion, np.ndarray], QualityGate] | None = None,
    rebase: bool = False,
    staged: Callable[[], None] | None = None,
) -> ChangeReport:
    """Publish `live` with `changes` (one per unit: the version itself, or each shard) as a
    new segmented version: untouched shards linked whole, touched ones written by `write_unit`
    — on Ray, one task a shard, when `on_ray` (compaction) — and the whole published by one
    rename, CURRENT still naming `current` (default `live`). `gate`: given the version as staged
    and its new rows (global), the verdict the manifest records (it raises to refuse).

    `rebase` (a compaction of `live`, a snapshot the caller pinned): the units are written
    without the root's writer lock, which is taken only to publish — onto the version live by
    then, rebased (`_rebased`) when it is `live` with segments appended or rows deleted, else
    `Superseded` and nothing is published. `staged`: called once the units are written, before
    the lock is taken (where tests pause a compaction)."""
    started = time.perf_counter()
    specs = specs_of(live.manifest.filterable)
    with VersionWriter(index_root, keep, hold_root=not rebase) as writer:
        written = _write_touched(writer, live, changes, specs, on_ray)
        base = _onto_live(index_root, writer, live, written, staged) if rebase else live
        layout, size, deleted, index_id = _layout(writer, base, written)
        writer.link_contact_sheet(base.directory)
        index_id, version = writer.name_version(index_id)
        parent = base.manifest
        manifest = dataclasses.replace(
            parent,
            index_id=index_id,
            version=version,
            size=size,
            deleted_rows=deleted,
            created=utc_now(),
            parent_version=base.name,
            model_id=model_id or parent.model_id,
            quality_gate=QualityGate(passed=True, reasons=[f"not gated: {what}; quality figures of {base.name}"]),
            **layout,
        )
        if gate is not None:
            staged_version = IndexVersion(writer.staging, manifest)
            manifest.quality_gate = gate(staged_version, _new_rows(base, manifest))
        catalog_rows = rows.catalog if rows else parent.rows.catalog if parent.rows else manifest.live_size
        manifest.rows = (
            dataclasses.replace(rows, indexed=manifest.live_size)
            if rows
            else RowCounts(catalog=catalog_rows, indexed=manifest.live_size)
        )
        written_bytes = _bytes_written(writer.staging)
        target = writer.publish(manifest, parent=current or base.name)
    peak = max((unit.peak_rss for unit in written.values()), default=0)
    report = ChangeReport(target, written_bytes, time.perf_counter() - started, peak)
    segments = sum(segment_counts(manifest))
    log.info(
        "published index %s (%d items, %d segment%s%s): %s%s, wrote %s in %.2f s",
        manifest.version, manifest.live_size, segments, "" if segments == 1 else "s",
        f", {manifest.deleted_rows} deleted" if manifest.deleted_rows else "", what,
        f" (rebased from {live.name} onto {base.name})" if base is not live else "", _megabytes(written_bytes),
        report.seconds,
    )  # fmt: skip
    return report


def compaction_due(version: IndexVersion, max_segments: int, max_deleted_fraction: float) -> bool:
    """Whether some unit of `version` is past `max_segments` or `max_deleted_fraction` as it
    stands — from its manifest alone (the counts `load` checks its files against), so a server
    that holds none of a sharded version's rows can tell."""
    return any(
        _past(unit.segments, unit.rows, unit.deleted, max_segments, max_deleted_fraction) for unit in version.units()
    )


def _unit_writer(writer: VersionWriter, version: IndexVersion, number: int) -> VersionWriter | ShardWriter:
    return writer.shard(number) if version.manifest.shards else writer


def _write_touched(
    writer: VersionWriter, live: IndexVersion, changes: list[UnitChange], specs: Sequence[FieldSpec], on_ray: bool
) -> dict[int, UnitWritten]:
    """The units `changes` touch, written (a version of one index: always written, unit 0) —
    on Ray, one task a unit, when `on_ray`."""
    entries_in = live.manifest.shards
    if not entries_in:
        if on_ray and changes[0].touches:  # one task, so the driver never holds the rows
            task = (ShardWriter(writer.staging, ""), str(live.directory), None, changes[0], specs, None)
            return {0: _on_ray([task])[0]}
        return {0: write_unit(writer, live, changes[0], specs)}
    touched = [number for number, change in enumerate(changes) if change.touches]
    if on_ray and touched:
        tasks = [
            (writer.shard(number), str(live.directory), number, changes[number], specs, entries_in[number].files)
            for number in touched
        ]
        return dict(zip(touched, _on_ray(tasks), strict=True))
    return {
        number: write_unit(writer.shard(number), live.shard(number), changes[number], specs, entries_in[number].files)
        for number in touched
    }


def _layout(writer: VersionWriter, base: IndexVersion, written: dict[int, UnitWritten]) -> tuple[dict, int, int, str]:
    """The manifest's account of the version as written — `{"shards": ...}` (untouched shards
    linked whole from `base`) or `{"segments": ...}` — its rows, deleted rows and index id."""
    if not base.manifest.shards:
        unit = written[0]
        return {"segments": unit.segments}, unit.rows, unit.deleted, _index_id([_sums(unit.segments, unit.files)])
    entries: list[ShardEntry] = []
    offset = 0
    for number, entry in enumerate(base.manifest.shards):
        shard = writer.shard(number)
        if number in written:
            unit = written[number]
            new = ShardEntry(shard_name(number), unit.rows, unit.deleted, offset, unit.files, unit.segments)
        else:
            parent = base.shard(number).directory
            shard.link_shard(parent)  # its files: rows, or tombstones and trained index
            for segment in entry.segments or []:
                shard.link_segment(parent, segment)
            new = dataclasses.replace(entry, row_offset=offset)
        entries.append(new)
        offset += new.rows
    size, deleted = sum(e.rows for e in entries), sum(e.deleted_rows for e in entries)
    return {"shards": entries}, size, deleted, _index_id([_shard_sums(entry) for entry in entries])


# -- a compaction rebased onto what was published while it ran ---------------------------------


def _onto_live(
    index_root: str | Path,
    writer: VersionWriter,
    snapshot: IndexVersion,
    written: dict[int, UnitWritten],
    staged: Callable[[], None] | None,
) -> IndexVersion:
    """The root taken (its writer lock, held to the publish) once the units of `snapshot` are
    `written`, and the version live then, onto which they are rebased in place when it is not
    `snapshot` (`Superseded` when it did not grow from it)."""
    grown_from = {number: _segments_of(snapshot, number) for number in written}  # read before the lock
    if staged is not None:
        staged()
    writer.hold_root()
    live = IndexVersion.open(index_root)
    if live.name != snapshot.name:
        _check_rebase(snapshot, live)
        for number, unit in written.items():
            unit_writer = _unit_writer(writer, live, number)
            before, after = snapshot.unit(number), live.unit(number)
            # A shard the meanwhile change left alone may still be unsegmented, linked whole:
            # its row files read as the segment they become, as the snapshot's are.
            live_segments = _segments_of(live, number)
            written[number] = _rebased(unit_writer, before, after, live_segments, grown_from[number], unit)
    return live


def _segments_of(version: IndexVersion, number: int) -> list[SegmentEntry]:
    """Unit `number`'s segments — an unsegmented unit's row files as the segment 000000 its
    first change lists them as — which a version grown from it by adds and removals begins with."""
    unit = version.unit(number)
    if unit.segment_entries:
        return unit.segment_entries
    sums = version.manifest.shards[number].files if version.manifest.shards else None
    return [rows_as_segment(unit.directory, segment_name(0), unit.manifest.size, sums)]


# What a rebase keeps of the live version's manifest: it must be what the snapshot's was.
_REBASE_KEPT = ("model_id", "factory", "dimension", "metric", "filterable", "item_field", "shard_key")


def _check_rebase(snapshot: IndexVersion, live: IndexVersion) -> None:
    """`Superseded` unless `live` has the snapshot's shards, model, factory and fields."""
    same_shards = [e.name for e in snapshot.manifest.shards or []] == [e.name for e in live.manifest.shards or []]
    differ = [name for name in _REBASE_KEPT if getattr(snapshot.manifest, name) != getattr(live.manifest, name)]
    if differ or not same_shards:
        raise Superseded(f"its {', '.join(differ) or 'shards'} differ (a rebuild)")


def _rebased(
    writer: VersionWriter | ShardWriter,
    snapshot: IndexVersion,
    live: IndexVersion,
    live_segments: list[SegmentEntry],
    grown_from: list[SegmentEntry],
    compacted: UnitWritten,
) -> UnitWritten:
    """A unit's `compacted` segment — the live rows of `snapshot` (whose segments were
    `grown_from`), in order — rebased onto `live`, the unit as published meanwhile (its
    segments `live_segments`, as `_segments_of` reads them), which must be the snapshot's
    segments with segments appended and rows deleted (what adds, removals and takedowns make;
    `Superseded` otherwise): the compacted segment, then `live`'s appended
    segments hard-linked and numbered after every segment `live` has (a segment's number is
    never reused), and `live`'s deletions mapped onto those rows — a row removed while the
    compaction ran stays removed."""
    rows = sum(entry.rows for entry in grown_from)
    was_deleted, now_deleted = snapshot.deleted, live.deleted
    appended = live_segments[len(grown_from) :]
    if live_segments[: len(grown_from)] != grown_from or len(np.setdiff1d(was_deleted, now_deleted)):
        raise Superseded("its segments were replaced or deleted rows restored (a rollback, a compaction, a rebuild)")
    [segment] = compacted.segments
    number = int(live_segments[-1].name) + 1
    entries = [writer.rename_segment(segment, segment_name(number))]
    for entry in appended:
        number += 1
        writer.link_segment(live.directory, entry, segment_name(number))
        moved = dataclasses.replace(entry, name=segment_name(number), row_offset=entry.row_offset - rows + segment.rows)
        entries.append(moved)
    kept = np.setdiff1d(np.arange(rows, dtype=np.int64), was_deleted)  # the compacted segment's rows, in order
    removed_meanwhile = np.setdiff1d(now_deleted[now_deleted < rows], was_deleted)
    deleted = np.concatenate(
        [np.searchsorted(kept, removed_meanwhile), now_deleted[now_deleted >= rows] - rows + segment.rows]
    ).astype(np.int64)
    writer.write_deleted(deleted)
    return UnitWritten(entries, len(deleted), _unit_files(writer), compacted.peak_rss)


def _new_rows(live: IndexVersion, manifest: IndexManifest) -> np.ndarray:
    """The rows (global) of `manifest`'s segments that `live` does not hold: an add's new rows."""
    units = manifest.shards or [None]
    parents = live.manifest.shards or [None]
    found = []
    for entry, parent in zip(units, parents, strict=True):
        segments = entry.segments if entry is not None else manifest.segments
        before = (parent.segments if parent is not None else live.manifest.segments) or []
        known = {segment.name for segment in before} or {segment_name(0)}
        offset = entry.row_offset if entry is not None else 0
        for segment in segments or []:
            if segment.name not in known:
                found.append(np.arange(segment.rows, dtype=np.int64) + offset + segment.row_offset)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _on_ray(tasks: list[tuple]) -> list[UnitWritten]:
    """`_write_unit_task` of each of `tasks` on Ray, at once: their units as written."""
    import ray

    from core.cli import init_ray

    init_ray(log_to_driver=False)
    # A fresh worker a task (max_calls=1): it gives its memory back, and its peak is its own.
    task = ray.remote(num_cpus=1, max_calls=1)(_write_unit_task)
    return list(ray.get([task.remote(*arguments) for arguments in tasks]))


def _write_unit_task(
    unit_writer, directory: str, number: int | None, change: UnitChange, specs: Sequence[FieldSpec], sums: dict | None
) -> UnitWritten:
    """A Ray task: one unit of a new version written — shard `number` of the version in
    `directory`, or the version itself (None) — opened here, so only its rows are read in this
    worker, whose peak resident bytes come back with it."""
    import resource

    version = IndexVersion(directory)
    unit = version.unit(number or 0)
    written = write_unit(unit_writer, unit, change, list(specs), sums)
    written.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return written


def _sums(segments: list[SegmentEntry], files: dict[str, str]) -> str:
    return "".join(entry.files.get(artifacts.INDEX_FILE, "") + entry.files.get(artifacts.ITEMS_FILE, "")
                   for entry in segments) + files.get(artifacts.DELETED_FILE, "")  # fmt: skip


def _shard_sums(entry: ShardEntry) -> str:
    if entry.segments:
        return _sums(entry.segments, entry.files)
    return entry.files.get(artifacts.INDEX_FILE, "") + entry.files.get(artifacts.DELETED_FILE, "")


def _index_id(parts: list[str]) -> str:
    """A segmented version's index id: the hash of its segments' index and items hashes and its
    tombstones', so two versions with the same segments and deletions have the same id."""
    return hashlib.sha256("".join(parts).encode()).hexdigest()[:16]


def _bytes_written(staging: Path) -> int:
    """Bytes of the files that are new in the staging folder: a hard-linked file (more than one
    link) is the parent's, not written."""
    total = 0
    for path in staging.rglob("*"):
        if path.is_file():
            stat = path.stat()
            if stat.st_nlink == 1:
                total += stat.st_size
    return total


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB" if count >= 10_000 else f"{count} bytes"


# -- what an add changed, gated -----------------------------------------------------------------


def gate_change(
    version: IndexVersion, new_rows: np.ndarray, ann_k: int, min_ann_recall: float, force: bool
) -> tuple[float | None, QualityGate]:
    """An add's gate on what changed: ANN recall@`ann_k` of the new version's search against
    exact search, queried by (at most GATE_QUERIES of) the new rows and half as many kept rows,
    each unit (version or shard) searched on its own — the merge over units is exact — and
    its exact search read segment by segment where the vectors lie, never gathered whole.
    None (and passed) when what changed searches exactly: a Flat index, or new rows that all
    lie in Flat segments (`flat_until_compaction`)."""
    recalls = []
    for part in version.units():
        unit, local = version.unit(part.number), part.own(new_rows)
        if not len(local):
            continue
        if isinstance(empty_index(unit.manifest.dimension, unit.manifest.factory), faiss.IndexFlat):
            continue  # exact search: its recall is 1 by construction
        if all(flat_until_compaction(unit.manifest, entry.rows) for entry in _segments_holding(unit, local)):
            # The new rows are scanned exactly and the kept segments are the parent's, gated when
            # they were made: nothing this change made can miss. (Compaction codes them later.)
            continue
        searched = unit.searchable()
        picked_new = _sample_rows(unit, local, GATE_QUERIES)
        picked_old = _sample_rows(unit, np.setdiff1d(np.arange(len(unit.items)), local), GATE_QUERIES // 2)
        queries = np.asarray(unit.vectors[np.sort(np.concatenate([picked_new, picked_old]))], dtype=np.float32)
        k = min(ann_k, len(unit.items))
        _, exact_rows = exact_search(unit.vectors, queries, k, unit.live_mask)  # segment by segment, where they lie
        recalls.append(recall_against(search(searched, queries, k)[1], exact_rows, unit.vectors, queries))
    if not recalls:
        why = "the new rows are searched exactly (Flat segments until compaction), the kept segments as gated before"
        return None, QualityGate(passed=True, reasons=[f"gated on the new rows: {why}"])
    recall = min(recalls)
    reasons = (
        [] if recall >= min_ann_recall else [f"ANN recall@{ann_k} of the new rows {recall:.4f} < {min_ann_recall}"]
    )
    if reasons and not force:
        from index.build.gate import QualityGateError

        raise QualityGateError("quality gate refused to publish: " + "; ".join(reasons))
    return recall, QualityGate(passed=not reasons, forced=bool(reasons), reasons=reasons)


def _segments_holding(unit: IndexVersion, rows: np.ndarray) -> list[SegmentEntry]:
    """The unit's segments that hold any of `rows` (its own rows)."""
    return [e for e in unit.segment_entries if np.any((rows >= e.row_offset) & (rows < e.row_offset + e.rows))]


def _sample_rows(unit: IndexVersion, rows: np.ndarray, count: int) -> np.ndarray:
    """`count` of `rows`, chosen by their ids (`stable_sample`), among the 4×count whose ids hash
    lowest (`string_hashes`, over the Arrow column at once): the same rows whatever their order,
    without hashing a million ids one by one in Python."""
    if len(rows) > 4 * count:
        hashes = string_hashes(unit.items.ids.array)[rows]
        rows = np.sort(rows[np.argpartition(hashes, 4 * count)[: 4 * count]])
    ids = unit.items.ids
    return rows[stable_sample([ids[int(r)] for r in rows], count, seed=2)]
