"""Which segments of a unit to merge: a tiered merge policy, in the shape of Lucene's.

A stream of adds makes a segment an add; merging them all into the shard's base every few adds
rewrites the whole shard each time (at 1M rows, a gigabyte every 16 adds). Merging segments of
like size instead rewrites a row once per size class it climbs — O(log N) times —, as Lucene's
TieredMergePolicy, Milvus's compaction by size class and Qdrant's optimizer do:

- a unit's segments other than its base (the first: the build's rows, or the last whole merge's)
  fall in size classes by live rows, class c holding [F^c, F^(c+1)) rows for the tier factor F;
  once a class holds `segments_per_tier` segments they merge into one (at least F^(c+1) rows
  when `segments_per_tier` ≥ F: a class up), so each class holds fewer than that many;
- the base is merged (with every other segment: the whole unit, as `index compact` does) only
  once the rows outside it and the deleted rows pass `base_merge_share` of its rows — the base
  is the shard, and rewriting it is the cost the tiers avoid;
- a segment whose deleted rows pass `max_deleted_share` of its rows is merged on its own (its
  deleted rows dropped), the base too.

Write amplification (bytes written ÷ bytes of the rows added, a segment's files ≈ 2.2× its
float rows for Flat): each row is written by its add and once a class it climbs, from its add's
class to the base's share — log_F(base_merge_share × N / rows an add) merges —, and the base's
rewrite every `base_merge_share × N` new rows adds (1 + s) / s. At 1M rows, F = 10 and adds of
100 rows: ≈ 2.2 × (1 + 3) ≈ 9×, against ≈ 200× for a whole-shard merge every 16 adds.

The policy reads sizes only (rows and deleted rows a segment), so it is a pure function of a
unit's manifest and tombstones; `index.changes.merges` runs what it chooses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TIERED, WHOLE = "tiered", "whole"  # how merges follow a change (`--merges` of index add, remove, serve)

BASE, TIER, DELETED = "base", "tier", "deleted"  # why a merge was chosen


@dataclass(frozen=True)
class SegmentSize:
    """One segment as the policy sees it: its rows and how many of them are deleted."""

    rows: int
    deleted: int = 0

    @property
    def live(self) -> int:
        return self.rows - self.deleted


@dataclass(frozen=True)
class Merge:
    """The segments (positions in the unit's list, ascending) to merge into one, and why."""

    segments: tuple[int, ...]
    reason: str

    def whole(self, count: int) -> bool:
        """The merge takes every one of the unit's `count` segments (a base merge)."""
        return len(self.segments) == count


@dataclass(frozen=True)
class TieredMergePolicy:
    """Lucene's TieredMergePolicy, by rows: `tier_factor` (F) the ratio between size classes,
    `segments_per_tier` how many segments a class holds before they merge, `base_merge_share`
    the share of the base's rows that new or deleted rows pass before the whole unit merges,
    `max_deleted_share` the share of a segment's rows deleted before it merges on its own."""

    tier_factor: int = 10
    segments_per_tier: int = 10
    base_merge_share: float = 0.5
    max_deleted_share: float = 0.2

    def __post_init__(self) -> None:
        if self.tier_factor < 2:
            raise ValueError(f"tier_factor must be at least 2, got {self.tier_factor}")
        if self.segments_per_tier < 2:
            raise ValueError(f"segments_per_tier must be at least 2, got {self.segments_per_tier}")
        if self.base_merge_share <= 0:
            raise ValueError(f"base_merge_share must be above 0, got {self.base_merge_share}")
        if not 0 <= self.max_deleted_share <= 1:
            raise ValueError(f"max_deleted_share must be within [0, 1], got {self.max_deleted_share}")

    def size_class(self, rows: int) -> int:
        """The class of a segment of `rows` live rows: c for F^c ≤ rows < F^(c+1) (0 for none)."""
        if rows < self.tier_factor:
            return 0
        c = int(math.log(rows, self.tier_factor))
        # log's rounding at an exact power: settle it with integers.
        while self.tier_factor ** (c + 1) <= rows:
            c += 1
        while c and self.tier_factor**c > rows:
            c -= 1
        return c

    def choose(self, segments: Sequence[SegmentSize]) -> Merge | None:
        """The one merge due in a unit of these segments (the first is its base), or None: the
        base merge, else a segment past its deleted share, else the smallest full size class."""
        if not segments:
            return None
        base, others = segments[0], segments[1:]
        outside = sum(s.live for s in others) + sum(s.deleted for s in segments)
        if others and outside > self.base_merge_share * base.live:
            return Merge(tuple(range(len(segments))), BASE)
        for position, segment in enumerate(segments):
            if segment.rows and segment.deleted > self.max_deleted_share * segment.rows:
                return Merge((position,), DELETED)
        classes: dict[int, list[int]] = {}
        for position, segment in enumerate(others, start=1):
            classes.setdefault(self.size_class(segment.live), []).append(position)
        for size_class in sorted(classes):
            if len(classes[size_class]) >= self.segments_per_tier:
                return Merge(tuple(classes[size_class]), f"{TIER} {size_class}")
        return None

    def most_segments(self, rows: int, smallest: int = 1) -> int:
        """The most segments a unit of `rows` rows holds between merges when adds bring at least
        `smallest` rows each: the base, fewer than `segments_per_tier` a class from the adds' up
        to the base's share, and the add that fills a class."""
        low = self.size_class(max(smallest, 1))
        high = self.size_class(max(int(self.base_merge_share * rows), 1))
        return 2 + (high - low + 1) * (self.segments_per_tier - 1)


def segment_sizes(row_counts: Sequence[int], deleted: np.ndarray) -> list[SegmentSize]:
    """Each segment's size from its rows (in the unit's order) and the unit's deleted rows."""
    ends = np.cumsum(np.asarray(row_counts, dtype=np.int64))
    starts = ends - np.asarray(row_counts, dtype=np.int64)
    deleted = np.asarray(deleted, dtype=np.int64)
    counts = np.searchsorted(deleted, ends) - np.searchsorted(deleted, starts)
    return [SegmentSize(int(rows), int(gone)) for rows, gone in zip(row_counts, counts, strict=True)]
