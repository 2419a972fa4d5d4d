"""Takedowns and upserts: new index versions made from the live one, without a rebuild.

A removal publishes a version holding the live one's rows less the removed ones, reusing the
live vectors and index for everything else. How the rows leave depends on what the index can do:

- Flat and the other flat-code indexes (PQ, SQ) drop them (`remove_ids`), which keeps the order
  of the rest: row r of the new version is the r-th surviving row.
- IVF indexes drop them from their inverted lists and renumber the ids left, so rows stay 0..n-1
  (the items table and `embeddings.npy` are positional).
- HNSW cannot drop a node from its graph: the rows stay, listed in `deleted.npy` (tombstones)
  and masked inside every search; the index, vectors and items files are hard-linked from the
  live version, so a takedown writes a few kilobytes whatever the catalog's size. Past
  `max_deleted_fraction` of tombstones the graph is rebuilt without them (compaction).

An upsert (`index add --upsert`) is a removal of the rows whose ids come again, then an add.
Every removal is appended to the index root's audit log with who asked and what left.

A takedown outlives the version it was made on: making an older version live (`rollback`)
re-applies the takedowns recorded since it was built, as a takedown of that version, unless the
caller asks to restore them — audited either way (docs/operations.md, "Takedowns and rollback").
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from core import artifacts
from core.artifacts import utc_now
from core.config import option
from core.items import ItemTable
from core.manifests import IndexManifest, QualityGate, RowCounts
from index.faiss_index import build_index, emptied_index, empty_index, ivf_of
from index.filters import FilterIndex, specs_of
from index.sharding import ShardPart, ShardRows, write_parts
from index.version import IndexVersion
from index.version_writer import VersionWriter

log = logging.getLogger(__name__)

AUDIT_LOG = "audit.jsonl"  # in the index root: one JSON line per removal, rollback or restore
REMOVE, ROLLBACK, RESTORE = "remove", "rollback", "restore"  # the audit log's actions


@dataclass
class RemoveConfig:
    """`index remove`: take items out of the live version."""

    index_root: str = option("runs/index", help="index root (versions/ and CURRENT)")
    ids: str | None = option(None, help="file of item ids to remove, one per line, or - for standard input (required)")
    reason: str = option("", help="why, for the audit log")
    max_deleted_fraction: float = option(
        0.2, help="HNSW: rebuild the graph without its removed rows once they are more than this fraction"
    )
    compact: bool = option(False, help="HNSW: rebuild the graph without its removed rows now")
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
class Remaining:
    """A version's rows less some: the index, vectors and items of what is left, and which rows
    of them are tombstones (HNSW). `reuses_files`: index, vectors and items are the live
    version's files unchanged (only the tombstones differ)."""

    index: faiss.Index | None  # None: the live version's, unchanged (`reuses_files`)
    vectors: np.ndarray
    items: ItemTable
    deleted: np.ndarray
    removed: int
    compacted: bool = False

    @property
    def reuses_files(self) -> bool:
        return self.index is None


def how_rows_leave(manifest: IndexManifest) -> str:
    """'compact' (flat codes drop rows in order), 'ivf' (dropped, the rest renumbered) or
    'tombstone' (the index cannot drop them: HNSW and other graphs). Told from an empty index
    of the same factory string, so a takedown need not read the live index to decide."""
    index = empty_index(manifest.dimension, manifest.factory)
    ivf = ivf_of(index)
    if ivf is not None:
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        return "ivf" if isinstance(lists, faiss.ArrayInvertedLists) else "tombstone"
    return "compact" if isinstance(faiss.downcast_index(index), faiss.IndexFlatCodes) else "tombstone"


def _renumber_ivf(index: faiss.Index, dropped: np.ndarray) -> None:
    """After `remove_ids`, an IVF's lists still hold the old ids: shift each past the dropped
    ones below it, so the ids are rows 0..n-1 again (in place, list by list)."""
    ivf = faiss.extract_index_ivf(index)
    lists = ivf.invlists
    for number in range(ivf.nlist):
        size = lists.list_size(number)
        if size:
            ids = faiss.rev_swig_ptr(lists.get_ids(number), size)  # a view of the list's ids
            ids -= np.searchsorted(dropped, ids)
    if ivf.direct_map.type != faiss.DirectMap.NoMap:
        ivf.make_direct_map(True)


def drop_rows(
    live: IndexVersion, rows: np.ndarray, max_deleted_fraction: float = 0.2, compact: bool = False
) -> Remaining:
    """`live` without `rows` (sorted, live rows): dropped from the index where it can, else
    tombstoned — and the graph rebuilt without its tombstones once they pass the fraction."""
    rows = np.asarray(rows, dtype=np.int64)
    mode = how_rows_leave(live.manifest)
    if mode == "tombstone":
        deleted = np.union1d(live.deleted, rows)
        if not compact and len(deleted) <= max_deleted_fraction * len(live.items):
            return Remaining(None, live.vectors, live.items, deleted, len(rows))
        keep = np.setdiff1d(np.arange(len(live.items)), deleted)
        vectors = np.ascontiguousarray(live.vectors[keep])
        manifest = live.manifest
        started = time.perf_counter()
        if len(keep):
            index = build_index(vectors, manifest.factory, manifest.search_params, None, manifest.built_on or "auto")
        else:  # every row gone (a shard a takedown emptied): nothing to build a graph of
            index = emptied_index(live.read_index())
        seconds = time.perf_counter() - started
        log.info("compacted %s: %d removed rows out, graph rebuilt in %.1f s", live.name, len(deleted), seconds)
        return Remaining(index, vectors, live.items.take(keep), np.zeros(0, np.int64), len(rows), compacted=True)
    index = live.read_index()
    dropped = np.union1d(live.deleted, rows)  # a version with tombstones of another kind: drop them too
    index.remove_ids(faiss.IDSelectorBatch(dropped))
    if mode == "ivf":
        _renumber_ivf(index, dropped)
    keep = np.setdiff1d(np.arange(len(live.items)), dropped)
    vectors = np.ascontiguousarray(live.vectors[keep])
    return Remaining(index, vectors, live.items.take(keep), np.zeros(0, np.int64), len(rows))


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

    def __str__(self) -> str:
        head = f"removed {self.removed} of {self.requested} requested ids"
        missing = f"; {len(self.not_found)} not in version {self.parent_version}" if self.not_found else ""
        if self.version is None:
            return f"{head}{missing}; nothing changed, {self.parent_version} stays live"
        return f"{head}{missing}; published {self.version} ({self.size} items) in {self.seconds:.2f} s"


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
) -> RemovalReport:
    """Publish the live version (or `source`, a rollback's target) less `ids`; ids not in it are
    reported, and when none is, nothing is published. Logged to the root's audit log either way,
    as `action`. When another publisher switches CURRENT meanwhile, the removal is made again
    against the version it published."""
    if not ids:
        raise ValueError("no item id to remove")
    attempt = 1
    while True:
        try:
            return _remove_once(index_root, ids, who, reason, via, max_deleted_fraction, compact, keep, source, action)
        except artifacts.StaleParentError as exc:
            if attempt == ATTEMPTS:
                raise
            attempt += 1
            log.warning("%s: removing again from the new live version", exc)


ATTEMPTS = 3  # a takedown racing other publishers is made again from the version that won


def _remove_once(
    index_root: str | Path,
    ids: list[str],
    who: str,
    reason: str,
    via: str,
    max_deleted_fraction: float,
    compact: bool,
    keep: int,
    source: str | None = None,
    action: str = REMOVE,
) -> RemovalReport:
    started = time.perf_counter()
    # A rollback derives from an older version, yet must still find CURRENT where it was.
    current = artifacts.current_version(index_root) if source is not None else None
    live = IndexVersion.open(index_root, source)
    found = {item_id: live.row_of(item_id) for item_id in dict.fromkeys(ids)}
    not_found = [item_id for item_id, row in found.items() if row is None]
    rows = np.unique(np.fromiter((r for r in found.values() if r is not None), dtype=np.int64))
    report = RemovalReport(live.name, None, len(found), len(rows), not_found, live.size, len(live.deleted))
    if (len(rows) or (compact and len(live.deleted))) and live.manifest.shards:
        parts = drop_shard_rows(live, rows, max_deleted_fraction, compact)
        target = publish_remaining_shards(index_root, live, parts, keep, f"removed {len(rows)} items", current)
        published = IndexManifest.read(target)
        report.version, report.size, report.deleted_rows = target.name, published.live_size, published.deleted_rows
    elif len(rows) or (compact and len(live.deleted)):
        remaining = drop_rows(live, rows, max_deleted_fraction, compact)
        target = publish_remaining(index_root, live, remaining, keep, f"removed {len(rows)} items", current)
        published = IndexManifest.read(target)
        report.version, report.size, report.deleted_rows = target.name, published.live_size, published.deleted_rows
    report.seconds = time.perf_counter() - started
    removed_ids = [item_id for item_id, row in found.items() if row is not None]
    if action == ROLLBACK:
        reason = f"rollback to {live.name} re-applied {report.removed} takedowns → version {report.version}"
    audit(index_root, action, who, via, reason, report, removed_ids)
    log.info("%s", report)
    return report


def publish_remaining(
    index_root: str | Path, live: IndexVersion, remaining: Remaining, keep: int, what: str, current: str | None = None
) -> Path:
    """Publish `remaining` as a new version of `index_root`, its manifest `live`'s with the
    counts, parent and tombstones of this one; CURRENT must still name `current` (default:
    `live`, the version the rows came from; a rollback derives from an older one). Not gated: a
    takedown is never refused for quality; the quality figures are the parent's (a removal only
    takes answers away)."""
    with VersionWriter(index_root, keep) as writer:
        if remaining.reuses_files:
            writer.link_rows(live.directory)
            index_id = live.manifest.index_id
        else:
            writer.write_index(remaining.index)
            writer.write_vectors(remaining.vectors)
            writer.write_items(remaining.items)
            specs = specs_of(live.manifest.filterable)
            if specs:  # the filters' value → rows structure describes the rows left
                writer.write_filters(FilterIndex.build(remaining.items, specs))
            index_id = None  # the written index's hash
        writer.write_deleted(remaining.deleted)
        writer.link_contact_sheet(live.directory)
        index_id, version = writer.name_version(index_id)
        parent = live.manifest
        manifest = dataclasses.replace(
            parent,
            index_id=index_id,
            version=version,
            size=len(remaining.items),
            created=utc_now(),
            quality_gate=QualityGate(passed=True, reasons=[f"not gated: {what}; quality figures of {live.name}"]),
            parent_version=live.name,
            deleted_rows=len(remaining.deleted),
        )
        catalog_rows = parent.rows.catalog if parent.rows else manifest.live_size
        manifest.rows = RowCounts(catalog=catalog_rows, indexed=manifest.live_size)
        return writer.publish(manifest, parent=current or live.name)


def drop_shard_rows(
    live: IndexVersion, rows: np.ndarray, max_deleted_fraction: float = 0.2, compact: bool = False
) -> list[ShardPart]:
    """A sharded `live` without `rows` (global rows): each shard holding some of them loses
    them as `drop_rows` drops them from one index; the others are unchanged (to be linked)."""
    parts = []
    for number, (entry, offset) in enumerate(zip(live.manifest.shards or [], live.shard_offsets, strict=True)):
        shard = live.shard(number)
        local = rows[(rows >= offset) & (rows < offset + entry.rows)] - offset
        if not len(local) and not (compact and entry.deleted_rows):
            parts.append(ShardPart(None, shard.directory, entry))
            continue
        left = drop_rows(shard, local, max_deleted_fraction, compact)
        if left.reuses_files:
            parts.append(ShardPart(None, shard.directory, entry, deleted=left.deleted))
        else:
            parts.append(ShardPart(ShardRows(left.index, left.vectors, left.items, left.deleted)))
    return parts


def publish_remaining_shards(
    index_root: str | Path, live: IndexVersion, parts: list[ShardPart], keep: int, what: str, current: str | None = None
) -> Path:
    """`publish_remaining` for a sharded version: the shards that lost rows rewritten, the
    others' files hard-linked, the whole published by one rename."""
    with VersionWriter(index_root, keep) as writer:
        entries = write_parts(writer, parts, specs_of(live.manifest.filterable))
        writer.link_contact_sheet(live.directory)
        index_id, version = writer.name_version(shards=entries)
        parent = live.manifest
        manifest = dataclasses.replace(
            parent,
            index_id=index_id,
            version=version,
            size=sum(entry.rows for entry in entries),
            created=utc_now(),
            quality_gate=QualityGate(passed=True, reasons=[f"not gated: {what}; quality figures of {live.name}"]),
            parent_version=live.name,
            deleted_rows=sum(entry.deleted_rows for entry in entries),
            shards=entries,
        )
        catalog_rows = parent.rows.catalog if parent.rows else manifest.live_size
        manifest.rows = RowCounts(catalog=catalog_rows, indexed=manifest.live_size)
        return writer.publish(manifest, parent=current or live.name)


def audit(
    index_root: str | Path, action: str, who: str, via: str, reason: str, report: RemovalReport, ids: list[str]
) -> None:
    """Append one JSON line to the root's audit log: when, who, through what, why, and what left."""
    entry = {
        "time": utc_now(),
        "action": action,
        "who": who,
        "via": via,
        "reason": reason,
        "parent_version": report.parent_version,
        "version": report.version,
        "requested": report.requested,
        "removed": report.removed,
        "not_found": report.not_found,
        "ids": ids,
    }
    with open(Path(index_root) / AUDIT_LOG, "a", encoding="utf-8") as log_file:
        log_file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        log_file.flush()
        os.fsync(log_file.fileno())


def audit_entries(index_root: str | Path) -> list[dict]:
    """The root's audit log, oldest entry first (none when nothing was ever removed)."""
    path = Path(index_root) / AUDIT_LOG
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as log_file:
        return [json.loads(line) for line in log_file if line.strip()]


def taken_down(index_root: str | Path, since: str | None = None) -> set[str]:
    """Ids the root's audit log says are taken down: removed (by a takedown, or by a rollback
    that re-applied takedowns) and not restored since. `since`: only takedowns that published a
    version after that one (version names sort by the time they were made)."""
    ids: set[str] = set()
    for entry in audit_entries(index_root):
        action = entry.get("action")
        if action in (REMOVE, ROLLBACK) and (since is None or (entry.get("version") or "") > since):
            ids.update(entry.get("ids", []))
        elif action == RESTORE:
            ids.difference_update(entry.get("ids", []))
    return ids


def returning_takedowns(index_root: str | Path, version: str) -> list[str]:
    """Ids `version` holds that were taken down after it was built: what making it live again
    would republish."""
    since = taken_down(index_root, version)
    if not since:
        return []
    target = IndexVersion.open(index_root, version)
    mask = target.live_mask
    return sorted({i for r, i in enumerate(target.items.ids) if i in since and (mask is None or mask[r])})


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
        report = RollbackReport(version, previous, removal.version or version, reapplied=back)
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


def warn_of_returning_items(index_root: str | Path, ids: Iterable[str]) -> int:
    """A build from a catalog that still lists items taken down brings them back: say so."""
    removed = taken_down(index_root)
    if not removed:
        return 0
    back = [item_id for item_id in ids if item_id in removed]
    if back:
        log.warning(
            "%d items of this version were taken down earlier (%s; e.g. %s) and are back: remove them "
            "from the catalog, or run index remove again",
            len(back),
            Path(index_root) / AUDIT_LOG,
            ", ".join(back[:3]),
        )
    return len(back)


def local_identity() -> str:
    """Who runs a command on this machine, for the audit log."""
    try:
        return f"user:{getpass.getuser()}"
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"


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
    )
    if report.version is None:
        raise ValueError(
            f"none of the {report.requested} ids is in version {report.parent_version}, e.g. "
            f"{report.not_found[0]!r} (never indexed, or removed already; an id is the catalog's id column, or "
            "for a folder the image's path relative to it): nothing was published"
        )
    return report
