"""A shard replica's search: its shard of the versions it was asked for (the last two),
memory-mapped, searched by the one-index engine (`SearchEngine.search`) with the query's scope
made over its own rows — its own filter masks from the query's `Filter`, its own groups of the
group-by field, its own deleted rows, what the query excludes (`Exclusion`: ids and group
values) resolved over them — answering global rows, scores and what the service answers of
each row (`serving.shards.messages.ShardAnswer`). A shard replica of `serve --ray`
(`serving.ray_serve.replicas.ShardReplica`) holds one `ShardSearcher`; the ingress's fan-out
merges their answers (`serving.shards.fanout`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from core.artifacts import layout as artifacts
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable
from index.search.faiss_search import exact_within
from index.search.filters import Filter
from index.search.grouping import Groups, exact_groups, filled_groups
from index.versions.version import IndexVersion, ItemLocation, SampledItem
from serving.logs import shard_label
from serving.search.answers import EVERY_ROW, Answer, Exclusion, Hit, Scope, described
from serving.search.engine import SearchEngine, ServingPair
from serving.shards.messages import ShardAnswer, ShardRequest, ShardScope, resident_bytes

log = logging.getLogger(__name__)

VERSIONS_KEPT = 2  # a shard replica keeps its shard of this many versions open


def _hit_bytes(items: ItemTable) -> int:
    """The most bytes one hit over these rows can take in a pickled `ShardAnswer`: its row and
    score, its longest id, label and metadata, two field values (its group's and its item's: a
    field's value is a label or part of a row's metadata) and the envelope of its strings."""
    longest = []
    for column in (items.ids, items.labels, items.metadata.text):
        most = pc.max(pc.binary_length(column.array)).as_py() if len(column) else 0
        longest.append(most or 0)
    return 12 + sum(longest) + 2 * max(longest[1:]) + 64


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
            "labelled": opened.version.labelled, "memory_bytes": resident_bytes(),
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
