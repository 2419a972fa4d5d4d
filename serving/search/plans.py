"""How the engine searches a batch of queries: each query's shape — grouped, plain, filtered or
range (a min_score) — picks its plan from `PLANS`, and the queries of one plan that can share a
search (its `key`) are searched together. `SearchEngine.search` batches by the `Planner` and
describes the answers; the plans hold the searching, over `index.search`.

| shape | queries | searched together |
| --- | --- | --- |
| grouped | a group-by field (`Scope.groups`) | per groups, filter, min_score, rows per group and k |
| plain | no filter, min_score or grouping | all of the batch, in one faiss call |
| filtered | a filter's rows (`Scope.allowed`), no min_score | per mask: one planned search |
| range | a min_score, with or without a filter | each alone |
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from enum import StrEnum
from typing import Protocol

import faiss
import numpy as np

from core.retrieval.ranking import best_k
from index.search import range_search
from index.search.faiss_search import OVERFETCH_DELETED, ExactRerank, search_live, search_within
from index.search.grouping import search_groups
from index.versions.version import IndexVersion
from serving.search.answers import Answer, Hit, Scope


class Searched(Protocol):
    """What a plan reads of the live pair (`serving.search.engine.ServingPair`)."""

    index: faiss.Index | ExactRerank
    index_version: IndexVersion

    @property
    def vectors(self) -> np.ndarray: ...


def short(found: int, k: int, candidates: int) -> bool:
    """A top-k answer cut short: fewer than k hits though more rows could have answered — an
    approximate index that ran out of candidates (IVF probing too few lists, say)."""
    return found < k and found < candidates


class MaskRows:
    """`np.flatnonzero(mask)`, kept for the last 16 masks while they live (masks are not written
    to once made: the service's are read-only). The service reuses a filter's mask, and listing
    the rows of a 1M-row mask costs about half of a lone 1% query's exact search."""

    def __init__(self) -> None:
        self._rows: OrderedDict[int, tuple[weakref.ref, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, mask: np.ndarray) -> np.ndarray:
        with self._lock:
            kept = self._rows.get(id(mask))
            if kept is not None and kept[0]() is mask:
                self._rows.move_to_end(id(mask))
                return kept[1]
        rows = np.flatnonzero(mask)
        if not mask.flags.writeable:
            with self._lock:
                self._rows[id(mask)] = (weakref.ref(mask), rows)
                while len(self._rows) > 16:
                    self._rows.popitem(last=False)
        return rows


def search_masked(
    pair: Searched,
    vectors: np.ndarray,
    k: int,
    exclude: list[frozenset[int]],
    allowed: np.ndarray,
    rows_of: MaskRows,
) -> list[Answer]:
    """Top-k of each query among the rows `allowed` marks (less deleted rows), excluded rows
    left out: k hits whenever k rows match. The planner (`search_within`) picks exact search
    over the rows or the index's search with a selector, by how many rows the filter keeps."""
    if pair.index_version.live_mask is not None:
        allowed = allowed & pair.index_version.live_mask
    # Excluded rows (few: an item_id query's own, a request's exclude_ids) are searched past
    # rather than masked, so queries of one filter keep one mask.
    depth = k + max((len(e) for e in exclude), default=0)
    matching = rows_of(allowed)
    scores, rows, path = search_within(pair.index, pair.vectors, vectors, depth, allowed, rows=matching)
    answers = []
    for s_row, r_row, skip in zip(scores, rows, exclude, strict=True):
        hits = [Hit(int(r), float(s)) for s, r in zip(s_row, r_row, strict=True) if r >= 0 and r not in skip]
        answers.append(Answer(hits[:k], short(len(hits), k, len(matching) - len(skip)), path=path))
    return answers


def search_range(pair: Searched, vector: np.ndarray, k: int, exclude: frozenset[int], scope: Scope) -> Answer:
    """One query with a min_score: the index's own range search (`index.search.range_search`),
    bounded by k — or, with a filter too, exact search over the filter's rows (deleted and
    excluded rows left out) keeping those at or above the min_score."""
    live = pair.index_version.live_mask
    if scope.allowed is None:
        found = range_search.reaching(pair.index, vector[None], scope.min_score, k, live, [exclude])[0]
        hits = [Hit(int(r), float(s)) for r, s in zip(found.rows, found.scores, strict=True)]
        return Answer(hits, found.truncated)
    allowed = scope.allowed & live if live is not None else scope.allowed.copy()  # the mask is shared
    allowed[list(exclude)] = False
    rows = np.flatnonzero(allowed)
    scores = np.asarray(pair.vectors[rows] @ vector, dtype=np.float32)
    reaching = scores >= scope.min_score
    rows, scores = rows[reaching], scores[reaching]
    top = best_k(scores, k)  # rows ascending: ties to the lower row
    return Answer([Hit(int(rows[j]), float(scores[j])) for j in top], len(rows) > k)


class Plan:
    """One shape's search. `key`: which of a batch's queries share one search (equal keys);
    `own_k`: whether a query is searched to its own k rather than the batch's."""

    own_k = False

    def __init__(self, rows_of: MaskRows) -> None:
        self.rows_of = rows_of

    def key(self, i: int, scope: Scope, k: int) -> Hashable:
        return None  # the whole batch's queries of this shape share one search

    def search(
        self, pair: Searched, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        """The answers of queries sharing one search (`scope`: the first one's, the same for all
        that matters to the search)."""
        raise NotImplementedError


class GroupedPlan(Plan):
    """The top k groups of each query within the scope (`index.search.grouping.search_groups`), as
    hits group by group, best group first; queries of one scope share each round of its widening
    search, each to its own k."""

    own_k = True

    def key(self, i: int, scope: Scope, k: int) -> Hashable:
        return id(scope.groups), id(scope.allowed), scope.min_score, scope.per_group, k

    def search(
        self, pair: Searched, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        live = pair.index_version.live_mask
        allowed = scope.allowed
        if live is not None:
            allowed = live if allowed is None else allowed & live
        found = search_groups(
            pair.index, pair.vectors, vectors, k, scope.groups, scope.per_group, allowed, exclude, scope.min_score
        )
        return [
            Answer(
                [Hit(row, score) for _, hits in g.groups for row, score in hits],
                g.truncated,
                candidates=g.candidates,
            )
            for g in found
        ]


class PlainPlan(Plan):
    """Top-k over every live row, excluded rows left out: one faiss call searching deeper to make
    up for them — through the live rows' mask while many rows are deleted (HNSW tombstones)."""

    def search(
        self, pair: Searched, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        live, deleted = pair.index_version.live_mask, len(pair.index_version.deleted)
        if live is not None and deleted > OVERFETCH_DELETED:
            found = search_masked(pair, vectors, k, exclude, live, self.rows_of)
            return [Answer(answer.hits) for answer in found]  # not a filtered query: no planner path counted
        # A few tombstones (a segmented version's takedowns and upserts) are dropped from an
        # answer asked that much deeper: the index's own search, not the planner's.
        depth = min(k + max((len(e) for e in exclude), default=0), pair.index.ntotal)
        scores, rows = search_live(pair.index, pair.vectors, vectors, depth, live, deleted)
        size = pair.index_version.size
        answers = []
        # As Python numbers first: comparing and hashing numpy scalars one by one cost more than the search.
        for s_row, r_row, skip in zip(scores.tolist(), rows.tolist(), exclude, strict=True):
            hits = [Hit(r, s) for s, r in zip(s_row, r_row, strict=True) if r >= 0 and r not in skip]
            answers.append(Answer(hits[:k], short(len(hits), k, size - len(skip))))
        return answers


class FilteredPlan(Plan):
    """Top-k among a filter's rows (`search_masked`). Queries sharing one mask (the service hands
    out one array per distinct filter) share one search: one gather of its rows, or one faiss
    call with its selector."""

    def key(self, i: int, scope: Scope, k: int) -> Hashable:
        return id(scope.allowed)

    def search(
        self, pair: Searched, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        return search_masked(pair, vectors, k, exclude, scope.allowed, self.rows_of)


class RangePlan(Plan):
    """A min_score, searched alone (`search_range`)."""

    def key(self, i: int, scope: Scope, k: int) -> Hashable:
        return i

    def search(
        self, pair: Searched, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        return [search_range(pair, vectors[0], k, exclude[0], scope)]


class Shape(StrEnum):
    GROUPED = "grouped"
    PLAIN = "plain"
    FILTERED = "filtered"
    RANGE = "range"


def shape_of(scope: Scope) -> Shape:
    """A query's shape, by its scope: grouped whatever else it asks, then plain, then a filter
    alone; a min_score (a range, filtered or not) is the rest."""
    if scope.groups is not None:
        return Shape.GROUPED
    if scope.plain:
        return Shape.PLAIN
    if scope.allowed is not None and scope.min_score is None:
        return Shape.FILTERED
    return Shape.RANGE


# Each shape's plan, in the order a batch's searches run.
PLANS: dict[Shape, type[Plan]] = {
    Shape.GROUPED: GroupedPlan,
    Shape.PLAIN: PlainPlan,
    Shape.FILTERED: FilteredPlan,
    Shape.RANGE: RangePlan,
}


class Planner:
    """A batch's queries as searches: each shape's plan (`PLANS`), over one engine's mask rows."""

    def __init__(self) -> None:
        self.rows_of = MaskRows()
        self.plans = {shape: plan(self.rows_of) for shape, plan in PLANS.items()}

    def searches(self, scopes: Sequence[Scope], k: int, ks: list[int] | None) -> Iterator[tuple[Plan, int, list[int]]]:
        """Each search of the batch: its plan, its k and the queries (by place) it answers; shape
        by shape in `PLANS`'s order, queries sharing a search by their first place."""
        searches: dict[Shape, dict[Hashable, list[int]]] = {shape: {} for shape in PLANS}
        for i, scope in enumerate(scopes):
            shape = shape_of(scope)
            own_k = ks[i] if ks else k
            searches[shape].setdefault(self.plans[shape].key(i, scope, own_k), []).append(i)
        for shape, keyed in searches.items():
            plan = self.plans[shape]
            for members in keyed.values():
                yield plan, (ks[members[0]] if ks else k) if plan.own_k else k, members
