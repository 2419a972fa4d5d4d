"""What the monitor's ANN fidelity check (`serving.monitoring.monitor`) holds of a sampled live
query, and what an exact re-run of it gives back — here or, for a sharded server, at its shards
(`serving.shards.fanout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from index.search.filters import Filter
from serving.search.answers import Exclusion, Scope

ANN_BATCH = 64  # sampled queries a sharded server checks in one call to its shards
ANN_GATHER_S = 0.5  # how long it gathers them (the figure is a window's mean: it can wait)
# A sharded server's exact re-run lists the top EXACT_DEPTH×K: its scores are all the monitor
# knows of the answer's rows, so a row tied with the K-th but listed past that (more than K
# copies of one vector) is not seen as tied and counts as a miss.
EXACT_DEPTH = 2


@dataclass(frozen=True)
class ExactQuery:
    """A sampled query as a sharded server's `exact_top` re-runs it: its vector, what it left out,
    its filter and the field it was grouped by."""

    vector: np.ndarray
    exclude: Exclusion
    filter: Filter | None
    group_by: str | None


class SampledQuery(NamedTuple):
    """A live query queued for an exact re-run: the load that answered it, its vector, the rows
    it answered (`groups_seen`: a grouped answer's groups by value, in the order it shows them),
    what it left out, and its scope (its filter's mask, kept by reference, and its groups)."""

    serial: int
    vector: np.ndarray
    rows: list[int]
    exclude: Exclusion
    scope: Scope
    groups_seen: list[str] | None = None


class ExactRanking(NamedTuple):
    """An exact re-run's answer to one query: its top rows (a grouped query's groups, by value),
    best first, and their exact scores (a group's: its best row's). A plain (ids, scores) tuple
    is one too."""

    ids: list[int] | list[str]
    scores: list[float]
