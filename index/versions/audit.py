"""The index root's audit log (`audit.jsonl`): who took which items down, through what and why,
and what a rollback re-applied or restored — what `index list`, the console and a build read to
know what was taken down, and what making an older version live would bring back."""

from __future__ import annotations

import getpass
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from core.artifacts.layout import utc_now
from index.versions.version import IndexVersion

log = logging.getLogger(__name__)

AUDIT_LOG = "audit.jsonl"  # in the index root: one JSON line per removal, rollback or restore
REMOVE, ROLLBACK, RESTORE = "remove", "rollback", "restore"  # the audit log's actions


class AuditedChange(Protocol):
    """What an audit line records of a change (`index.changes.lifecycle.RemovalReport`)."""

    parent_version: str | None
    version: str | None
    requested: int
    removed: int
    not_found: list[str]


def audit(
    index_root: str | Path, action: str, who: str, via: str, reason: str, report: AuditedChange, ids: list[str]
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
    held = IndexVersion.open(index_root, version).rows_of_ids(sorted(since))
    return sorted(item_id for item_id, row in held.items() if row is not None)


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
