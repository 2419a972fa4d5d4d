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
- a tiered merge (`merge`, chosen by `index.versions.merge_policy`) merges some of a shard's
  segments into one, in the place of the first;
- compaction (`compact`) merges a shard's segments into one, its deleted rows dropped and an
  HNSW graph rebuilt, one Ray task a shard — beside other writers: it merges a snapshot and is
  rebased onto what they published meanwhile (`index.versions.rebase`), taking the root only
  to publish.

This module writes one unit's segments (`write_unit`) and says when a unit wants compaction;
`index.versions.change` makes a new version of the units changed and publishes it through the
one publish path (`index.versions.version_writer.publish_units`).

A version of the older formats becomes segmented on its first change without copying a row:
its row files are hard-linked as segment 000000. Opened whole, a segmented version is the
merged view `index.versions.version.IndexVersion` gives shards (one faiss index over its segments'
global rows, their items and filters concatenated, their vectors read in place as one array).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, SegmentEntry
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import build_index, emptied_index, empty_index, load_index
from index.search.faiss_search import index_family
from index.search.filters import FieldSpec, FilterIndex
from index.versions.merge_rows import MergedLayout
from index.versions.version import IndexVersion
from index.versions.version_writer import VersionWriter, segment_name

log = logging.getLogger(__name__)

# Compaction runs on its own once a shard has more segments than this, or more deleted rows
# than this share of its rows (`index add`/`remove` --max-segments/--max-deleted-fraction).
MAX_SEGMENTS = 16
MAX_DELETED_FRACTION = 0.2
FLAT_SEGMENT_ROWS = 10_000  # a new segment of fewer rows is Flat until compaction (`flat_until_compaction`)


@dataclass
class UnitChange:
    """What one unit — a version of one index, or one shard — becomes in a new version: unit
    rows that leave (`removed`), rows that join (`vectors`, `items`: a new segment), its
    segments merged into one (`compact`), or some of them (`merge`: their positions, which a
    tiered merge policy chose)."""

    removed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    vectors: np.ndarray | None = None
    items: ItemTable | None = None
    compact: bool = False
    merge: tuple[int, ...] = ()

    @property
    def touches(self) -> bool:
        added = self.items is not None and len(self.items) > 0
        return bool(len(self.removed)) or added or self.compact or bool(self.merge)


@dataclass
class UnitWritten:
    """A unit as written: its segments, tombstones, and its own files' sha256."""

    segments: list[SegmentEntry]
    deleted: int
    files: dict[str, str]
    peak_rss: int = 0  # written by a Ray task: that worker's peak resident bytes
    layout: MergedLayout | None = None  # a merge's: where the unit's rows went (a rebase maps them again)

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
    # The version's search parameters go in before the rows: HNSW's efConstruction shapes the graph.
    return build_index(data, manifest.factory, manifest.search_params or None, None, "cpu"), None


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
    if change.compact or change.merge:
        return _merged(writer, unit, specs, change)
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
    return UnitWritten(entries, len(deleted), unit_files(writer))


def unit_files(writer) -> dict[str, str]:
    """The sha256 of the unit's own files as written: its tombstones and trained index."""
    return {
        name: artifacts.file_sha256(writer.folder / name)
        for name in (artifacts.DELETED_FILE, artifacts.TRAINED_FILE)
        if (writer.folder / name).is_file()
    }


def _merged(writer, unit: IndexVersion, specs: Sequence[FieldSpec], change: UnitChange) -> UnitWritten:
    """`unit` with the segments `change` merges (every one, for `compact`) as one segment of
    their live rows, less `change.removed`, in the place of the first; the others linked, those
    after it numbered after it (a segment's number grows along the list and is never reused).
    The merged segment is the version's factory when it is the whole unit or its base (the
    first segment is of the factory: search parameters are read off it) or large enough
    (FLAT_SEGMENT_ROWS), else Flat: a tier's small merge is scanned exactly, as an add's."""
    entries = unit.segment_entries
    sizes = [entry.rows for entry in entries] or [len(unit.items)]
    group = tuple(range(len(sizes))) if change.compact else change.merge
    dropped = np.union1d(unit.deleted, np.asarray(change.removed, dtype=np.int64))
    layout = MergedLayout.of(sizes, group, dropped)
    vectors = np.asarray(unit.vectors[layout.kept])  # gathered segment by segment (RowBlocks)
    items = unit.items.take(layout.kept)
    number = int(entries[-1].name) + 1 if entries else 1
    segment = writer.segment(segment_name(number))
    final = len(group) == len(sizes) or group[0] == 0 or len(items) >= FLAT_SEGMENT_ROWS
    index, trained = segment_index(unit, vectors, final=final)
    segment.write_index(index)
    segment.write_vectors(vectors)
    segment.write_items(items)
    segment.write_filters(FilterIndex.build(items, specs) if specs else None)
    written, starts = [], layout.new_starts()
    for position in layout.order():
        if position is None:
            written.append(dataclasses.replace(segment.entry(len(items), 0), row_offset=starts[None]))
            continue
        name = entries[position].name if position < group[0] else segment_name(number := number + 1)
        writer.link_segment(unit.directory, entries[position], name)
        written.append(dataclasses.replace(entries[position], name=name, row_offset=starts[position]))
    done = _finish(writer, unit, trained, written, layout.rows(dropped))
    done.layout = layout
    return done


def wants_compaction(unit: IndexVersion, change: UnitChange, max_segments: int, max_deleted_fraction: float) -> bool:
    """After `change`, the unit would hold more than `max_segments` segments or more than
    `max_deleted_fraction` of its rows deleted."""
    segments = max(len(unit.segment_entries), 1) + (1 if change.items is not None and len(change.items) else 0)
    rows = unit.manifest.size + (len(change.items) if change.items is not None else 0)  # `load` checks the items agree
    deleted = len(np.union1d(unit.deleted, change.removed))
    return past_thresholds(segments, rows, deleted, max_segments, max_deleted_fraction)


def past_thresholds(segments: int, rows: int, deleted: int, max_segments: int, max_deleted_fraction: float) -> bool:
    return segments > max_segments or (rows > 0 and deleted > max_deleted_fraction * rows)


def compaction_due(version: IndexVersion, max_segments: int, max_deleted_fraction: float) -> bool:
    """Whether some unit of `version` is past `max_segments` or `max_deleted_fraction` as it
    stands — from its manifest alone (the counts `load` checks its files against), so a server
    that holds none of a sharded version's rows can tell."""
    return any(
        past_thresholds(unit.segments, unit.rows, unit.deleted, max_segments, max_deleted_fraction)
        for unit in version.units()
    )
