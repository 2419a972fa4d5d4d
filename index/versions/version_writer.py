"""The one writer of an index version, beside its reader (`index/versions/version.py`).

`index build`, `add`, `rebuild`, takedowns and compaction (and a rollback that re-applies
takedowns, which is a takedown) all write a version through `VersionWriter`: it stages the
folder inside the index root, writes each file under its one name (`core.artifacts.layout`, where
`IndexVersion` reads them too) or hard-links it from the parent version, names the version
after its index file's hash, writes the manifest, publishes it (CURRENT must still name the
parent) and prunes old versions. Any failure before the publish removes the staging folder, so
a crash mid-write leaves the previous version live.

Every version's manifest is written by one function, `publish_units`: a path stages its units
(one index's row files, shards, or segments), says what they hold (`StagedUnits`), and hands
over what the manifest says besides — a build's recipe and command, or a change's parent — and
how the staged version is measured (a build's tuning and gate, a change's gate); the version is
named, measured, counted and published by the one rename. A version of one index is the
one-unit case.

A sharded version's shard files go through its `shard(i)` writer (`ShardWriter`): the same file
names in `shards/<NNN>/` of the staging folder, written there by whichever process builds the
shard (a Ray task: the writer is a path, and pickles), and summed up as the manifest's
`ShardEntry` (rows and each file's sha256). The version is still published by one rename.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import faiss
import numpy as np
from PIL import Image

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, RowCounts, SegmentEntry, ShardEntry
from core.artifacts.layout import utc_now
from core.data.items import ItemTable
from index.search.faiss_index import save_index
from index.search.filters import FilterIndex

# What a takedown that only adds tombstones reuses of its parent unchanged.
ROW_FILES = (
    artifacts.INDEX_FILE, artifacts.EMBEDDINGS_FILE, artifacts.ITEMS_FILE, artifacts.ID_LOOKUP_FILE,
    artifacts.FILTERS_FILE,
)  # fmt: skip


class _FolderWriter:
    """The row files of an index (a whole version's, or one shard's), each under its one name."""

    @property
    def folder(self) -> Path:
        raise NotImplementedError

    def write_index(self, index: faiss.Index) -> None:
        save_index(index, self.folder / artifacts.INDEX_FILE)

    def write_vectors(self, vectors: np.ndarray) -> None:
        """The exact vectors, row for row with the items."""
        np.save(self.folder / artifacts.EMBEDDINGS_FILE, np.ascontiguousarray(vectors, dtype=np.float32))

    def write_deleted(self, deleted: np.ndarray) -> None:
        """Rows removed but kept in the index (HNSW tombstones); no file when there are none."""
        if len(deleted):
            np.save(self.folder / artifacts.DELETED_FILE, np.asarray(deleted, dtype=np.int64))

    def write_items(self, table: ItemTable) -> None:
        """The items, and their id lookup (what an add reads to check its ids are new)."""
        table.write(self.folder / artifacts.ITEMS_FILE)
        table.write_lookup(self.folder / artifacts.ID_LOOKUP_FILE)

    def write_filters(self, filter_index: FilterIndex | None) -> None:
        """The filterable fields' value → rows structure; no file when none is declared."""
        if filter_index is not None:
            filter_index.save(self.folder / artifacts.FILTERS_FILE)

    def link_rows(self, parent: Path) -> None:
        """The index, vectors, items and filters of the version (or shard) in `parent`, unchanged."""
        for name in ROW_FILES:
            _link_or_copy(parent / name, self.folder / name)

    def segment(self, name: str) -> SegmentWriter:
        """The writer of a new segment `name` (its folder made under segments/)."""
        folder = self.folder / artifacts.SEGMENTS / name
        folder.mkdir(parents=True, exist_ok=False)
        return SegmentWriter(folder, name)

    def link_segment(self, parent: Path, entry: SegmentEntry, name: str | None = None) -> None:
        """Segment `entry` of the version (or shard) folder `parent`, hard-linked unchanged — as
        segment `name` when given (a compaction's rebase numbers the segments it keeps after
        the compacted one)."""
        target = self.folder / artifacts.SEGMENTS / (name or entry.name)
        target.mkdir(parents=True, exist_ok=False)
        for file_name in entry.files:
            _link_or_copy(parent / artifacts.SEGMENTS / entry.name / file_name, target / file_name)

    def rename_segment(self, entry: SegmentEntry, name: str) -> SegmentEntry:
        """Segment `entry`, written here, renamed `name` (its files unchanged)."""
        segments = self.folder / artifacts.SEGMENTS
        os.rename(segments / entry.name, segments / name)
        return dataclasses.replace(entry, name=name)

    def link_rows_as_segment(self, parent: Path, name: str, rows: int, sums: dict[str, str] | None) -> SegmentEntry:
        """The row files of an unsegmented version (or shard) in `parent`, hard-linked as
        segment `name`: how its first change makes it segmented without copying a row.
        `sums`: their sha256 when the parent's manifest lists them (a shard's), else computed."""
        target = self.folder / artifacts.SEGMENTS / name
        target.mkdir(parents=True, exist_ok=False)
        for file_name in ROW_FILES:
            _link_or_copy(parent / file_name, target / file_name)
        return rows_as_segment(parent, name, rows, sums)

    def write_trained(self, index: faiss.Index) -> None:
        """The trained empty index new segments copy (IVF/PQ/SQ: quantizer and code books)."""
        save_index(index, self.folder / artifacts.TRAINED_FILE)

    def link_file(self, parent: Path, name: str) -> None:
        _link_or_copy(parent / name, self.folder / name)

    def file_sums(self, known: dict[str, str] | None = None) -> dict[str, str]:
        """Each file of the folder (not its sub-folders) and its sha256 — `known`'s where it
        lists the file (one linked from the parent, as its manifest lists it, is not read again)."""
        known = known or {}
        return {
            p.name: known.get(p.name) or artifacts.file_sha256(p) for p in sorted(self.folder.iterdir()) if p.is_file()
        }


class ShardWriter(_FolderWriter):
    """Shard `name` of a version being written: its files in `<staging>/shards/<name>/`."""

    def __init__(self, folder: Path, name: str) -> None:
        self._shard_folder, self.name = Path(folder), name

    @property
    def folder(self) -> Path:
        return self._shard_folder

    def link_shard(self, parent: Path) -> None:
        """Every file of the shard in `parent` (tombstones too), unchanged: a shard no row of a
        takedown or an add touches."""
        for path in sorted(parent.iterdir()):
            if path.is_file():
                _link_or_copy(path, self.folder / path.name)

    def entry(self, rows: int, deleted_rows: int, row_offset: int, linked: dict[str, str] | None = None) -> ShardEntry:
        """The manifest's account of the shard as written: its counts and each file's sha256
        (`linked`: those of files linked from the parent's shard, as its entry lists them — a
        takedown does not read every untouched shard again)."""
        files = self.file_sums(linked)
        return ShardEntry(name=self.name, rows=rows, deleted_rows=deleted_rows, row_offset=row_offset, files=files)


class SegmentWriter(_FolderWriter):
    """A new segment: its index, vectors, items and filters in `<folder>/segments/<name>/`."""

    def __init__(self, folder: Path, name: str) -> None:
        self._segment_folder, self.name = Path(folder), name

    @property
    def folder(self) -> Path:
        return self._segment_folder

    def entry(self, rows: int, row_offset: int) -> SegmentEntry:
        return SegmentEntry(name=self.name, rows=rows, row_offset=row_offset, files=self.file_sums())


def rows_as_segment(folder: Path, name: str, rows: int, sums: dict[str, str] | None) -> SegmentEntry:
    """The entry of the row files of an unsegmented version (or shard) in `folder` as segment
    `name`: what its first change lists them as (`link_rows_as_segment`). `sums`: their sha256
    when its manifest lists them (a shard's), else computed."""
    files = {
        file_name: (sums or {}).get(file_name) or artifacts.file_sha256(folder / file_name)
        for file_name in ROW_FILES
        if (folder / file_name).is_file()
    }
    return SegmentEntry(name=name, rows=rows, row_offset=0, files=files)


def segment_name(number: int) -> str:
    """Segment `number`'s folder name under segments/: 000000, 000001, ... (never reused in a
    line of versions: a new segment takes the number after the last one)."""
    return f"{number:06d}"


def shard_name(number: int) -> str:
    """Shard `number`'s folder name under shards/: 000, 001, ..."""
    return f"{number:03d}"


class VersionWriter(_FolderWriter):
    """A new version of `root` being written: `with VersionWriter(root, keep) as writer:`, the
    files written or linked, `name_version()`, then `publish(manifest)`. Leaving the block by
    an exception (or without publishing) removes the staging folder.

    The writer holds the root (`artifacts.writer_lock`) from the start, so that a second one
    waits its turn rather than publishing from a parent no longer live — or, `hold_root=False`
    (a compaction), only from `hold_root()` on: its staging folder is held by this process
    alone (`artifacts.held_staging_dir`), which other writers leave in place while it lives."""

    def __init__(self, root: str | Path, keep: int, hold_root: bool = True) -> None:
        self.root = Path(root)
        self.keep = keep
        self._hold_at_start = hold_root
        self._folder: Path | None = None

    def __enter__(self) -> VersionWriter:
        self._held = contextlib.ExitStack()
        try:
            if self._hold_at_start:
                self.hold_root()
            self._folder = self._held.enter_context(artifacts.held_staging_dir(self.root))
        except BaseException:
            self._held.close()
            raise
        return self

    def hold_root(self) -> None:
        """The root's one writer from here to the end of the block (waits its turn)."""
        self._held.enter_context(artifacts.writer_lock(self.root))

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # The staging folder goes (once published it is renamed away and nothing goes), and the root's lock.
        self._held.__exit__(kind, exc, traceback)

    @property
    def staging(self) -> Path:
        """The folder being written (`versions/.staging-<id>/`), inside the root so the publish is a rename."""
        if self._folder is None:
            raise RuntimeError("VersionWriter is used as a context manager: with VersionWriter(...) as writer")
        return self._folder

    @property
    def folder(self) -> Path:
        return self.staging

    def shard(self, number: int) -> ShardWriter:
        """The writer of shard `number` (its folder made in the staging folder)."""
        name = shard_name(number)
        folder = self.staging / artifacts.SHARDS / name
        folder.mkdir(parents=True, exist_ok=True)
        return ShardWriter(folder, name)

    def write_contact_sheet(self, sheet: Image.Image) -> None:
        sheet.save(self.staging / artifacts.NEIGHBOURS_FILE)

    def link_contact_sheet(self, parent: Path) -> None:
        _link_or_copy(parent / artifacts.NEIGHBOURS_FILE, self.staging / artifacts.NEIGHBOURS_FILE)

    def name_version(self, index_id: str | None = None, shards: list[ShardEntry] | None = None) -> tuple[str, str]:
        """The version's index id — the written index file's hash (a sharded version's: the hash
        of its `shards`' index hashes, in order), unless given (an index linked from the parent
        keeps its id) — and its name (`<UTC timestamp>-<index id[:8]>`)."""
        if index_id is None and shards:
            joined = "".join(entry.files.get(artifacts.INDEX_FILE, "") for entry in shards)
            index_id = hashlib.sha256(joined.encode()).hexdigest()[:16]
        elif index_id is None:
            index_id = artifacts.file_sha256(self.staging / artifacts.INDEX_FILE)[:16]
        return index_id, artifacts.new_version_name(index_id)

    def publish(self, manifest: IndexManifest, parent: str | None = None) -> Path:
        """Write `manifest`, publish the folder as `manifest.version` and make it live — `parent`:
        the version it was made from, which CURRENT must still name (`StaleParentError`
        otherwise) — then prune to the newest `keep`; returns the version's directory."""
        manifest.write(self.staging)
        target = artifacts.publish_version(self.root, self.staging, manifest.version, parent=parent)
        artifacts.prune_versions(self.root, self.keep)
        return target


@dataclass(frozen=True)
class StagedUnits:
    """The manifest's account of a new version's units as staged: its rows and deleted rows, and
    where they lie — `shards` (placed by `shard_key`), the version's own `segments`, or neither
    (one index's row files at the version's top level: a build's). `index_id`: given (a change's,
    from its segments' and tombstones' hashes), else the version is named after the index
    file(s) written (`VersionWriter.name_version`)."""

    size: int
    deleted_rows: int = 0
    shards: list[ShardEntry] | None = None
    shard_key: str | None = None
    segments: list[SegmentEntry] | None = None
    index_id: str | None = None

    @classmethod
    def of_shards(cls, entries: list[ShardEntry], shard_key: str | None, index_id: str | None = None) -> StagedUnits:
        size, deleted = sum(entry.rows for entry in entries), sum(entry.deleted_rows for entry in entries)
        return cls(size, deleted, shards=entries, shard_key=shard_key, index_id=index_id)


# Given the staging folder and its manifest (its units set: the version as staged, opened as
# `IndexVersion(folder, manifest)`), the manifest fields its measure sets: a build's
# quality figures, tuned search parameters, gate and build time; a change's gate's verdict.
Measure = Callable[[Path, IndexManifest], dict[str, Any]]


def publish_units(
    writer: VersionWriter,
    units: StagedUnits,
    described: IndexManifest,
    rows: RowCounts | None = None,
    parent: str | None = None,
    measure: Measure | None = None,
) -> tuple[Path, IndexManifest]:
    """Write the manifest of the version `writer` staged and publish it: the one place a
    manifest is assembled, for a build (one index or shards), an add, a removal, an upsert, an
    ingest and a compaction alike. `described`: what the manifest says besides its units — a
    build's model, recipe, catalog and command, or a change's parent manifest — its units,
    names, rows and creation time set here; `measure` (given the staged version) the fields it
    measures, before the version is named; `rows` the catalog's counts (None: the parent's catalog count), `indexed` the
    version's live rows. Published by the one rename, CURRENT still naming `parent` (None: a
    build, whatever is live); returns the version's directory and manifest."""
    manifest = dataclasses.replace(
        described,
        index_id="staging",
        version=writer.staging.name,
        size=units.size,
        deleted_rows=units.deleted_rows,
        shards=units.shards,
        shard_key=units.shard_key,
        segments=units.segments,
    )
    if measure is not None:
        manifest = dataclasses.replace(manifest, **measure(writer.staging, manifest))
    # Named once measured: a build's one index is written once its search effort is tuned.
    manifest.index_id, manifest.version = writer.name_version(units.index_id, units.shards)
    manifest.created = utc_now()
    if rows is None:
        rows = RowCounts(catalog=described.rows.catalog if described.rows else manifest.live_size, indexed=0)
    manifest.rows = dataclasses.replace(rows, indexed=manifest.live_size)
    return writer.publish(manifest, parent=parent), manifest


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the filesystem allows (versions are immutable once published), else a copy."""
    if not source.is_file():
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
