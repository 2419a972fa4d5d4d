"""Where a unit's rows go when some of its segments merge into one.

A merge takes a group of a unit's segments (all of them: a whole compaction) and writes their
live rows, in order, as one segment in the place of the group's first; the other segments keep
their rows and order. A unit's tombstones (`deleted.npy`) name unit rows, so they move with
their segments — and a merge rebased onto a version that appended segments and deleted rows
meanwhile (`index.versions.rebase`) maps that version's tombstones the same way, its appended
segments being more segments after the group. One layout, used by both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MergedLayout:
    """Segments of `sizes` rows (in the unit's order), the ones at `group` merged into one that
    holds the unit rows `kept` (ascending: the group's rows less those dropped)."""

    sizes: tuple[int, ...]
    group: tuple[int, ...]
    kept: np.ndarray

    @classmethod
    def of(cls, sizes: Sequence[int], group: Sequence[int], dropped: np.ndarray) -> MergedLayout:
        """The layout that drops the rows `dropped` (a unit's deleted rows) from the group."""
        starts = _starts(sizes)
        rows = np.concatenate([np.arange(starts[p], starts[p] + sizes[p], dtype=np.int64) for p in group])
        return cls(tuple(sizes), tuple(sorted(group)), np.setdiff1d(rows, dropped))

    def order(self) -> list[int | None]:
        """The new segments, in order: an old position, or None for the merged one."""
        first = self.group[0]
        return [None if p == first else p for p in range(len(self.sizes)) if p == first or p not in self.group]

    def new_starts(self) -> dict[int | None, int]:
        """Each new segment's first row, keyed as `order` names it."""
        starts, offset = {}, 0
        for key in self.order():
            starts[key] = offset
            offset += len(self.kept) if key is None else self.sizes[key]
        return starts

    def rows(self, old: np.ndarray) -> np.ndarray:
        """The new rows of the unit rows `old` (ascending), those the merge dropped left out."""
        old = np.asarray(old, dtype=np.int64)
        starts = _starts(self.sizes)
        position = np.searchsorted(starts, old, side="right") - 1
        merged = np.isin(position, self.group)
        new = self.new_starts()
        shift = np.array([new.get(p, 0) - starts[p] for p in range(len(self.sizes))], dtype=np.int64)
        out = old + shift[position]
        at = np.searchsorted(self.kept, old[merged])
        found = at < len(self.kept)
        found[found] = self.kept[at[found]] == old[merged][found]
        out[merged] = new[None] + at
        keep = np.ones(len(old), dtype=bool)
        keep[np.flatnonzero(merged)[~found]] = False
        return out[keep]


def _starts(sizes: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
