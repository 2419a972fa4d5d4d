"""`index list`: each version in one line — what made it, its size, shards and segments (and
their rows), its recipe and its quality figures, marked carried where a change kept its
parent's rather than measuring them again.

What made a version is read from what the root already records, so versions written before
this listing existed list the same way: a removal and a rollback's re-applied takedowns are
in the root's audit log (`audit.jsonl`, by the version they published); a build has no parent
(a rebuild also records its engine); an add, an upsert and a server's ingest count the rows
they added (`rows.added`; an upsert its replaced rows; `index add` the catalog rows it found
already indexed, which an ingest, having no catalog, does not count); a compaction, the one
other change, counts none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from index.versions.audit import ROLLBACK, audit_entries
from index.versions.units import segment_counts

# More segments than this in a version: their smallest and largest rows, not each one's.
SEGMENTS_SHOWN = 8


def version_action(m: IndexManifest, audited: Mapping[str, dict]) -> str:
    """What made the version `m` describes (`audited`: the root's audit entries by the version
    they published): build, rebuild, add, upsert, ingest, ingest-upsert, remove, compact,
    rollback (from the command line) or make-live (a server's: the console's button, a Reload
    naming a version)."""
    entry = audited.get(m.version)
    if entry is not None:
        if entry.get("action") == ROLLBACK and entry.get("via") != "cli":
            return "make-live"
        return str(entry.get("action"))
    if m.parent_version is None:
        return "rebuild" if m.engine else "build"
    rows = m.rows
    if rows is None or rows.added is None:
        return "compact"
    ingest = rows.already_indexed is None  # a server's rows come with no catalog to skip rows of
    if rows.replaced is not None:
        return "ingest-upsert" if ingest else "upsert"
    return "ingest" if ingest else "add"


def segment_rows(m: IndexManifest) -> str:
    """Each segment's rows (deleted ones included), a unit's joined by '+' and units by '/' as
    the shards' rows are, or the smallest..largest when there are many; '' when unsegmented."""
    if not m.segmented:
        return ""
    entries = [shard.segments or [] for shard in m.shards] if m.shards else [m.segments or []]
    rows = [[segment.rows for segment in unit] for unit in entries]
    count = sum(map(len, rows))
    if count > SEGMENTS_SHOWN:
        every = [r for unit in rows for r in unit]
        return f" (rows {min(every)}..{max(every)} each)"
    return " (rows " + "/".join("+".join(map(str, unit)) for unit in rows) + ")"


def measured_in(m: IndexManifest, manifests: Mapping[str, IndexManifest]) -> str | None:
    """The version whose quality figures `m` carries (None: measured for `m` itself): a change
    keeps its parent's, so the earliest ancestor still in the root; its parent's name when
    that ancestor is gone (`--keep` pruned it)."""
    if m.parent_version is None:
        return None
    origin = m.parent_version
    while origin in manifests and manifests[origin].parent_version is not None:
        origin = str(manifests[origin].parent_version)
    return origin


def describe_version(m: IndexManifest, action: str = "", carried_from: str | None = None) -> str:
    """A version in one line of `index list`: '-' for a figure it has not got (no labels, no probe)."""
    removed = f" (+{m.deleted_rows} removed, masked)" if m.deleted_rows else ""
    params = ",".join(f"{k}={v:g}" for k, v in m.search_params.items()) or "-"
    quality = m.quality
    ann = f"ann_R@{quality.ann_k}={quality.ann_recall_at_k:.4f}" if quality is not None else "ann_R@10=-"
    probe = quality.probe_recall_at_1 if quality is not None else None
    # A sharded version: its shard count and each shard's rows (deleted ones included).
    shards = f"  shards={len(m.shards)} ({'/'.join(str(e.rows) for e in m.shards)})" if m.shards else ""
    if m.segmented:  # how many segments each unit holds, and their rows: what compaction would merge
        shards += f"  segments={'/'.join(map(str, segment_counts(m)))}{segment_rows(m)}"
    text = f"  text_model={m.text_model_id}" if m.text_model_id else ""  # it answers words
    carried = f" (figures carried from {carried_from})" if carried_from else ""
    made = f"  {action:<13}" if action else ""
    return (
        f"{m.version}{made}  size={m.live_size}{removed}{shards}  factory={m.factory}  search={params}  "
        f"model={m.model_id}{text}  {ann}  probe_R@1={'-' if probe is None else f'{probe:.4f}'}{carried}"
    )


def list_versions(index_root: str | Path) -> list[str]:
    """`index list`'s lines, oldest version first, the live one marked '*'."""
    live = artifacts.current_version(index_root)
    manifests = {
        v: IndexManifest.read(artifacts.version_dir(index_root, v)) for v in artifacts.list_versions(index_root)
    }
    audited = {entry["version"]: entry for entry in audit_entries(index_root) if entry.get("version")}
    return [
        ("* " if version == live else "  ") + describe_version(m, version_action(m, audited), measured_in(m, manifests))
        for version, m in manifests.items()
    ]
