"""`index compact`: whole shards compacted now, or (`--tiered`) the merges the tiered policy
has due — what `index add` and `index remove` start in the background after they publish.

The whole compaction (`index.changes.lifecycle.compact_version`) is synchronous and waits its
turn behind a background merge of the same root (`index.changes.merges.merge_lock`), so a shard
is merged by one process at a time; a tiered run lowers its own CPU priority and leaves at once
when another process merges the root (that one merges what is due).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.config import option
from index.changes.lifecycle import compact_version
from index.changes.merges import lower_priority, merge_lock, merge_tiers
from index.versions.change import ChangeReport
from index.versions.merge_policy import TieredMergePolicy
from index.versions.segments import MAX_SEGMENTS

_TIERS = TieredMergePolicy()


@dataclass
class CompactConfig:
    """`index compact`: merge each shard's segments of the live version, dropping deleted rows."""

    index_root: str = option("runs/index", help="index root (versions/ and CURRENT)")
    max_segments: int = option(
        0, help="compact only the shards holding more segments than this, or past --max-deleted-fraction (0: all)"
    )
    max_deleted_fraction: float = option(
        0.2,
        help="with --max-segments: compact a shard past this share of deleted rows; with --tiered: merge a segment "
        "past this share of deleted rows on its own",
    )
    keep: int = option(5, help="versions to retain")
    tiered: bool = option(
        False,
        help="merge only what the tiered merge policy has due (segments of one size class; the base past "
        "--base-merge-share), at a lower CPU priority, until none is due: what index add and remove start in the "
        "background",
    )
    tier_factor: int = option(_TIERS.tier_factor, help="with --tiered: the ratio of rows between size classes")
    segments_per_tier: int = option(
        _TIERS.segments_per_tier, help="with --tiered: segments a size class holds before they merge into one"
    )
    base_merge_share: float = option(
        _TIERS.base_merge_share,
        help="with --tiered: merge a shard whole once its rows outside the base and its deleted rows pass this "
        "share of the base's rows",
    )

    def __post_init__(self) -> None:
        if self.max_segments < 0:
            raise ValueError(f"max_segments must be at least 0, got {self.max_segments}")
        if not 0 <= self.max_deleted_fraction <= 1:
            raise ValueError(f"max_deleted_fraction must be within [0, 1], got {self.max_deleted_fraction}")
        if self.keep < 1:
            raise ValueError("keep must be at least 1")
        self.policy()  # its own checks

    def policy(self) -> TieredMergePolicy:
        return TieredMergePolicy(
            self.tier_factor, self.segments_per_tier, self.base_merge_share, self.max_deleted_fraction
        )


def run_compact(cfg: CompactConfig) -> ChangeReport | None:
    """`index compact`: the new version's report (a tiered run's last merge), or None when no
    shard has anything to merge or the compaction was superseded (each said in one line: not
    an error, the exit is 0)."""
    artifacts.check_index_root(cfg.index_root)
    # Ray where there is a cluster to spread shards on; else in this process, which ends with
    # it (a local Ray costs seconds and memory; a tier's merges take fractions of that).
    on_cluster = "RAY_ADDRESS" in os.environ
    if cfg.tiered:
        lower_priority()
        done = merge_tiers(cfg.index_root, cfg.keep, cfg.policy(), on_ray=on_cluster)
        return done[-1] if done else None
    # A whole compaction spreads a sharded version's shards on Ray, a task a shard.
    on_ray = bool(IndexManifest.read(artifacts.version_dir(cfg.index_root)).shards) or on_cluster
    with merge_lock(cfg.index_root, wait=True):
        return compact_version(
            cfg.index_root, cfg.keep, on_ray=on_ray, only_due=cfg.max_segments > 0,
            max_segments=cfg.max_segments or MAX_SEGMENTS, max_deleted_fraction=cfg.max_deleted_fraction,
        )  # fmt: skip
