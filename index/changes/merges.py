"""Merges of a version's segments: chosen, run beside other writers, and run in the background.

A merge — a compaction of whole shards (`index compact`), or the merges a tiered policy
chooses (`index.versions.merge_policy`) — merges a snapshot of the live version without the
root's writer lock (`merge_snapshot`: pinned, so no writer prunes it), and is rebased onto what
was published meanwhile (`index.versions.rebase`) or, when the live version no longer grew from
it, superseded: one warning line, nothing published.

`index add` and `index remove` do not wait for a merge: once they have published, a merge that
falls due runs in a process of its own (`start_background_merge`: `index compact --tiered`,
detached, at a lower CPU priority), which merges until none is due. One merge process at a time
a root (`merge_lock`, an flock the kernel lets go when its holder dies): a second one started
meanwhile leaves at once, and the first looks again after letting the lock go, so what a change
made due while it merged is merged too. Each merge it publishes is a line of the root's
`merges.jsonl`; its log lines go to the root's `merges.log`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core.artifacts import layout as artifacts
from core.artifacts.layout import utc_now
from index.versions.change import ChangeReport, publish_change
from index.versions.merge_policy import TieredMergePolicy, segment_sizes
from index.versions.rebase import Superseded
from index.versions.segments import UnitChange
from index.versions.version import IndexVersion

log = logging.getLogger(__name__)

MERGE_LOCK = ".merge.lock"  # in the index root: flock'd by the one process merging
MERGE_LOG = "merges.log"  # in the index root: the background merges' log lines
MERGE_RECORDS = "merges.jsonl"  # in the index root: one JSON line per merge published
BACKGROUND_NICE = 10  # a merge yields the CPU to searches and to the writers' publishes


def merge_snapshot(
    index_root: str | Path,
    keep: int,
    choose: Callable[[IndexVersion], tuple[list[UnitChange], str] | None],
    on_ray: bool = False,
    staged: Callable[[], None] | None = None,
) -> ChangeReport | None:
    """The merge `choose` picks in the live version (its unit changes and what it is called;
    None: nothing to merge), made on a pinned snapshot without the root's writer lock, rebased
    and published; None when nothing was chosen or the merge was superseded. `staged`: called
    between the merge and the publish (tests pause here)."""
    with artifacts.pinned_version(index_root) as name:
        live = IndexVersion.open(index_root, name)
        chosen = choose(live)
        if chosen is None:
            return None
        changes, what = chosen
        try:
            return publish_change(index_root, live, changes, keep, what, on_ray=on_ray, rebase=True, staged=staged)
        except (Superseded, artifacts.StaleParentError) as exc:
            log.warning("merge of %s superseded by %s: %s; nothing published", name,
                        artifacts.current_version(index_root), exc)  # fmt: skip
            return None


def tiered_changes(version: IndexVersion, policy: TieredMergePolicy) -> tuple[list[UnitChange], str] | None:
    """The merges `policy` chooses in each unit of `version` (one a unit at most), and what they
    are called; None when none is due."""
    changes, said = [], []
    for part in version.units():
        unit = version.unit(part.number)
        rows = [entry.rows for entry in unit.segment_entries] or [part.rows]
        merge = policy.choose(segment_sizes(rows, unit.deleted))
        if merge is None:
            changes.append(UnitChange())
            continue
        changes.append(UnitChange(compact=True) if merge.whole(len(rows)) else UnitChange(merge=merge.segments))
        label = f"shard {part.number}: " if version.manifest.shards else ""
        said.append(f"{label}{len(merge.segments)} of {len(rows)} segments ({merge.reason})")
    if not said:
        return None
    return changes, "merged " + "; ".join(said)


def merge_due(version: IndexVersion, policy: TieredMergePolicy) -> bool:
    """Whether `policy` would merge something in `version` now."""
    return tiered_changes(version, policy) is not None


@contextlib.contextmanager
def merge_lock(index_root: str | Path, wait: bool = False) -> Iterator[bool]:
    """The root's merge lock for the block: True when this process holds it, False when another
    does (with `wait`, it waits its turn instead)."""
    with open(Path(index_root) / MERGE_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def merge_tiers(
    index_root: str | Path, keep: int, policy: TieredMergePolicy, on_ray: bool = False, most: int = 1000
) -> list[ChangeReport]:
    """Merge what `policy` chooses in the live version until none is due (at most `most`
    merges), holding the root's merge lock; nothing when another process holds it (it looks
    again once it lets it go). Each merge published is recorded in the root's merges.jsonl."""
    done: list[ChangeReport] = []
    while len(done) < most:
        with merge_lock(index_root) as held:
            if not held:
                log.info("a merge of %s is running already: it merges what is due", index_root)
                return done
            while len(done) < most:
                merged = merge_snapshot(index_root, keep, lambda live: tiered_changes(live, policy), on_ray)
                if merged is None:
                    break
                done.append(merged)
                _record(index_root, merged)
        # A change published while the lock was held may have left its merge to this process.
        if not merge_due(IndexVersion.open(index_root), policy):
            break
    return done


def _record(index_root: str | Path, report: ChangeReport) -> None:
    entry = {"time": utc_now(), "pid": os.getpid(), "version": report.version.name,
             "bytes_written": report.bytes_written, "seconds": round(report.seconds, 3)}  # fmt: skip
    with open(Path(index_root) / MERGE_RECORDS, "a", encoding="utf-8") as records:
        records.write(json.dumps(entry) + "\n")


def merge_records(index_root: str | Path) -> list[dict]:
    """The merges published in the root, oldest first (merges.jsonl)."""
    path = Path(index_root) / MERGE_RECORDS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class BackgroundMerge:
    """A merge process started after a change: its pid and where it logs."""

    pid: int
    log: Path

    def __str__(self) -> str:
        return (
            f"a merge was started in the background (pid {self.pid}): its log is {self.log}, "
            f"each merge it publishes a line of {self.log.with_name(MERGE_RECORDS)}"
        )


def merge_command(index_root: str | Path, keep: int, policy: TieredMergePolicy) -> list[str]:
    """The `index compact --tiered` command line that merges what `policy` has due in `index_root`."""
    return [
        sys.executable, "-m", "index", "compact", "--index-root", str(index_root), "--tiered", "--keep", str(keep),
        "--tier-factor", str(policy.tier_factor), "--segments-per-tier", str(policy.segments_per_tier),
        "--base-merge-share", str(policy.base_merge_share), "--max-deleted-fraction", str(policy.max_deleted_share),
        "--no-progress",
    ]  # fmt: skip


def start_background_merge(index_root: str | Path, keep: int, policy: TieredMergePolicy) -> BackgroundMerge:
    """`index compact --tiered` in a detached process of its own (its own session: a caller's
    Ctrl-C or exit does not end it), logging to the root's merges.log."""
    command = merge_command(index_root, keep, policy)
    path = Path(index_root) / MERGE_LOG
    with open(path, "a", encoding="utf-8") as log_file:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True
        )
    return BackgroundMerge(process.pid, path)


def merge_after_change(index_root: str | Path, keep: int, policy: TieredMergePolicy) -> BackgroundMerge | None:
    """After a change published: a background merge when `policy` has one due, else None."""
    if not merge_due(IndexVersion.open(index_root), policy):
        return None
    started = start_background_merge(index_root, keep, policy)
    log.info("%s", started)
    return started


def lower_priority() -> None:
    """This process yields the CPU to searches and writers (a background merge's)."""
    with contextlib.suppress(OSError):
        os.nice(BACKGROUND_NICE)
