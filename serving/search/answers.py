"""What a query asks of the rows and what it gets back: its `Scope` (a filter's rows, a
min_score, a grouping) and `Exclusion`, and its `Answer` of `Hit`s, `described` from the version's
items. Plain data, shared by the engine (`serving.search.engine`), its plans
(`serving.search.plans`) and a sharded search's shards (`serving.shards.searcher`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from index.search.filters import Filter
from index.search.grouping import Groups
from index.versions.version import IndexVersion


@dataclass(slots=True)
class Hit:
    """A row of an answer, its score, and what the service answers of it — filled from the rows'
    items where the rows are (`described`): on `serve --ray`, by the shard holding the row, so
    the ingress answers from its hits alone."""

    row: int
    score: float
    group: str | None = None  # a grouped answer's: the row's value of the group-by field
    id: str = ""
    label: str | None = None
    metadata: str = "{}"  # JSON text, as the items table keeps it
    item: str | None = None  # rows without labels: the item field's value (what a labelled query names)


def described(answers: Sequence[Answer], version: IndexVersion, scopes: Sequence[Scope]) -> list[Answer]:
    """`answers` over `version`'s rows with every hit's id, label and metadata filled in from its
    items (one gather for them all), a grouped answer's group values from its scope's groups, and
    — the rows unlabelled — each row's item-field value."""
    hits = [h for a in answers for h in a.hits]
    if not hits:
        return list(answers)
    rows = np.fromiter((h.row for h in hits), dtype=np.int64, count=len(hits))
    items = version.items
    # Read row by row from each column's buffers (`StringColumn.at_rows`): building the table and
    # taking from it cost ~40 µs a search, more than an HNSW search of 100k rows.
    ids, labels, metadata = (column.at_rows(rows) for column in (items.ids, items.labels, items.metadata.text))
    item_field = version.manifest.item_field
    item_values = None
    if item_field and not items.labelled:
        item_values = version.groups(item_field).values_of(rows)
    for j, hit in enumerate(hits):
        hit.id, hit.label, hit.metadata = ids[j], labels[j], metadata[j]
        if item_values is not None:
            hit.item = item_values[j]
    start = 0
    for answer, scope in zip(answers, scopes, strict=True):
        end = start + len(answer.hits)
        if scope.groups is not None and answer.hits:
            for hit, value in zip(answer.hits, scope.groups.values_of(rows[start:end]), strict=True):
                hit.group = value
        start = end
    return list(answers)


@dataclass(frozen=True, slots=True)
class Scope:
    """Which rows may answer a query, beyond the rows it excludes: `allowed`, a bool per row of
    the pair (a filter's matches; None: every row), and `min_score`, the least cosine similarity
    of an answer (None: the top k, whatever their scores). With `groups`, k counts groups of
    that field, each answering with up to `per_group` rows (`index.search.grouping`)."""

    allowed: np.ndarray | None = None
    min_score: float | None = None
    groups: Groups | None = None
    per_group: int = 1
    # The filter `allowed` was made from: what a sharded search sends its shards, each making
    # its own mask from its own filters (`serving.shards.searcher`).
    filter: Filter | None = None
    # The field `groups` groups by (a sharded server's ingress names it and holds no `groups`:
    # its shards group their own rows).
    group_by: str | None = None

    def __post_init__(self) -> None:
        if self.groups is not None and self.group_by is None:
            object.__setattr__(self, "group_by", self.groups.name)

    @property
    def plain(self) -> bool:
        return self.filter is None and self.allowed is None and self.min_score is None and self.group_by is None


EVERY_ROW = Scope()


@dataclass(frozen=True, slots=True)
class Exclusion:
    """What a query leaves out of its answer beyond its scope: `rows` by number, items by id
    (`ids`: a request's exclude_ids, an item query's own) and whole groups by value of the
    query's group-by field (`groups`: a grouped item query's own). Ids and values rather than
    rows, so a sharded server's shards resolve them over their own rows (`rows_in`) and the
    ingress needs none."""

    rows: frozenset[int] = frozenset()
    ids: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()

    def rows_in(self, version: IndexVersion, groups: Groups | None) -> frozenset[int]:
        """Its rows among `version`'s: `rows`, each id's live rows and — grouped by `groups` —
        every row of each group it names."""
        if not self.ids and (groups is None or not self.groups):
            return self.rows
        found = set(self.rows)
        for item_id in self.ids:
            row = version.row_of(item_id)
            if row is not None:
                found.add(row)
        if groups is not None:
            for value in self.groups:
                code = groups.code_of(value)
                if code is not None:
                    found.update(groups.rows_of(code).tolist())
        return frozenset(found)


NOTHING_EXCLUDED = Exclusion()


@dataclass(slots=True)
class Answer:
    """A query's hits, best first; `truncated` when rows that qualify were left out of it: more
    reach its `min_score` than it holds, or a top-k answer holds fewer than k though more rows
    could have answered (`serving.search.plans.short`)."""

    hits: list[Hit]
    truncated: bool = False
    path: str | None = None  # a filtered query's: the planner's choice, exact or index (faiss_index.search_within)
    candidates: int | None = None  # a grouped query's: rows its deciding round searched (EXACT_PASS: all)
    # A sharded search's (`serving.shards.fanout`): the shards that answered, those that did not, and
    # why — the service fails the query UNAVAILABLE with it unless the request allowed a partial answer.
    shards_answered: tuple[str, ...] = ()
    shards_missing: tuple[str, ...] = ()
    unavailable: str | None = None
