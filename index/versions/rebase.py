"""A compaction — or a tiered merge — rebased onto what was published while it ran.

A compaction merges a snapshot of the live version without the root's writer lock, which it
takes only to publish (`index.changes.lifecycle.compact_version`). By then other writers may have
published: adds append segments, removals and takedowns delete rows. `onto_live` takes the root
and rebases the merged units onto the version live then — the merged segment, then the
segments appended meanwhile, renumbered after every segment the live version has, and the rows
deleted meanwhile mapped onto them — or, when the live version did not grow from the snapshot
(a rollback, another compaction, a rebuild), raises `Superseded` and nothing is published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import SegmentEntry
from index.versions.merge_rows import MergedLayout
from index.versions.segments import UnitWritten, unit_files
from index.versions.version import IndexVersion
from index.versions.version_writer import ShardWriter, VersionWriter, rows_as_segment, segment_name


class Superseded(artifacts.ArtifactError):
    """A compaction's snapshot is no longer what the live version grew from (a rollback, another
    compaction, a rebuild): its work does not apply, and nothing is published."""


def _unit_writer(writer: VersionWriter, version: IndexVersion, number: int) -> VersionWriter | ShardWriter:
    return writer.shard(number) if version.manifest.shards else writer


def onto_live(
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
    merged: UnitWritten,
) -> UnitWritten:
    """A unit's `merged` segments — the snapshot's (`grown_from`) with a group of them merged
    into one, in the place of the group's first (every one: a compaction) — rebased onto
    `live`, the unit as published meanwhile (its segments `live_segments`, as `_segments_of`
    reads them), which must be the snapshot's segments with segments appended and rows deleted
    (what adds, removals and takedowns make; `Superseded` otherwise): the merged segment and
    those after it numbered after every segment `live` has (a segment's number grows along
    the list and is never reused), then `live`'s appended segments hard-linked, numbered on,
    and `live`'s deletions mapped onto those rows — a row removed while the merge ran stays
    removed."""
    was_deleted, now_deleted = snapshot.deleted, live.deleted
    if live_segments[: len(grown_from)] != grown_from or len(np.setdiff1d(was_deleted, now_deleted)):
        raise Superseded("its segments were replaced or deleted rows restored (a rollback, a compaction, a rebuild)")
    layout = merged.layout
    assert layout is not None, "a rebase is of a merge"
    first = layout.group[0]
    shift = int(live_segments[-1].name) - int(grown_from[-1].name)
    renamed = list(merged.segments)
    # Numbers only grow: renamed from the last, each one's new name was the one after it's.
    for at in range(len(renamed) - 1, first - 1, -1) if shift else ():
        renamed[at] = writer.rename_segment(renamed[at], segment_name(int(renamed[at].name) + shift))
    number = int(renamed[-1].name)
    for entry in live_segments[len(grown_from) :]:
        number += 1
        writer.link_segment(live.directory, entry, segment_name(number))
        renamed.append(dataclasses.replace(entry, name=segment_name(number)))
    entries, offset = [], 0
    for entry in renamed:
        entries.append(dataclasses.replace(entry, row_offset=offset))
        offset += entry.rows
    onto = MergedLayout(tuple(entry.rows for entry in live_segments), layout.group, layout.kept)
    deleted = onto.rows(now_deleted)
    writer.write_deleted(deleted)
    return UnitWritten(entries, len(deleted), unit_files(writer), merged.peak_rss, onto)
