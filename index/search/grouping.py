"""Grouped search: the top k *groups* of rows (an item's photos, a product's images, any declared
field's values), each with up to `per_group` of its rows and its best score.

Grouping happens inside the search, never as a post-filter of a fixed top-k that can come back
short. A round searches the index for `depth` candidates (`OVERFETCH`·k to start) and walks them
best first, keeping the first k distinct groups. When a round finds fewer, the next doubles the
depth and the index's effort (IVF nprobe, HNSW efSearch, through the same search parameters a
filter widens); past `max_candidates` rows, or at once for an index that scans everything
anyway (Flat, or an index that takes no search parameters), the rest is searched exactly: every
eligible row is scored and each group's best found with one pass over the rows grouped by value
(`np.maximum.reduceat`). So k groups come back whenever k groups have an eligible row, and the
work is bounded: log2(max_candidates / (OVERFETCH·k)) index rounds and one exact scan at worst.

The groups found are then filled exactly: each group's eligible rows are scored against the
stored vectors and its best `per_group` kept, so a group's images and its score do not depend on
which of them the approximate search happened to meet. Rows without a value in the grouping field
never answer a grouped query (Qdrant's `search_groups` does the same).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from core.retrieval.ranking import best_k, ranked
from index.search.faiss_search import EXACT, ExactRerank, index_family, inner_products, search_within, selector_params
from index.search.filters import FieldRows, FieldSpec

OVERFETCH = 4  # first round: 4 candidate rows per group wanted (catalog items hold a few photos)
MAX_CANDIDATES = 4096  # index rounds stop here; past it the rest is searched exactly
EXACT_PASS = -1  # `GroupedAnswer.candidates` of a query the exact pass answered
GROWTH_CAP = 16.0  # the most one round multiplies the depth by
EXACT_FRACTION = 16  # a round asks for at most 1/16 of the eligible rows before the exact pass


@dataclass(frozen=True)
class Groups:
    """A field's rows grouped by value: group g's rows are `rows[offsets[g]:offsets[g + 1]]`,
    named `values[g]`; `codes[row]` is the row's group (-1: the row has no value)."""

    name: str
    values: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    codes: np.ndarray
    has_value: np.ndarray | None  # bool per row; None when every row has a value

    @classmethod
    def of(cls, name: str, field_rows: FieldRows, size: int) -> Groups:
        codes = np.full(size, -1, dtype=np.int32)
        counts = np.diff(field_rows.offsets)
        codes[field_rows.rows] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        has_value = None if len(field_rows.rows) == size else codes >= 0
        if has_value is not None:
            has_value.flags.writeable = False
        return cls(name, field_rows.values, field_rows.offsets, field_rows.rows, codes, has_value)

    @classmethod
    def of_values(cls, name: str, values: Sequence[str | None]) -> Groups:
        """Rows grouped by a list of string values, one per row (None: the row has none)."""
        return cls.of(name, FieldRows.build(FieldSpec(name, "string"), values, len(values)), len(values))

    def __len__(self) -> int:
        return len(self.values)

    def label(self, group: int) -> str:
        return str(self.values[group])

    def values_of(self, rows: Sequence[int] | np.ndarray) -> list[str | None]:
        """Each row's value of the field (None: the row has none)."""
        codes = self.codes[np.asarray(rows, dtype=np.int64)]
        return [self.label(c) if c >= 0 else None for c in codes.tolist()]

    def code_of(self, value: str) -> int | None:
        """The group `label` names `value` (None: no row has that value)."""
        return self._codes.get(value)

    @functools.cached_property
    def _codes(self) -> dict[str, int]:
        return {self.label(g): g for g in range(len(self))}

    def rows_of(self, group: int) -> np.ndarray:
        return self.rows[self.offsets[group] : self.offsets[group + 1]]

    def first_seen(self, rows: Sequence[int] | np.ndarray) -> list[int]:
        """The groups of `rows`, each once, in the order the rows first show them (a grouped
        answer's groups, or a ranking's)."""
        return list(dict.fromkeys(int(self.codes[r]) for r in rows))


@dataclass
class GroupedAnswer:
    """A query's groups, best first: (group, [(row, score), ...] best first). `truncated`: fewer
    than k groups came back (fewer have an eligible row), or — with a min_score — more groups
    reach it than the answer holds. `candidates`: rows the deciding round asked the index for
    (EXACT_PASS when the exact pass answered)."""

    groups: list[tuple[int, list[tuple[int, float]]]]
    truncated: bool
    candidates: int


def search_groups(
    index: faiss.Index | ExactRerank,
    stored: np.ndarray,
    queries: np.ndarray,
    k: int,
    groups: Groups,
    per_group: int = 1,
    allowed: np.ndarray | None = None,
    exclude: Sequence[frozenset[int]] | None = None,
    min_score: float | None = None,
    max_candidates: int = MAX_CANDIDATES,
) -> list[GroupedAnswer]:
    """The top k groups of each of the L2-normalised `queries` among the rows `allowed` marks
    (a filter's matches less deleted rows; None: every row), leaving out each query's `exclude`
    rows and — with `min_score` — rows scoring below it. Queries share each round's index call."""
    if k < 1 or per_group < 1:
        raise ValueError(f"k and per_group must be at least 1, got {k} and {per_group}")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    exclude = list(exclude) if exclude is not None else [frozenset()] * len(queries)
    eligible = _eligible(groups, allowed)
    count = len(groups.codes) if eligible is None else int(np.count_nonzero(eligible))
    family = index_family(index)
    answers: list[GroupedAnswer | None] = [None] * len(queries)
    pending = list(range(len(queries)))
    depth, effort = OVERFETCH * k, 1.0
    # An index round asking for more than a sixteenth of the eligible rows costs about what
    # scoring them all does (HNSW visits some 32 nodes per candidate at that effort): past it,
    # or past max_candidates, the exact pass answers.
    limit = min(max_candidates, count // EXACT_FRACTION)
    while pending and depth <= limit and depth < count:
        asked = depth + max(len(exclude[i]) for i in pending)
        scores, rows, exact = _candidates(index, family, stored, queries[pending], min(asked, count), eligible, effort)
        exhaustive = exact and asked >= count  # every eligible row was a candidate: a short list is final
        still, fewest = [], k
        for i, s_row, r_row in zip(pending, scores, rows, strict=True):
            found, complete = _first_groups(s_row, r_row, groups.codes, k, exclude[i], min_score)
            if len(found) >= k or complete or exhaustive:
                answers[i] = filled_groups(
                    found, queries[i], stored, groups, per_group, eligible, exclude[i], min_score, k
                )
                answers[i].candidates = depth
            else:
                still.append(i)
                fewest = min(fewest, len(found))
        pending = still
        if family not in ("ivf", "hnsw"):
            break  # a Flat scan (or an index taking no parameters) costs an exact pass anyway
        # At least double; more when the groups found so far say k of them need a deeper list
        # (groups crowd in proportion to depth): fewer rounds on a catalog of large groups.
        widen = max(2.0, min(GROWTH_CAP, 1.5 * (k + 1) / max(fewest, 1)))
        depth, effort = int(np.ceil(depth * widen)), effort * widen
    for i in pending:
        found = exact_groups(queries[i], stored, groups, k, eligible, exclude[i], min_score)
        answers[i] = filled_groups(found, queries[i], stored, groups, per_group, eligible, exclude[i], min_score, k)
        answers[i].candidates = EXACT_PASS
    return answers  # type: ignore[return-value]


def exact_group_scores(
    query: np.ndarray,
    stored: np.ndarray,
    groups: Groups,
    allowed: np.ndarray | None = None,
    exclude: frozenset[int] = frozenset(),
) -> np.ndarray:
    """Each group's exact score for one query, its best eligible row's (-inf: none), every row
    scored, with the rows `search_groups` allows, excludes and leaves out for having no value:
    the reference an approximate grouped answer is measured against (its top groups, and the
    scores that say which groups tie)."""
    query = np.ascontiguousarray(query, dtype=np.float32)
    return _group_scores(query, stored, groups, _eligible(groups, allowed), exclude, None)


def _eligible(groups: Groups, allowed: np.ndarray | None) -> np.ndarray | None:
    """The rows a grouped query may answer with: `allowed` ones that have a value."""
    if groups.has_value is None:
        return allowed
    return groups.has_value if allowed is None else allowed & groups.has_value


def _candidates(
    index: faiss.Index | ExactRerank,
    family: str | None,
    stored: np.ndarray,
    queries: np.ndarray,
    depth: int,
    eligible: np.ndarray | None,
    effort: float,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(scores, rows, exact): the index's top `depth` (rows -1 past what it found), and whether
    they are the exact top `depth`."""
    if eligible is None:
        # The first round searches at the index's own effort; later rounds widen it.
        params = selector_params(index, None, depth, effort) if effort > 1 and family in ("ivf", "hnsw") else None
        scores, rows = index.search(queries, min(depth, index.ntotal), params=params)
        return scores, rows, family == "flat" and not isinstance(index, ExactRerank)
    scores, rows, path = search_within(index, stored, queries, depth, eligible, effort=effort)
    return scores, rows, path == EXACT


def _first_groups(
    scores: np.ndarray, rows: np.ndarray, codes: np.ndarray, k: int, exclude: frozenset[int], min_score: float | None
) -> tuple[list[int], bool]:
    """The first k + 1 distinct groups of one query's candidates (best first: one past k says
    whether more groups qualify), and whether the candidates ran below `min_score` — then no
    row further down can reach it."""
    found: list[int] = []
    seen: set[int] = set()
    for score, row in zip(scores.tolist(), rows.tolist(), strict=True):
        if row < 0:
            continue
        if min_score is not None and score < min_score:
            return found, True
        group = int(codes[row])
        if group < 0 or group in seen or row in exclude:
            continue
        seen.add(group)
        found.append(group)
        if len(found) > k:
            break
    return found, False


def exact_groups(
    query: np.ndarray,
    stored: np.ndarray,
    groups: Groups,
    k: int,
    eligible: np.ndarray | None,
    exclude: frozenset[int],
    min_score: float | None,
) -> list[int]:
    """Every eligible row scored (`eligible`: None, every row), less `exclude` and rows below
    `min_score`: the k groups with the best rows, best first, and one past k when there is
    one (is there more?). What any exact grouped answer is made of: the last index round's,
    a shard's (`serving.shards.searcher.ShardSearcher.exact`), the monitor's reference."""
    best = _group_scores(query, stored, groups, eligible, exclude, min_score)
    reachable = np.flatnonzero(np.isfinite(best))
    top = reachable[best_k(best[reachable], k + 1)]  # one past k: is there more? Ties to the lower group
    return top.tolist()


def _group_scores(
    query: np.ndarray,
    stored: np.ndarray,
    groups: Groups,
    eligible: np.ndarray | None,
    exclude: frozenset[int],
    min_score: float | None,
) -> np.ndarray:
    """Every eligible row scored: each group's best (-inf: no eligible row reaching `min_score`)."""
    scores = inner_products(stored, query)
    if eligible is not None:
        scores[~eligible] = -np.inf
    if exclude:
        scores[list(exclude)] = -np.inf
    if min_score is not None:
        scores[scores < min_score] = -np.inf
    if not len(groups):
        return np.zeros(0, dtype=np.float32)
    return np.maximum.reduceat(scores[groups.rows], groups.offsets[:-1])


def filled_groups(
    found: list[int],
    query: np.ndarray,
    stored: np.ndarray,
    groups: Groups,
    per_group: int,
    eligible: np.ndarray | None,
    exclude: frozenset[int],
    min_score: float | None,
    k: int,
) -> GroupedAnswer:
    """Each of the groups `found`, filled with its best `per_group` eligible rows scored exactly;
    groups ranked by their best, the first k kept. All the groups' rows are gathered and scored
    in one product. What fills every grouped answer, a shard's part of one included
    (`serving.shards.searcher.ShardSearcher.fill`)."""
    spans = [(int(groups.offsets[g]), int(groups.offsets[g + 1])) for g in found]
    rows = np.concatenate([groups.rows[a:b] for a, b in spans]) if spans else groups.rows[:0]
    scores = inner_products(stored, query, rows)
    keep = None
    if eligible is not None or exclude or min_score is not None:
        keep = eligible[rows] if eligible is not None else np.ones(len(rows), dtype=bool)
        if exclude:
            keep &= ~np.isin(rows, np.fromiter(exclude, dtype=np.int64, count=len(exclude)))
        if min_score is not None:
            keep &= scores >= min_score
    filled = []
    at = 0
    for group, (a, b) in zip(found, spans, strict=True):
        its_rows, its_scores = rows[at : at + b - a], scores[at : at + b - a]
        if keep is not None:
            kept = keep[at : at + b - a]
            its_rows, its_scores = its_rows[kept], its_scores[kept]
        at += b - a
        if not len(its_rows):
            continue
        if per_group == 1:
            best = int(its_scores.argmax())
            filled.append((group, [(int(its_rows[best]), float(its_scores[best]))]))
        else:
            top = best_k(its_scores, per_group)
            filled.append((group, list(zip(its_rows[top].tolist(), its_scores[top].tolist(), strict=True))))
    # By each group's best, ties in the order found (`found`: best group first).
    filled = [filled[g] for g in ranked(np.array([hits[0][1] for _, hits in filled], dtype=np.float64))]
    more = len(filled) > k
    filled = filled[:k]
    truncated = more if min_score is not None else len(filled) < k
    return GroupedAnswer(filled, truncated, 0)


def item_recall_at_k(
    index: faiss.Index | ExactRerank, stored: np.ndarray, groups: Groups, rows: np.ndarray, ks: Sequence[int]
) -> dict[int, float] | None:
    """Item-level Recall@K: each of `rows` whose item has another row queries the index with its
    own vector, its own row left out; a hit when its item is among the top K items (groups).
    None when no row qualifies (every item has one row)."""
    sizes = np.diff(groups.offsets)
    codes = groups.codes
    queries = [int(r) for r in rows if codes[r] >= 0 and sizes[codes[r]] > 1]
    if not queries or not ks:
        return None
    found = search_groups(index, stored, stored[queries], max(ks), groups, exclude=[frozenset({r}) for r in queries])
    ranked = [[g for g, _ in answer.groups] for answer in found]
    return {k: float(np.mean([codes[r] in top[:k] for r, top in zip(queries, ranked, strict=True)])) for k in ks}
