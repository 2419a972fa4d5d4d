"""A version's units: the parts a change writes apart and a shard replica serves — each shard of
a sharded version, or the version itself when it is one index (the one-unit case, not another
path). Every place that splits a version's global rows into a unit's own, counts its segments or
asks which units may hold an id asks here, from the manifest alone (an ingress holds no rows)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.artifacts.index_manifest import IndexManifest
from index.versions.sharding import ID_KEY, shard_of


@dataclass(frozen=True)
class Unit:
    """Unit `number` of a version: its global rows are `offset` … `offset + rows - 1`, `deleted`
    of them deleted; `segments` is how many segments they lie in — an unsegmented unit is one."""

    number: int
    offset: int
    rows: int
    deleted: int
    segments: int

    def own(self, rows: np.ndarray) -> np.ndarray:
        """Those of the global `rows` that lie in this unit, as its own rows (order kept)."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows[(rows >= self.offset) & (rows < self.offset + self.rows)] - self.offset


def units_of(manifest: IndexManifest) -> list[Unit]:
    """The units of the version `manifest` describes, in row order."""
    if not manifest.shards:
        return [Unit(0, 0, manifest.size, manifest.deleted_rows, max(len(manifest.segments or []), 1))]
    return [
        Unit(number, entry.row_offset, entry.rows, entry.deleted_rows, max(len(entry.segments or []), 1))
        for number, entry in enumerate(manifest.shards)
    ]


def units_for_id(manifest: IndexManifest, item_id: str) -> list[int]:
    """The units that may hold `item_id`: the one its id hashes to where rows were placed by id,
    else every one (placed by the item field, whose value an id does not tell)."""
    count = len(manifest.shards or []) or 1
    if count > 1 and manifest.shard_key == ID_KEY:
        return [shard_of(item_id, count)]
    return list(range(count))


def segment_counts(manifest: IndexManifest) -> list[int]:
    """Each unit's segment count: what `index list`, the console and /v1/admin/versions show."""
    return [unit.segments for unit in units_of(manifest)]
