"""The messages between a sharded server's ingress and its shards: a batch of queries for every
shard (`ShardRequest`, each query's scope as a shard needs it: `ShardScope`) and one shard's
answers to it (`ShardAnswer`): global rows, scores and what the service answers of each row
(its id, label, metadata, group value) — no vectors leave a shard, and the ingress needs no
row of its own to answer. The ingress makes the requests and merges the answers
(`serving.shards.fanout`); a shard replica answers them (`serving.shards.searcher`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from index.search.filters import Filter
from serving.search.answers import Answer, Exclusion, Hit, Scope

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
        """`answers` (described: `serving.search.answers.described`) over a shard whose first global row is `offset`."""
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
            resident_bytes(),
        )


def _names_of(hit: Hit) -> tuple[str | None, str, str | None, str, str | None]:
    """What names a hit, as a `ShardAnswer` carries it (`serving.shards.fanout` makes the hit again)."""
    return hit.group, hit.id, hit.label, hit.metadata, hit.item


def resident_bytes() -> int:
    """This process's resident memory (what a shard replica's rows and index cost it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
