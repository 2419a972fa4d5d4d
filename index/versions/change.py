"""A new version made from the live one by changing its units: an add (`index add`, an
ingest), a removal (a takedown, a rollback's), an upsert, a compaction.

Each unit a change touches is written by `index.versions.segments.write_unit` — on Ray, one
task a unit, for a compaction — the others hard-linked whole; the units as staged are counted
(`StagedUnits`) and the version published through the one publish path
(`index.versions.version_writer.publish_units`), its manifest the parent's with the new units,
and a compaction rebased first onto what was published while it ran (`index.versions.rebase`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import MAX_ANCESTORS, IndexManifest, QualityGate, RowCounts, SegmentEntry, ShardEntry
from index.search.filters import FieldSpec, specs_of
from index.versions.rebase import onto_live
from index.versions.segments import UnitChange, UnitWritten, write_unit
from index.versions.units import segment_counts
from index.versions.version import IndexVersion
from index.versions.version_writer import (
    ShardWriter,
    StagedUnits,
    VersionWriter,
    publish_units,
    segment_name,
    shard_name,
)

log = logging.getLogger(__name__)


@dataclass
class ChangeReport:
    """What a segmented change wrote: the version, and how many bytes it wrote (new files; hard
    links cost none)."""

    version: Path
    bytes_written: int
    seconds: float
    peak_task_rss: int = 0  # the largest peak resident bytes of the Ray tasks that wrote the units
    compacted_to: Path | None = None  # a compaction published right after it (what CURRENT then names)
    merge_pid: int | None = None  # a merge started in the background after it (`index.changes.merges`)

    @property
    def live_version(self) -> Path:
        """The version this change left live: its own, or the compaction's that followed it."""
        return self.compacted_to or self.version


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
        base = onto_live(index_root, writer, live, written, staged) if rebase else live
        units = _staged_units(writer, base, written)
        writer.link_contact_sheet(base.directory)
        described = dataclasses.replace(
            base.manifest,
            parent_version=base.name,
            ancestors=[base.name, *(base.manifest.ancestors or [])][:MAX_ANCESTORS],
            model_id=model_id or base.manifest.model_id,
            quality_gate=QualityGate(passed=True, reasons=[f"not gated: {what}; quality figures of {base.name}"]),
        )
        measure = None
        if gate is not None:
            measure = lambda folder, staged_manifest: {  # noqa: E731
                "quality_gate": gate(IndexVersion(folder, staged_manifest), _new_rows(base, staged_manifest))
            }
        written_bytes = _bytes_written(writer.staging)
        target, manifest = publish_units(writer, units, described, rows, parent=current or base.name, measure=measure)
    peak = max((unit.peak_rss for unit in written.values()), default=0)
    report = ChangeReport(target, written_bytes, time.perf_counter() - started, peak)
    segments = sum(segment_counts(manifest))
    log.info(
        "published index %s (%d items, %d segment%s%s): %s%s, wrote %s in %.2f s",
        manifest.version, manifest.live_size, segments, "" if segments == 1 else "s",
        f", {manifest.deleted_rows} deleted" if manifest.deleted_rows else "", what,
        f" (rebased from {live.name} onto {base.name})" if base.name != live.name else "", _megabytes(written_bytes),
        report.seconds,
    )  # fmt: skip
    return report


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


def _staged_units(writer: VersionWriter, base: IndexVersion, written: dict[int, UnitWritten]) -> StagedUnits:
    """The version's units as written — its own segments, or its shards (untouched ones linked
    whole from `base`) — and its index id, from its segments' and tombstones' hashes."""
    if not base.manifest.shards:
        unit = written[0]
        index_id = _index_id([_sums(unit.segments, unit.files)])
        return StagedUnits(unit.rows, unit.deleted, segments=unit.segments, index_id=index_id)
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
    index_id = _index_id([_shard_sums(entry) for entry in entries])
    return StagedUnits.of_shards(entries, base.manifest.shard_key, index_id)


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
