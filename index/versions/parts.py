"""A version's parts: its shards and its segments, each opened as a version of its own — the
sharded and segmented reading of `index.versions.version.IndexVersion`, which holds these
methods (`VersionParts` is its base), and the checks that its shard and segment folders are
those its manifest lists.

A sharded version's `shard(i)` is one shard as a version (what a shard server loads); a
segmented version's (or shard's) `segment(i)` one segment, shared by every version open in the
process that keeps it (by content: its files' sha256 and how it is searched). `_parts()` is
what the whole version's index, items, vectors, filters and tombstones are merged from.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Self

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, SegmentEntry
from core.artifacts.layout import ArtifactError
from index.versions.units import Unit, units_for_id, units_of

# Segments open in this process, by content (their files' sha256 and how they are searched): a
# version that keeps a segment of one already open shares its index, vectors and items.
_OPEN_SEGMENTS: weakref.WeakValueDictionary[tuple, VersionParts] = weakref.WeakValueDictionary()
_OPEN_SEGMENTS_LOCK = threading.Lock()


class VersionParts:
    """The shards and segments of a version (`IndexVersion`, which sets the attributes read
    here — its directory, manifest, label, checksums, and the shards and segments it opened —
    and gives its `name` and `load`)."""

    directory: Path
    manifest: IndexManifest
    _label: str | None
    _checksums: dict[str, str] | None
    _shards: dict[int, Self]
    _segments: dict[int, Self]
    _shards_lock: threading.Lock

    def _opened(self, directory: Path, manifest: IndexManifest, checksums: dict[str, str], label: str) -> Self:
        """A part (shard or segment) opened as a version of its own, its files checked against
        `checksums` as each is first read and its errors named by `label`."""
        raise NotImplementedError

    # -- shards ---------------------------------------------------------------------------------

    @property
    def shard_names(self) -> list[str]:
        """The shards' names in order ("000", "001", ...); [] for a version of one index."""
        return [entry.name for entry in self.manifest.shards or []]

    @property
    def shard_offsets(self) -> np.ndarray:
        """Each shard's first global row: global row = shard_offsets[i] + the shard's own row."""
        return np.asarray([entry.row_offset for entry in self.manifest.shards or []], dtype=np.int64)

    def shard(self, number: int) -> Self:
        """Shard `number` as a version of its own: its files, and its version's manifest with the
        shard's row counts (factory, search parameters, fields, item field and model the
        version's). Its files' checksums are checked as they are read."""
        entries = self.manifest.shards
        if not entries:
            raise ValueError(f"version {self.name} is not sharded")
        if not 0 <= number < len(entries):
            raise IndexError(f"version {self.name} has {len(entries)} shards, not shard {number}")
        with self._shards_lock:
            found = self._shards.get(number)
            if found is None:
                found = self._shards[number] = self._shard_view(number)
            return found

    def _shard_view(self, number: int) -> Self:
        entry = (self.manifest.shards or [])[number]
        view = dataclasses.replace(
            self.manifest,
            size=entry.rows,
            deleted_rows=entry.deleted_rows,
            shards=None,
            shard_key=None,
            segments=entry.segments,
        )
        return self._opened(
            self.directory / artifacts.SHARDS / entry.name, view, dict(entry.files),
            f"shard {entry.name} of version {self.name}",
        )  # fmt: skip

    def rows_of_ids(self, ids: Iterable[str]) -> dict[str, int | None]:
        """Each id's live row (None: this version does not hold it). A sharded version's are
        looked up a shard at a time, each shard's items dropped after unless the version already
        holds them, and only in the shards the ids can be in (placed by id: the ones they name):
        never as the whole version's items — what an admin write in a sharded server's ingress,
        which holds no rows, reads for its call."""
        found: dict[str, int | None] = dict.fromkeys(ids)
        if not self.manifest.shards:
            return {item_id: _row(row) for item_id, row in zip(found, self.live_rows(list(found)), strict=True)}
        homes = {i: units_for_id(self.manifest, i) for i in found}
        for unit in self.units():
            wanted = [i for i, row in found.items() if row is None and unit.number in homes[i]]
            if not wanted:
                continue
            with self._shards_lock:
                shard = self._shards.get(unit.number) or self._shard_view(unit.number)
            for item_id, row in zip(wanted, shard.live_rows(wanted), strict=True):
                found[item_id] = None if row < 0 else unit.offset + int(row)
        return found

    # -- units: what a change writes apart and a shard replica serves (index.versions.units) --------------

    def units(self) -> list[Unit]:
        """Its units, from the manifest alone: each shard, or itself when it is one index."""
        return units_of(self.manifest)

    def unit(self, number: int) -> Self:
        """Unit `number` as a version of its own: shard `number`, or this version (0) when it is
        one index."""
        if self.manifest.shards:
            return self.shard(number)
        if number != 0:
            raise IndexError(f"version {self.name} is one index, not {number + 1} shards")
        return self

    def units_for_id(self, item_id: str) -> list[int]:
        """The units that may hold `item_id` (index.versions.units.units_for_id)."""
        return units_for_id(self.manifest, item_id)

    def _shard_versions(self) -> list[Self]:
        return [self.shard(number) for number in range(len(self.shard_names))]

    # -- segments -------------------------------------------------------------------------------

    @property
    def segment_entries(self) -> list[SegmentEntry]:
        """This version's (or shard's) segments in row order; [] when its rows are not segmented."""
        return list(self.manifest.segments or [])

    def segment(self, number: int) -> Self:
        """Segment `number` as a version of its own (its rows, none deleted: the tombstones are
        this version's). The same segment, by content, is one object in a process, whichever
        version opened it first: its index, vectors and items are read once."""
        held = self._segments.get(number)
        if held is not None and held.directory.is_dir():  # each id lookup asks every segment: no key built
            return held
        entries = self.segment_entries
        if not 0 <= number < len(entries):
            raise IndexError(f"{self._what} has {len(entries)} segments, not segment {number}")
        entry = entries[number]
        directory = self.directory / artifacts.SEGMENTS / entry.name
        key = (tuple(sorted(entry.files.items())), json.dumps(self.manifest.search_params, sort_keys=True))
        with _OPEN_SEGMENTS_LOCK:
            found = self._segments.get(number) or _OPEN_SEGMENTS.get(key)
            if found is not None:
                if not found.directory.is_dir():  # its first version was pruned: read the rest from here
                    found.directory = directory
                self._segments[number] = found  # held while this version is
                return found
            view = dataclasses.replace(
                self.manifest, size=entry.rows, deleted_rows=0, shards=None, shard_key=None, segments=None
            )
            label = f"segment {entry.name} of {self._what}"
            found = self._opened(directory, view, dict(entry.files), label)
            _OPEN_SEGMENTS[key] = self._segments[number] = found
            return found

    @property
    def _what(self) -> str:
        return self._label or f"version {self.name}"

    def _parts(self) -> tuple[list[Self], np.ndarray] | None:
        """The versions this one's rows are made of — its shards, or its segments — and each
        one's first row; None for one index."""
        if self.manifest.shards:
            return self._shard_versions(), self.shard_offsets
        if self.manifest.segments:
            entries = self.segment_entries
            offsets = np.asarray([entry.row_offset for entry in entries], dtype=np.int64)
            return [self.segment(number) for number in range(len(entries))], offsets
        return None

    def _check_segments(self, dim: int | None) -> None:
        """The segment folders are those the manifest lists, their rows add up, and each loads."""
        entries = self.segment_entries
        folder = self.directory / artifacts.SEGMENTS
        present = {p.name for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()
        missing = [entry.name for entry in entries if entry.name not in present]
        if missing:
            raise ArtifactError(f"{self._what}: segment {', '.join(missing)} is missing from {folder}")
        offset = _contiguous(entries, "segment", self._what)
        if offset != self.manifest.size:
            raise ArtifactError(f"{self._what}: the manifest counts {self.manifest.size} rows; its segments {offset}")
        for number in range(len(entries)):
            self.segment(number).load(dim)

    def _check_shards(self, dim: int | None) -> None:
        """The shard folders are those the manifest lists, their row counts add up, and each
        shard loads."""
        self.check_shard_list()
        for shard in self._shard_versions():
            shard.load(dim)

    def check_shard_list(self) -> None:
        """The shard folders are those the manifest lists, and their row counts add up to its own
        (what can be checked of a sharded version without reading a row)."""
        entries = self.manifest.shards or []
        folder = self.directory / artifacts.SHARDS
        present = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        listed = [entry.name for entry in entries]
        missing = [name for name in listed if name not in present]
        unlisted = [name for name in present if name not in listed]
        if missing or unlisted:
            raise ArtifactError(
                f"{self.directory}: the manifest lists {len(listed)} shards, {folder} holds {len(present)}"
                + (f"; shard {', '.join(missing)} is missing" if missing else "")
                + (f"; shard {', '.join(unlisted)} is not in the manifest" if unlisted else "")
            )
        offset = _contiguous(entries, "shard", str(self.directory))
        deleted = sum(entry.deleted_rows for entry in entries)
        if (offset, deleted) != (self.manifest.size, self.manifest.deleted_rows):
            raise ArtifactError(
                f"{self.directory}: the manifest counts {self.manifest.size} rows, {self.manifest.deleted_rows} "
                f"deleted; its shards {offset}, {deleted} deleted"
            )

    def _check_shard_files(self) -> None:
        """A shard holds exactly the files its version's manifest lists, each as summed there."""
        present = {p.name for p in self.directory.iterdir() if p.is_file()} if self.directory.is_dir() else set()
        listed = set(self._checksums or {})
        if not self.directory.is_dir():
            raise ArtifactError(f"{self._label}: {self.directory} is missing")
        for name in sorted(listed - present):
            raise ArtifactError(f"{self._label}: {self.directory / name} is missing")
        if present - listed:
            extra = sorted(present - listed)
            raise ArtifactError(f"{self._label}: {self.directory} holds {extra}, which the manifest does not list")
        for name in sorted(listed):
            self._path(name)


def _contiguous(entries: list, kind: str, where: str) -> int:
    """The rows of `entries` (shards or segments), each starting where the ones before it end
    (ArtifactError naming the first that does not); their total."""
    offset = 0
    for entry in entries:
        if entry.row_offset != offset:
            raise ArtifactError(
                f"{where}: {kind} {entry.name} starts at row {entry.row_offset}; "
                f"the {kind}s before it hold {offset} rows"
            )
        offset += entry.rows
    return offset


def _row(row: np.integer) -> int | None:
    """A row `live_rows` found, None for its -1."""
    return None if row < 0 else int(row)
