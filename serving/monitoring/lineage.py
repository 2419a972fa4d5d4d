"""Whether a reload only grew the version it replaced (issue 61): the new version descends from
the old by changes alone — segments added, rows tombstoned, segments merged — with the same
model and the same index layout. Then the monitor's figures (traffic, Feedback, ANN fidelity,
the probe's last round) still describe what is served, and a reload under a stream of ingests
keeps them rather than going blind after each one. A change's manifest names its `ancestors`, so
a server that fell behind a stream, whose intermediate versions were pruned meanwhile, still sees
the line; versions from before that field are followed parent by parent while they are kept."""

from __future__ import annotations

from pathlib import Path

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.artifacts.layout import ArtifactError

# What a change keeps of its parent's manifest (`index.versions.rebase` rebases onto a version
# only when these are alike too): a version that differs in any was rebuilt, not grown.
KEPT = ("model_id", "factory", "dimension", "metric", "filterable", "item_field", "shard_key")
# Parents followed back from the new version: a group commit publishes one version a window,
# and the server reloads each, so the old one is the new one's parent or close to it.
MAX_STEPS = 64


def grew_from(index_root: str | Path | None, old: IndexManifest, new: IndexManifest) -> bool:
    """Whether `new` is `old` with only segments and tombstones changed: alike in KEPT and its
    shards, and `old` among its ancestors (a rollback's version descends from an older one, so
    it is not)."""
    if index_root is None or old.version == new.version:  # loaded again on purpose (Reload): measured again
        return False
    if any(getattr(old, name) != getattr(new, name) for name in KEPT):
        return False
    if [s.name for s in old.shards or []] != [s.name for s in new.shards or []]:
        return False
    if new.ancestors is not None:  # written by every change since: no manifest of the line need still be there
        return old.version in new.ancestors
    parent = new.parent_version  # a version from before `ancestors`: its parents, while they are kept
    for _ in range(MAX_STEPS):
        if not parent:
            return False
        if parent == old.version:
            return True
        try:
            manifest = IndexManifest.read(artifacts.version_dir(Path(index_root), parent))
        except (ArtifactError, FileNotFoundError, ValueError):  # pruned, or not a version: no lineage to follow
            return False
        if any(getattr(manifest, name) != getattr(new, name) for name in KEPT):
            return False
        parent = manifest.parent_version
    return False
