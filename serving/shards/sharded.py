"""Sharded search: an index version's shards searched apart and their answers merged exactly.

`serve --ray` (`serving.ray_serve.deployment`) serves a version from one deployment per shard. Each shard
replica holds a `ShardSearcher`: its shard of the versions it was asked for (the last two),
memory-mapped, searched by the one-index engine (`SearchEngine.search`) with the query's scope
made over its own rows — its own filter masks from the query's `Filter`, its own groups of the
group-by field, its own deleted rows, what the query excludes (`Exclusion`: ids and group
values) resolved over them — answering
global rows, scores and what the service answers of each row (`ShardAnswer`: its id, label,
metadata, group value): no vectors leave a shard, and the ingress needs no row of its own to
answer.

The ingress's `ShardedSearch` has the contract of `SearchEngine.search` (a list of `Answer`)
and merges the shards' answers exactly, in the order a version's segments are merged in one
process (`core.ranking`): the best k of their rows (score descending, then row);
grouped, each shard's best k groups, of which the best k (a group's score is its best row's),
groups told apart by value.
Rows are placed by their item, so grouped by the item field (the shard key) a group lives in
one shard and its rows come whole from it; grouped by another field a group spans shards, its
best row is still in some shard's top k groups, but its other rows are then filled from every
shard (`ShardSearcher.fill`). A min_score keeps every shard's rows above it; `truncated` is the
one-index meaning, from the shards' own.

A shard that does not answer (`ShardSet` retried it where it could) leaves the answers its
name in `shards_missing` and why in `unavailable`: the service fails the call UNAVAILABLE
unless the request allowed a partial answer — never a silently short answer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow.compute as pc

from core import artifacts
from core.artifacts import ArtifactError
from core.items import ItemTable
from core.ranking import best_k, ranked
from index.search.faiss_search import exact_within
from index.search.filters import Filter
from index.search.grouping import EXACT_PASS, Groups, exact_groups, filled_groups
from index.versions.version import IndexVersion, ItemLocation, SampledItem
from serving.logs import shard_label
from serving.search.engine import EVERY_ROW, Answer, Exclusion, Hit, Scope, SearchEngine, ServingPair, described

if TYPE_CHECKING:
    from serving.monitoring.monitor import ExactQuery

log = logging.getLogger(__name__)

VERSIONS_KEPT = 2  # a shard replica keeps its shard of this many versions open
NO_CANDIDATES = -2  # a ShardAnswer's `candidates` for a query that was not grouped


@dataclass(frozen=True)
class ShardScope:
    """What a query's `Scope` says, as a shard needs it: the filter itself (the shard makes its
    own mask), min_score, the group-by field's name and rows per group."""

    filter: Filter | None = None
    min_score: float | None = None
    group_by: str | None = None
    per_group: int = 1

    @classmethod
    def of(cls, scope: Scope) -> ShardScope:
        return cls(scope.filter, scope.min_score, scope.group_by, scope.per_group)


@dataclass
class ShardRequest:
    """A batch of queries for every shard: their vectors, k (and each one's own), the distinct
    scopes and each query's, and each query's exclusion (ids and group values, which each shard
    resolves over its own rows; rows, GLOBAL: a shard keeps those in its range). With `chosen`
    (a fill): each query's groups, by value, whose rows every shard fills."""

    vectors: np.ndarray
    k: int
    ks: list[int] | None
    scopes: list[ShardScope]
    scope_of: list[int]
    exclude: list[Exclusion]
    chosen: list[list[str]] | None = None

    def most_hits(self) -> int:
        """The most hits a shard's answer to it can hold: each query's k (grouped: groups) times
        its rows a group — what the call's reply size is bounded by (`ShardSearcher.hit_bytes`)."""
        ks = self.ks if self.ks is not None else [self.k] * len(self.scope_of)
        return sum(k * self.scopes[s].per_group for k, s in zip(ks, self.scope_of, strict=True))


@dataclass
class ShardAnswer:
    """One shard's answers to a batch, flat: query i's hits are `rows[starts[i]:starts[i+1]]`
    (global rows), their scores and what names them (`named`: each hit's group value, id,
    label, metadata and item value, `Hit`'s fields), best first — grouped, group by group."""

    shard: str
    rows: np.ndarray
    scores: np.ndarray
    counts: np.ndarray
    truncated: np.ndarray
    candidates: np.ndarray
    paths: list[str | None]
    named: list[tuple[str | None, str, str | None, str, str | None]]
    search_s: float = 0.0
    rows_held: int = 0
    memory_bytes: int = 0
    starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def hits(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.rows[a:b], self.scores[a:b]

    def names(self, i: int) -> list[tuple[str | None, str, str | None, str, str | None]]:
        return self.named[self.starts[i] : self.starts[i + 1]]

    @classmethod
    def of(cls, shard: str, answers: Sequence[Answer], offset: int, search_s: float, rows_held: int) -> ShardAnswer:
        """`answers` (described: `serving.search.engine.described`) over a shard whose first global row is `offset`."""
        rows = [h.row + offset for a in answers for h in a.hits]
        return cls(
            shard,
            np.asarray(rows, dtype=np.int64),
            np.asarray([h.score for a in answers for h in a.hits], dtype=np.float32),
            np.asarray([len(a.hits) for a in answers], dtype=np.int64),
            np.asarray([a.truncated for a in answers], dtype=bool),
            np.asarray([NO_CANDIDATES if a.candidates is None else a.candidates for a in answers], dtype=np.int64),
            [a.path for a in answers],
            [_names_of(h) for a in answers for h in a.hits],
            search_s,
            rows_held,
            _resident_bytes(),
        )


def _names_of(hit: Hit) -> tuple[str | None, str, str | None, str, str | None]:
    """What names a hit, as a `ShardAnswer` carries it (`_named_hit` makes the hit again)."""
    return hit.group, hit.id, hit.label, hit.metadata, hit.item


def _named_hit(rows: np.ndarray, scores: np.ndarray, named: list[tuple], o: int) -> Hit:
    """Hit `o` of a query's gathered answers (`_gathered`): its global row, score and names."""
    group, item_id, label, metadata, item = named[o]
    return Hit(int(rows[o]), float(scores[o]), group, item_id, label, metadata, item)


def _hit_bytes(items: ItemTable) -> int:
    """The most bytes one hit over these rows can take in a pickled `ShardAnswer`: its row and
    score, its longest id, label and metadata, two field values (its group's and its item's: a
    field's value is a label or part of a row's metadata) and the envelope of its strings."""
    longest = []
    for column in (items.ids, items.labels, items.metadata.text):
        most = pc.max(pc.binary_length(column.array)).as_py() if len(column) else 0
        longest.append(most or 0)
    return 12 + sum(longest) + 2 * max(longest[1:]) + 64


def _resident_bytes() -> int:
    """This process's resident memory (what a shard replica's rows and index cost it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# -- the shard side ----------------------------------------------------------------------------


class _OpenShard:
    """One shard of one version, loaded (its files checked against the manifest's checksums)."""

    def __init__(self, version: IndexVersion, number: int) -> None:
        shard, self.unit = version.unit(number), version.units()[number]
        self.offset = self.unit.offset
        self.name = shard_label(number)
        self.version = shard.load()
        self.pair = ServingPair(None, shard.searchable(), shard)  # type: ignore[arg-type]  # no model: vectors come in
        self.engine = SearchEngine()
        self.size = len(shard.items)
        self.hit_bytes = _hit_bytes(shard.items)
        self._masks: dict[Filter, np.ndarray] = {}
        self._lock = threading.Lock()

    def mask(self, query: Filter | None) -> np.ndarray | None:
        """The rows of this shard a filter keeps, from its own filters (kept, read-only: queries of
        one filter share the array, so the engine searches them together)."""
        if query is None:
            return None
        with self._lock:
            found = self._masks.get(query)
        if found is None:
            filters = self.version.filters
            if filters is None:
                raise ValueError(f"shard {self.name}: filter on a version that declares no filterable fields")
            found = filters.mask(query)
            found.flags.writeable = False
            with self._lock:
                self._masks[query] = found
                while len(self._masks) > 16:
                    self._masks.pop(next(iter(self._masks)))
        return found

    def scopes(self, request: ShardRequest) -> list[Scope]:
        made = [self.scope(s) for s in request.scopes]
        return [made[i] for i in request.scope_of]

    def scope(self, scope: ShardScope) -> Scope:
        if scope == ShardScope():
            return EVERY_ROW
        groups = self.version.groups(scope.group_by) if scope.group_by else None
        return Scope(self.mask(scope.filter), scope.min_score, groups, scope.per_group, scope.filter)

    def local(self, exclusion: Exclusion) -> Exclusion:
        """An exclusion over this shard: its global rows in the shard's range as the shard's own;
        its ids and group values as they are (resolved here, `Exclusion.rows_in`)."""
        if not exclusion.rows:
            return exclusion
        rows = np.fromiter(exclusion.rows, dtype=np.int64, count=len(exclusion.rows))
        return Exclusion(frozenset(self.unit.own(rows).tolist()), exclusion.ids, exclusion.groups)

    def left_out(self, exclusion: Exclusion, groups: Groups | None) -> frozenset[int]:
        """The shard's own rows an exclusion leaves out of a query grouped by `groups` (or not)."""
        return self.local(exclusion).rows_in(self.version, groups)

    def eligible(self, scope: Scope, groups: Groups | None) -> np.ndarray | None:
        """The rows a query may answer with here: its filter's, less deleted rows (and, grouped,
        those without a value)."""
        allowed = scope.allowed
        live = self.version.live_mask
        if live is not None:
            allowed = live if allowed is None else allowed & live
        if groups is not None and groups.has_value is not None:
            allowed = groups.has_value if allowed is None else allowed & groups.has_value
        return allowed


class ShardSearcher:
    """A shard replica's work: shard `number` of whichever version of the index root a call
    names, the last `VERSIONS_KEPT` kept open, a version opened on demand — so every answer
    comes from the version its call named, never a mix."""

    def __init__(self, index_root: str | Path, number: int) -> None:
        self.index_root = Path(index_root)
        self.number = number
        self.name = shard_label(number)
        self._open: OrderedDict[str, _OpenShard] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, version: str) -> _OpenShard:
        """This shard of `version`, loaded (ArtifactError naming the shard when its files are
        missing or damaged)."""
        with self._lock:
            found = self._open.get(version)
            if found is not None:
                self._open.move_to_end(version)
                return found
        whole = IndexVersion(artifacts.version_dir(self.index_root, version))
        if len(whole.units()) <= self.number:
            raise ArtifactError(
                f"version {version} has {len(whole.units())} shards: this deployment's shard {self.name} is not in it"
            )
        try:
            opened = _OpenShard(whole, self.number)
        except Exception as exc:
            log.error(
                "shard %s cannot open version %s: %s", self.name, version, exc,
                extra={"shard": self.name, "index_version": version},
            )  # fmt: skip
            raise
        with self._lock:
            self._open[version] = opened
            while len(self._open) > VERSIONS_KEPT:
                self._open.popitem(last=False)
        return opened

    def warm(self, version: str) -> dict:
        """Open `version` ahead of its first query (a reload does, on every replica, before the
        ingress swaps): its rows, the most bytes a hit of it takes in an answer, and what the
        replica holds."""
        opened = self.open(version)
        return {
            "shard": self.name, "rows": opened.size, "hit_bytes": opened.hit_bytes,
            "labelled": opened.version.labelled, "memory_bytes": _resident_bytes(),
        }  # fmt: skip

    def locate(self, version: str, asked: tuple[str, str | None]) -> ItemLocation | None:
        """Item `asked[0]` where this shard of `version` holds it live: its GLOBAL row, stored
        vector and value of the field `asked[1]` (`IndexVersion.locate`); None when it does not."""
        item_id, field_name = asked
        shard = self.open(version)
        found = shard.version.locate(item_id, field_name)
        return None if found is None else dataclasses.replace(found, row=found.row + shard.offset)

    def probe_sample(self, version: str, asked: tuple[int, str | None]) -> list[SampledItem]:
        """This shard's part of `version`'s probe sample (`IndexVersion.probe_sample(*asked)`),
        GLOBAL rows: the shards' parts merged by their keys are the whole version's sample."""
        shard = self.open(version)
        return [dataclasses.replace(s, row=s.row + shard.offset) for s in shard.version.probe_sample(*asked)]

    def search(self, version: str, request: ShardRequest) -> ShardAnswer:
        """The engine's answers over this shard's rows: global rows and scores."""
        started = time.perf_counter()
        shard = self.open(version)
        if shard.size == 0 or not len(request.vectors):
            empty = [Answer([]) for _ in request.scope_of]
            return ShardAnswer.of(self.name, empty, shard.offset, 0.0, shard.size)
        exclude = [shard.local(e) for e in request.exclude]
        answers = shard.engine.search(
            shard.pair, request.vectors, request.k, exclude, shard.scopes(request), request.ks
        )
        return ShardAnswer.of(self.name, answers, shard.offset, time.perf_counter() - started, shard.size)

    def exact(self, version: str, request: ShardRequest) -> ShardAnswer:
        """Exact search over this shard's rows (every eligible row scored): each query's top k
        rows — grouped, its top k groups, each as its best row — made as the one-index search
        makes its exact answers (`exact_within`, `exact_groups`, `filled_groups`)."""
        started = time.perf_counter()
        shard = self.open(version)
        stored = shard.version.vectors
        answers = []
        scopes = shard.scopes(request)
        for vector, scope, skip in zip(request.vectors, scopes, request.exclude, strict=True):
            groups = scope.groups
            if shard.size == 0 or (groups is not None and not len(groups)):
                answers.append(Answer([]))
                continue
            eligible, local = shard.eligible(scope, groups), shard.left_out(skip, groups)
            if groups is None:
                rows = np.flatnonzero(eligible) if eligible is not None else np.arange(shard.size)
                if local:
                    rows = rows[~np.isin(rows, np.fromiter(local, dtype=np.int64, count=len(local)))]
                scores, found = exact_within(stored, vector[None], request.k, rows)
                answers.append(
                    Answer([Hit(int(r), float(c)) for r, c in zip(found[0], scores[0], strict=True) if r >= 0])
                )
                continue
            best = exact_groups(vector, stored, groups, request.k, eligible, local, None)[: request.k]
            filled = filled_groups(best, vector, stored, groups, 1, eligible, local, None, request.k)
            answers.append(Answer([Hit(row, score) for _, hits in filled.groups for row, score in hits]))
        answers = described(answers, shard.version, scopes)
        return ShardAnswer.of(self.name, answers, shard.offset, time.perf_counter() - started, shard.size)

    def fill(self, version: str, request: ShardRequest) -> ShardAnswer:
        """Each query's chosen groups (`request.chosen`, by value) filled from this shard: the
        best `per_group` of each one's eligible rows here, scored exactly (`filled_groups`, as
        the one-index search fills its groups)."""
        started = time.perf_counter()
        shard = self.open(version)
        answers = []
        scopes = shard.scopes(request)
        for i, (vector, scope) in enumerate(zip(request.vectors, scopes, strict=True)):
            groups = scope.groups
            if groups is None or shard.size == 0:
                answers.append(Answer([]))
                continue
            chosen = [groups.code_of(value) for value in (request.chosen or [[]] * len(request.vectors))[i]]
            codes = [code for code in chosen if code is not None]
            filled = filled_groups(
                codes, vector, shard.version.vectors, groups, scope.per_group, shard.eligible(scope, groups),
                shard.left_out(request.exclude[i], groups), scope.min_score, len(codes),
            )  # fmt: skip
            answers.append(Answer([Hit(row, score) for _, hits in filled.groups for row, score in hits]))
        answers = described(answers, shard.version, scopes)
        return ShardAnswer.of(self.name, answers, shard.offset, time.perf_counter() - started, shard.size)


# -- the ingress side --------------------------------------------------------------------------


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
    `SearchEngine.search` does, over every shard of the pair's version. `observe(answer,
    seconds)` hears each shard's answer (the server's per-shard metrics)."""

    def __init__(self, shards: ShardSet, observe=None) -> None:
        self.shards = shards
        self.observe = observe

    def _call(self, method: str, version: str, request: ShardRequest, deadline: float | None = None) -> _Split:
        answers, missing = [], {}
        for name, answer in zip(self.shards.names, self.shards.call(method, version, request, deadline), strict=True):
            if isinstance(answer, Exception):
                missing[name] = failure_reason(answer)
            else:
                answers.append(answer)
                if self.observe is not None:
                    self.observe(answer)
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


def _spans_shards(pair: ServingPair, field_name: str, shards: int) -> bool:
    """Whether a group of `field_name` may have rows in several shards: always, unless the field
    is the shard key (rows are placed by it) or there is one shard."""
    return shards > 1 and field_name != pair.manifest.shard_key


def failure_reason(exc: BaseException, typed: bool = True, first: bool = False) -> str:
    """An exception as one line: its message's last non-blank line (a remote error's message is a
    traceback that ends with the error; `first`: its first line), after its type's name. With
    `typed=False` the line alone, or the type's name where the message is blank."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = (lines[0] if first else lines[-1]) if lines else ""
    if not typed:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}".rstrip(": ")


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
