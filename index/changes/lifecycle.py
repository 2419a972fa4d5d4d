"""Takedowns and upserts: new index versions made from the live one, without a rebuild.

A removal publishes a version holding the live one's rows less the removed ones, writing only
tombstones: the live version's segments are hard-linked, and each shard that loses rows gets a
new `deleted.npy` (`index.versions.change`), masked inside every search — a takedown writes kilobytes
whatever the catalog's size, and a version of the older formats becomes segmented on its first
removal without copying a row. Past `max_deleted_fraction` of a shard's rows deleted, or with
`compact`, the shards it touches are compacted: their live rows in one segment, an HNSW graph
rebuilt (`compact_version`, also `index compact`) — after the removal is published and the
root's writer lock let go, so the takedown is in force at once and other writers do not wait
for the merge.

An upsert (`index add --upsert`) is a removal of the rows whose ids come again, then an add.
Every removal is appended to the index root's audit log with who asked and what left.

A takedown outlives the version it was made on: making an older version live (`rollback`)
re-applies the takedowns recorded since it was built, as a takedown of that version, unless the
caller asks to restore them — audited either way (docs/operations.md, "Takedowns and rollback").
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.config import option
from index.changes.merges import merge_after_change, merge_snapshot
from index.versions.audit import REMOVE, RESTORE, ROLLBACK, audit, local_identity, returning_takedowns
from index.versions.change import ChangeReport, publish_change
from index.versions.merge_policy import TIERED, WHOLE, TieredMergePolicy
from index.versions.segments import MAX_DELETED_FRACTION, MAX_SEGMENTS, UnitChange, wants_compaction
from index.versions.units import Unit
from index.versions.version import IndexVersion

log = logging.getLogger(__name__)


@dataclass
class RemoveConfig:
    """`index remove`: take items out of the live version."""

    index_root: str = option("runs/index", help="index root (versions/ and CURRENT)")
    ids: str | None = option(None, help="file of item ids to remove, one per line, or - for standard input (required)")
    reason: str = option("", help="why, for the audit log")
    max_deleted_fraction: float = option(
        0.2, help="compact a shard (its segments merged, deleted rows dropped) once they are more than this fraction"
    )
    compact: bool = option(False, help="compact the shards the removal touches now")
    merges: str = option(
        TIERED,
        choices=(TIERED, WHOLE),
        help="tiered: the merges the tiered policy has due (a segment past "
        "--max-deleted-fraction on its own) run in the background after the removal publishes; whole: a shard past "
        "--max-deleted-fraction compacted before the command returns",
    )
    keep: int = option(5, help="versions to retain")

    def __post_init__(self) -> None:
        if not 0 <= self.max_deleted_fraction <= 1:
            raise ValueError(f"max_deleted_fraction must be within [0, 1], got {self.max_deleted_fraction}")
        if self.keep < 1:
            raise ValueError("keep must be at least 1")

    def check_inputs(self) -> None:
        if self.ids is None:
            raise ValueError("index remove needs --ids FILE (item ids, one per line; - for standard input)")
        if self.ids != STDIN:  # standard input is read once, by run_remove
            read_id_file(self.ids)


STDIN = "-"


def read_id_file(path: str | Path) -> list[str]:
    """Item ids, one per line (blank lines and `#` comments skipped), from a file or, for `-`,
    standard input; an empty list is an error."""
    if str(path) == STDIN:
        text, source = sys.stdin.read(), "--ids - (standard input)"
    else:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--ids file not found: {path}")
        text, source = path.read_text(encoding="utf-8"), f"--ids file {path}"
    ids = [line.strip() for line in text.splitlines()]
    ids = [i for i in ids if i and not i.startswith("#")]
    if not ids:
        raise ValueError(f"{source} names no item id")
    return ids


@dataclass
class RemovalReport:
    """What a removal did: the version it published (None when nothing was removed), and counts."""

    parent_version: str
    version: str | None
    requested: int
    removed: int
    not_found: list[str] = field(default_factory=list)
    size: int = 0
    deleted_rows: int = 0
    seconds: float = 0.0
    bytes_written: int = 0
    compacted_to: str | None = None  # the compaction published after the removal (size and deleted rows: its)
    touched: list[int] = field(default_factory=list, repr=False)  # the units (shards) the removal changed
    merge_pid: int | None = None  # a merge started in the background after it (`index.changes.merges`)

    def __str__(self) -> str:
        head = f"removed {self.removed} of {self.requested} requested ids"
        missing = f"; {len(self.not_found)} not in version {self.parent_version}" if self.not_found else ""
        compacted = f", compacted to {self.compacted_to}" if self.compacted_to else ""
        if self.version is None and not compacted:
            return f"{head}{missing}; nothing changed, {self.parent_version} stays live"
        published = f"published {self.version}" if self.version else f"{self.parent_version} stays"
        return f"{head}{missing}; {published}{compacted} ({self.size} items) in {self.seconds:.2f} s"


def remove_items(
    index_root: str | Path,
    ids: list[str],
    who: str,
    reason: str = "",
    via: str = "cli",
    max_deleted_fraction: float = 0.2,
    compact: bool = False,
    keep: int = 5,
    source: str | None = None,
    action: str = REMOVE,
    compact_when_due: bool = True,
    tiers: TieredMergePolicy | None = None,
) -> RemovalReport:
    """Publish the live version (or `source`, a rollback's target) less `ids`; ids not in it are
    reported, and when none is, nothing is published. Logged to the root's audit log either way,
    as `action`. When another publisher switches CURRENT meanwhile, the removal is made again
    against the version it published.

    The removal writes tombstones alone, under the root's writer lock. Compaction follows once
    the lock is let go (`compact_version`: other writers wait only for its publish) — of the
    shards the removal touched with `compact`, else of those past `max_deleted_fraction` or
    MAX_SEGMENTS, unless `compact_when_due` is off (a server starts its own, after the call).
    `tiers`: instead of that compaction, the merges this policy has due run in a background
    process (`report.merge_pid`)."""
    if not ids:
        raise ValueError("no item id to remove")
    started = time.perf_counter()

    def removal() -> RemovalReport:
        with artifacts.writer_lock(index_root):
            return _remove_once(index_root, ids, who, reason, via, compact, keep, source, action)

    report = _again_if_stale(removal, "removing again from the new live version")
    done = None
    if compact:
        done = compact_version(index_root, keep, units=set(report.touched))
    elif compact_when_due and report.version is not None and tiers is not None:
        merging = merge_after_change(index_root, keep, tiers)
        report.merge_pid = merging.pid if merging is not None else None
    elif compact_when_due and report.version is not None:
        done = compact_if_due(index_root, keep, MAX_SEGMENTS, max_deleted_fraction)
    if done is not None:
        published = IndexManifest.read(done.version)
        report.compacted_to, report.size = done.version.name, published.live_size
        report.deleted_rows = published.deleted_rows
        report.bytes_written += done.bytes_written
    report.seconds = time.perf_counter() - started
    log.info("%s", report)
    return report


ATTEMPTS = 3  # a takedown racing other publishers is made again from the version that won
T = TypeVar("T")


def _again_if_stale(step: Callable[[], T], again: str) -> T:
    """`step()`, made again (up to ATTEMPTS times) when another publisher switched CURRENT while
    it wrote: from the version that won, never over it."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return step()
        except artifacts.StaleParentError as exc:
            if attempt == ATTEMPTS:
                raise
            log.warning("%s: %s", exc, again)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _remove_once(
    index_root: str | Path,
    ids: list[str],
    who: str,
    reason: str,
    via: str,
    compact: bool,
    keep: int,
    source: str | None = None,
    action: str = REMOVE,
) -> RemovalReport:
    # A rollback derives from an older version, yet must still find CURRENT where it was.
    current = artifacts.current_version(index_root) if source is not None else None
    live = IndexVersion.open(index_root, source)
    found = live.rows_of_ids(ids)
    not_found = [item_id for item_id, row in found.items() if row is None]
    rows = np.unique(np.fromiter((r for r in found.values() if r is not None), dtype=np.int64))
    report = RemovalReport(live.name, None, len(found), len(rows), not_found, live.size, live.manifest.deleted_rows)
    by_unit = [(live.unit(unit.number), unit.own(rows)) for unit in live.units()]  # each unit's own rows
    report.touched = [
        number for number, (unit, local) in enumerate(by_unit) if len(local) or (compact and len(unit.deleted))
    ]
    if len(rows):
        changes = [UnitChange(removed=local) for _, local in by_unit]
        done = publish_change(index_root, live, changes, keep, f"removed {len(rows)} items", current=current)
        published = IndexManifest.read(done.version)
        report.version, report.size = done.version.name, published.live_size
        report.deleted_rows, report.bytes_written = published.deleted_rows, done.bytes_written
    removed_ids = [item_id for item_id, row in found.items() if row is not None]
    if action == ROLLBACK:
        reason = f"rollback to {live.name} re-applied {report.removed} takedowns → version {report.version}"
    audit(index_root, action, who, via, reason, report, removed_ids)
    return report


def compact_version(
    index_root: str | Path,
    keep: int = 5,
    on_ray: bool = True,
    only_due: bool = False,
    max_segments: int = MAX_SEGMENTS,
    max_deleted_fraction: float = MAX_DELETED_FRACTION,
    staged: Callable[[], None] | None = None,
    units: Collection[int] | None = None,
) -> ChangeReport | None:
    """Merge each shard's segments of the live version into one, its deleted rows dropped and an
    HNSW graph rebuilt — on Ray, one task a shard — and publish the result; None when nothing
    is to compact (every shard one segment without deleted rows; with `only_due`, no shard past
    `max_segments` or `max_deleted_fraction`: each said in one line), or when the compaction
    was superseded.

    Other writers are not kept waiting for it (`index.changes.merges.merge_snapshot`: a pinned
    snapshot merged without the root's writer lock, rebased onto what they published
    meanwhile, or superseded). `staged`: called between the merge and the publish (tests pause
    here). `units`: only these shards (by number), due or not."""

    def choose(live: IndexVersion) -> tuple[list[UnitChange], str] | None:
        changes, held = [], []
        for part in live.units():
            if units is not None:
                wanted = part.number in units
            else:
                unit = live.unit(part.number)
                wanted = not only_due or wants_compaction(unit, UnitChange(), max_segments, max_deleted_fraction)
            has_work = part.segments > 1 or part.deleted > 0
            changes.append(UnitChange(compact=has_work and wanted))
            held.append(_holds(part, bool(live.manifest.shards)))
        if not any(change.compact for change in changes):
            if not only_due:
                log.info("nothing to compact: every shard of %s is one segment without deleted rows", live.name)
            else:
                thresholds = f"--max-segments {max_segments} or --max-deleted-fraction {max_deleted_fraction:g}"
                log.info("nothing to compact in %s: %s — none past %s; nothing published",
                         live.name, "; ".join(held), thresholds)  # fmt: skip
            return None
        count = len(changes)
        return changes, f"compacted {sum(c.compact for c in changes)} of {count} shard{'s' if count > 1 else ''}"

    return merge_snapshot(index_root, keep, choose, on_ray=on_ray, staged=staged)


def _holds(part: Unit, sharded: bool) -> str:
    """What a unit holds, for the line that says why it was not compacted."""
    label = f"shard {part.number}" if sharded else "the index"
    segments = f"{part.segments} segment{'s' if part.segments != 1 else ''}"
    share = part.deleted / part.rows if part.rows else 0.0
    return f"{label} holds {segments}, {part.deleted} of {part.rows} rows deleted ({share:.0%})"


def compact_if_due(
    index_root: str | Path, keep: int, max_segments: int, max_deleted_fraction: float
) -> ChangeReport | None:
    """Compaction after a change, of the shards past `max_segments` or `max_deleted_fraction`;
    its report, or None when none is due."""
    return compact_version(index_root, keep, on_ray=True, only_due=True, max_segments=max_segments,
                           max_deleted_fraction=max_deleted_fraction)  # fmt: skip


@dataclass
class RollbackReport:
    """What making `target` live did: the version now live (`target`, or one derived from it
    without the takedowns made since), and the ids it re-applied or restored."""

    target: str
    previous: str | None
    version: str
    reapplied: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.reapplied:
            return (
                f"rollback to {self.target} re-applied {len(self.reapplied)} takedowns → version {self.version} "
                "(--restore-taken-down to republish them)"
            )
        if self.restored:
            more = len(self.restored) - 5
            shown = ", ".join(self.restored[:5]) + (f" +{more} more" if more > 0 else "")
            return f"rollback to {self.target} restored {len(self.restored)} taken-down items ({shown})"
        return f"rollback to {self.target}: no takedown since it was built"


def rollback(
    index_root: str | Path,
    version: str,
    who: str,
    via: str = "cli",
    restore_taken_down: bool = False,
    keep: int = 5,
    make_current: bool = True,
) -> RollbackReport:
    """Make `version` live again without republishing what was taken down after it was built: a
    takedown outlives the version it was made on. Those takedowns are re-applied as a takedown
    of `version` (a new version derived from it, published like any takedown, audited as a
    rollback); `restore_taken_down` makes `version` itself live, audited with the ids it
    restores. `make_current` False (a server's Reload of a named version) leaves CURRENT alone
    unless a version is published."""
    artifacts.version_dir(index_root, version)  # names a version that is not there
    previous = artifacts.current_version(index_root)
    back = returning_takedowns(index_root, version)
    if back and not restore_taken_down:
        removal = remove_items(index_root, back, who, via=via, keep=keep, source=version, action=ROLLBACK)
        report = RollbackReport(version, previous, removal.compacted_to or removal.version or version, reapplied=back)
    else:
        if make_current:
            with artifacts.current_lock(index_root):
                artifacts.set_current(index_root, version)
        report = RollbackReport(version, previous, version, restored=back)
        if back:
            summary = RemovalReport(version, version, len(back), 0)
            audit(index_root, RESTORE, who, via, str(report), summary, back)
    log.info("%s", report)
    return report


def run_remove(cfg: RemoveConfig) -> RemovalReport:
    """`index remove`: the report (logged by `remove_items`); ValueError when none of the ids is in
    the live version, so a takedown that took nothing down does not pass for one."""
    cfg.check_inputs()
    report = remove_items(
        cfg.index_root,
        read_id_file(cfg.ids),
        local_identity(),
        cfg.reason,
        "cli",
        cfg.max_deleted_fraction,
        cfg.compact,
        cfg.keep,
        tiers=TieredMergePolicy(max_deleted_share=cfg.max_deleted_fraction) if cfg.merges == TIERED else None,
    )
    if report.version is None:
        raise ValueError(
            f"none of the {report.requested} ids is in version {report.parent_version}, e.g. "
            f"{report.not_found[0]!r} (never indexed, or removed already; an id is the catalog's id column, or "
            "for a folder the image's path relative to it): nothing was published"
        )
    return report
