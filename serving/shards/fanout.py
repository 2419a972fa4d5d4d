"""Sharded search at the ingress: an index version's shards asked at once and their answers merged exactly.

The ingress's `ShardedSearch` has the contract of `SearchEngine.search` (a list of `Answer`;
`ShardedEngine` is the one-index engine with its search this fan-out) and merges the shards'
answers (`serving.shards.messages.ShardAnswer`) exactly, in the order a version's segments are
merged in one process (`core.retrieval.ranking`): the best k of their rows (score descending, then row);
grouped, each shard's best k groups, of which the best k (a group's score is its best row's),
groups told apart by value.
Rows are placed by their item, so grouped by the item field (the shard key) a group lives in
one shard and its rows come whole from it; grouped by another field a group spans shards, its
best row is still in some shard's top k groups, but its other rows are then filled from every
shard (`ShardSearcher.fill`, `serving.shards.searcher`). A min_score keeps every shard's rows
above it; `truncated` is the one-index meaning, from the shards' own.

The shards are reached through a `ShardSet`: `LocalShards` in this process, or `serve --ray`'s
shard deployments (`serving.ray_serve.handles.RayShards`). A shard that does not answer (the
`ShardSet` retried it where it could) leaves the answers its name in `shards_missing` and why
in `unavailable`: the service fails the call UNAVAILABLE unless the request allowed a partial
answer — never a silently short answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from core.retrieval.ranking import best_k, ranked
from index.search.grouping import EXACT_PASS
from serving.logs import failure_reason
from serving.search.answers import EVERY_ROW, Answer, Exclusion, Hit, Scope
from serving.search.engine import SearchEngine, ServingPair
from serving.shards.messages import ShardAnswer, ShardRequest, ShardScope
from serving.shards.searcher import ShardSearcher

if TYPE_CHECKING:
    from serving.monitoring.ann_samples import ExactQuery


class ShardSet(Protocol):
    """How the ingress reaches its shards: `call(method, version, request)` asks every shard
    (retrying where it can, until `deadline`, a `time.monotonic()` value) and gives each shard's
    answer, or the exception it ended with."""

    names: list[str]

    def call(
        self, method: str, version: str, request: ShardRequest, deadline: float | None = None
    ) -> list[ShardAnswer | Exception]: ...


class LocalShards:
    """Every shard in this process, one `ShardSearcher` each: the merge without a cluster (tests,
    benchmarks' baseline of the hop)."""

    def __init__(self, index_root: str | Path, shards: int) -> None:
        self.searchers = [ShardSearcher(index_root, number) for number in range(shards)]
        self.names = [s.name for s in self.searchers]

    def call(
        self, method: str, version: str, request: ShardRequest, deadline: float | None = None
    ) -> list[ShardAnswer | Exception]:
        answers: list[ShardAnswer | Exception] = []
        for searcher in self.searchers:
            try:
                answers.append(getattr(searcher, method)(version, request))
            except Exception as exc:  # noqa: BLE001 - a shard's failure is its answer
                answers.append(exc)
        return answers


@dataclass
class _Split:
    """The shards' answers to one call: those that answered, and the names and errors of those that did not."""

    answers: list[ShardAnswer]
    missing: dict[str, str]

    @property
    def answered(self) -> tuple[str, ...]:
        return tuple(a.shard for a in self.answers)


class ShardedSearch:
    """The fan-out and exact merge behind a sharded server's engine: `search` answers as
    `SearchEngine.search` does, over every shard of the pair's version."""

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards

    def _call(self, method: str, version: str, request: ShardRequest, deadline: float | None = None) -> _Split:
        answers, missing = [], {}
        for name, answer in zip(self.shards.names, self.shards.call(method, version, request, deadline), strict=True):
            if isinstance(answer, Exception):
                missing[name] = failure_reason(answer)
            else:
                answers.append(answer)
        return _Split(answers, missing)

    @staticmethod
    def request(
        vectors: np.ndarray, k: int, exclude: Sequence[Exclusion], scopes: Sequence[Scope], ks: list[int] | None
    ) -> ShardRequest:
        distinct: dict[ShardScope, int] = {}
        scope_of = [distinct.setdefault(ShardScope.of(s), len(distinct)) for s in scopes]
        return ShardRequest(
            np.ascontiguousarray(vectors, dtype=np.float32),
            k,
            list(ks) if ks is not None else None,
            list(distinct),
            scope_of,
            list(exclude),
        )

    def search(
        self,
        pair: ServingPair,
        vectors: np.ndarray,
        k: int,
        exclude: Sequence[Exclusion],
        scopes: list[Scope] | None = None,
        ks: list[int] | None = None,
        deadline: float | None = None,
    ) -> list[Answer]:
        """Top-k per query within its scope over every shard, merged exactly (see the module);
        every shard call of it ends by `deadline` (a `time.monotonic()` value)."""
        scopes = scopes or [EVERY_ROW] * len(vectors)
        request = self.request(vectors, k, exclude, scopes, ks)
        split = self._call("search", pair.version, request, deadline)
        answers = []
        for i, scope in enumerate(scopes):
            if scope.group_by is None:
                answers.append(_merged_rows(split.answers, i, k, scope.min_score is not None))
            else:
                answers.append(_merged_groups(split.answers, i, ks[i] if ks else k, scope))
        spanning = [
            i for i, s in enumerate(scopes)
            if s.group_by is not None and s.per_group > 1 and _spans_shards(pair, s.group_by, len(self.shards.names))
        ]  # fmt: skip
        if spanning and split.answers:
            split = self._fill(pair, request, answers, scopes, spanning, split, deadline)
        missing = tuple(split.missing)
        unavailable = None
        if missing:
            unavailable = "; ".join(f"shard {name} did not answer: {why}" for name, why in split.missing.items())
        for answer in answers:
            answer.shards_answered, answer.shards_missing, answer.unavailable = split.answered, missing, unavailable
        return answers

    def _fill(
        self,
        pair: ServingPair,
        request: ShardRequest,
        answers: list[Answer],
        scopes: list[Scope],
        spanning: list[int],
        split: _Split,
        deadline: float | None,
    ) -> _Split:
        """Grouped by a field other than the shard key, with more than one row a group: the
        chosen groups' rows from every shard, each group's best `per_group` kept."""
        chosen = [list(dict.fromkeys(h.group for h in answers[i].hits)) for i in spanning]
        fill = ShardRequest(
            request.vectors[spanning],
            request.k,
            None,
            request.scopes,
            [request.scope_of[i] for i in spanning],
            [request.exclude[i] for i in spanning],
            chosen,
        )
        filled = self._call("fill", pair.version, fill, deadline)
        for j, i in enumerate(spanning):
            by_group = _best_per_group(filled.answers, j, scopes[i])
            kept = list(dict.fromkeys(h.group for h in answers[i].hits))
            answers[i].hits = [h for g in kept for h in by_group.get(g, [])]
        missing = {**split.missing, **filled.missing}
        return _Split([a for a in split.answers if a.shard not in missing], missing)

    def exact_top(
        self, pair: ServingPair, k: int, queries: Sequence[ExactQuery]
    ) -> list[tuple[list[int], list[float]]]:
        """Each query's exact top k rows over every shard (grouped: its top k groups, by value)
        and their exact scores (a group's: its best row's), best first, in one call to
        the shards: the monitor's reference for ANN fidelity, which compares by score where rows
        tie (a call a query cost as many shard calls as the searches it checked)."""
        scopes = [Scope(filter=q.filter, group_by=q.group_by) for q in queries]
        vectors = np.stack([q.vector for q in queries])
        request = self.request(vectors, k, [q.exclude for q in queries], scopes, None)
        split = self._call("exact", pair.version, request)
        if split.missing:
            raise RuntimeError("; ".join(f"shard {n}: {why}" for n, why in split.missing.items()))
        tops = []
        for i, query in enumerate(queries):
            rows, scores, named = _gathered(split.answers, i)
            order = ranked(scores, rows)
            if query.group_by is None:
                tops.append((rows[order][:k].tolist(), scores[order][:k].tolist()))
                continue
            best: dict[str, float] = {}  # each group once, at its best row's place
            for o in order.tolist():
                best.setdefault(named[o][0], float(scores[o]))
            tops.append((list(best)[:k], list(best.values())[:k]))
        return tops


class ShardedEngine(SearchEngine):
    """The one-index engine with its search a fan-out to the shards (`ShardedSearch`)."""

    searches_inline = False  # it waits on the shards' replicas: never on the loop

    def __init__(self, limits, sharded: ShardedSearch) -> None:
        super().__init__(limits)
        self.sharded = sharded

    def search(self, pair, vectors, k, exclude, scopes=None, ks=None, deadline=None):  # type: ignore[override]
        return self.sharded.search(pair, vectors, k, exclude, scopes, ks, deadline)


def _spans_shards(pair: ServingPair, field_name: str, shards: int) -> bool:
    """Whether a group of `field_name` may have rows in several shards: always, unless the field
    is the shard key (rows are placed by it) or there is one shard."""
    return shards > 1 and field_name != pair.manifest.shard_key


def _named_hit(rows: np.ndarray, scores: np.ndarray, named: list[tuple], o: int) -> Hit:
    """Hit `o` of a query's gathered answers (`_gathered`): its global row, score and names."""
    group, item_id, label, metadata, item = named[o]
    return Hit(int(rows[o]), float(scores[o]), group, item_id, label, metadata, item)


def _merged_rows(answers: list[ShardAnswer], i: int, k: int, scoped: bool) -> Answer:
    """Query i's rows from every shard, the best k (score descending, then row). With a min_score,
    truncated when any shard was or more than k reach it; else when fewer than k came back
    though some shard had more to give."""
    if not answers:
        return Answer([])
    rows, scores, named = _gathered(answers, i)
    hits = [_named_hit(rows, scores, named, o) for o in best_k(scores, k, rows).tolist()]
    short = any(bool(a.truncated[i]) for a in answers)
    truncated = (short or len(rows) > k) if scoped else (short and len(hits) < k)
    paths = [a.paths[i] for a in answers if a.paths[i] is not None]
    path = "index" if "index" in paths else (paths[0] if paths else None)
    return Answer(hits, truncated, path=path)


def _gathered(answers: list[ShardAnswer], i: int) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """Query i's hits from every shard, side by side: rows, scores and what names each."""
    rows = np.concatenate([a.hits(i)[0] for a in answers])
    scores = np.concatenate([a.hits(i)[1] for a in answers])
    return rows, scores, [n for a in answers for n in a.names(i)]


def _best_per_group(answers: list[ShardAnswer], i: int, scope: Scope) -> dict[str, list[Hit]]:
    """Query i's rows from every shard by group value, each group's best `per_group` (score
    descending, then row); the groups in the order of their best row."""
    if not answers:
        return {}
    rows, scores, named = _gathered(answers, i)
    by_group: dict[str, list[Hit]] = {}
    for o in ranked(scores, rows).tolist():
        its = by_group.setdefault(named[o][0], [])
        if len(its) < scope.per_group:
            its.append(_named_hit(rows, scores, named, o))
    return by_group


def _merged_groups(answers: list[ShardAnswer], i: int, k: int, scope: Scope) -> Answer:
    """Query i's best k groups from every shard's best k, each with its best `per_group` rows
    seen (a group's score: its best row's). Truncated as one index says: fewer than k groups,
    or — with a min_score — more groups reach it than k."""
    if not answers:
        return Answer([], truncated=scope.min_score is None, candidates=0)
    by_group = _best_per_group(answers, i, scope)
    chosen = list(by_group)[:k]  # dicts keep insertion order: best first row first
    hits = [h for g in chosen for h in by_group[g]]
    if scope.min_score is not None:
        truncated = any(bool(a.truncated[i]) for a in answers) or len(by_group) > k
    else:
        truncated = len(chosen) < k
    candidates = [int(a.candidates[i]) for a in answers]
    found = EXACT_PASS if EXACT_PASS in candidates else max(candidates)
    return Answer(hits, truncated, candidates=found)
