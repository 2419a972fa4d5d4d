"""A probe round brought up to a version grown from the one it ran on (issue 61): under a stream
of ingests the live version changes several times a second, and a whole round (every probe
image through the model and the index) after each would cost the users' queries their CPU. A
grown version differs from the round's by its new segments and its tombstones alone, so a probe
query's answer can have changed only where a new row outscores its K-th neighbour or one of its
neighbours was taken down. Those queries — found from the rows' exact vectors, with no model
and no index — are asked again through the serving path; every other answer stands. The cost is
the change's, not the catalog's."""

from __future__ import annotations

import dataclasses

import numpy as np

from index.versions.version import IndexVersion
from index.versions.version_writer import segment_name

# New rows scored against the probe queries at most: past this many (a base merged, say) the
# change is measured by the next scheduled round instead.
MAX_CHANGED_ROWS = 50_000


@dataclasses.dataclass
class ProbedQuery:
    """One probe query of a round: its image, label and excluded ids, its embedding (its row's
    exact vector in the round's version: the model's embedding of that very image), and its
    answer's ids, labels and K-th score."""

    path: str
    label: str
    exclude: list[str]
    vector: np.ndarray
    ids: list[str]
    labels: list[str]
    kth_score: float  # -inf while the answer holds fewer than K: any new row may enter it


@dataclasses.dataclass
class ProbedRound:
    """A round's queries and the version their answers describe (`version` its `IndexVersion`,
    `serial` the pair's load)."""

    serial: int
    version: IndexVersion
    queries: list[ProbedQuery]


def new_rows(old: IndexVersion, new: IndexVersion) -> np.ndarray | None:
    """The exact vectors of `new`'s live rows in segments `old` does not hold (by name, shard by
    shard); None when they are more than MAX_CHANGED_ROWS or the versions' shards differ."""
    if old.shard_names != new.shard_names:
        return None
    found, count = [], 0
    for number in range(len(new.units())):
        unit, held = new.unit(number), old.unit(number)
        # A unit of one index became segment 000000 of its first change (names are never reused in a line of versions).
        names = {entry.name for entry in held.segment_entries} or {segment_name(0)}
        live = unit.live_mask
        for place, entry in enumerate(unit.segment_entries):
            if entry.name in names:
                continue
            count += entry.rows
            if count > MAX_CHANGED_ROWS:
                return None
            vectors = unit.segment(place).vectors
            if live is not None:
                vectors = vectors[live[entry.row_offset : entry.row_offset + entry.rows]]
            found.append(np.asarray(vectors, dtype=np.float32))
    return np.concatenate(found) if found else np.zeros((0, new.manifest.dimension), dtype=np.float32)


def touched(probed: ProbedRound, new: IndexVersion, added: np.ndarray) -> tuple[list[int], list[int]]:
    """(queries whose answers may have changed, queries whose probe item was taken down): a row of
    `added` scores above the answer's K-th, or a neighbour is no longer live in `new`."""
    rows = new.rows_of_ids({i for q in probed.queries for i in (*q.ids, *q.exclude)})
    gone = [n for n, q in enumerate(probed.queries) if q.exclude and rows[q.exclude[0]] is None]
    changed = set()
    if len(added) and probed.queries:
        best = (added @ np.stack([q.vector for q in probed.queries]).T).max(axis=0)
        changed.update(int(n) for n in np.flatnonzero(best >= [q.kth_score for q in probed.queries]))
    changed.update(n for n, q in enumerate(probed.queries) if any(rows[i] is None for i in q.ids))
    return sorted(changed - set(gone)), gone
