"""The work of an inference thread, batched or not (`serving.search.batching`): a `Query` (immutable)
goes in, its `Result` comes out; `Inference` decodes the images left to it, embeds every image
in one ORT call and searches every vector in one faiss call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from core.data.preprocess import EncodedImage, Region
from serving.errors import ServiceError
from serving.search.answers import EVERY_ROW, NOTHING_EXCLUDED, Exclusion, Hit, Scope
from serving.search.engine import SearchEngine, ServingPair, UndecodedImages
from serving.telemetry.metrics import ServiceMetrics


# Slots: built for every query on the loop, where a frozen dataclass without them costs twice as much.
@dataclass(frozen=True, eq=False, slots=True)
class Query:
    """One query: an image to embed (`array`, or `image` still to decode), a text (`text_ids`) or a ready `vector`,
    searched for k neighbours; with k = 0 (an Embed call) only embedded, its result's `vector`
    the answer."""

    pair: ServingPair
    k: int
    exclude: Exclusion = NOTHING_EXCLUDED
    scope: Scope = EVERY_ROW
    array: np.ndarray | EncodedImage | None = None  # the model input, or the image for the embedder to decode
    image: Image.Image | None = None  # opened, pixels not decoded: the inference thread decodes it
    region: Region | None = None  # only this part of `image` (checked against its size already)
    vector: np.ndarray | None = None
    text_ids: np.ndarray | None = None  # a text to embed, as its token ids for the pair's text model
    deadline: float | None = None  # time.monotonic() value
    received: float = field(default_factory=time.perf_counter)
    decode_s: float = 0.0  # spent decoding before it was submitted
    background: bool = False  # the server's own (a probe round's): batched only when no user query waits


@dataclass(eq=False, slots=True)
class Result:
    """A query's answer: its top-k hits (none for k = 0), its vector, and its stage times."""

    hits: list[Hit] = field(default_factory=list)
    truncated: bool = False  # min_score: more rows reach it than `hits` holds
    path: str | None = None  # a filtered query's: exact or index, as the planner chose
    candidates: int | None = None  # a grouped query's: rows its deciding round searched
    shards_answered: tuple[str, ...] = ()  # a sharded search's (`serving.search.answers.Answer`)
    shards_missing: tuple[str, ...] = ()
    unavailable: str | None = None
    vector: np.ndarray | None = None
    decode_s: float = 0.0
    queue_s: float = 0.0
    embed_s: float = 0.0
    search_s: float = 0.0
    batch_size: int = 1


@dataclass(eq=False, slots=True)
class Work:
    """A query on its way through the batcher, with what the inference thread fills in."""

    query: Query
    result: Result
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    error: ServiceError | None = None  # its image failed to decode in the inference thread

    def expired(self, now: float) -> bool:
        return self.query.deadline is not None and now > self.query.deadline


class Inference:
    """The work of an inference thread, batched or not: decode what was left to it, embed every
    image in one ORT call and search every vector in one faiss call."""

    def __init__(self, engine: SearchEngine, metrics: ServiceMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def __call__(self, batch: list[Work], side_by_side: bool = False) -> None:
        """Fill in each query's result; one whose image fails to decode here gets its `error` set."""
        started = time.perf_counter()
        arrays: dict[int, np.ndarray] = {}
        for work in batch:
            work.result.queue_s = started - work.enqueued
            if work.query.image is not None:
                arrays[id(work)] = self._decode(work)
            elif work.query.array is not None:
                arrays[id(work)] = work.query.array
        answered = [w for w in batch if w.error is None]
        if answered:
            self._embed_and_search(answered, arrays, side_by_side)

    def _decode(self, work: Work) -> np.ndarray | None:
        started = time.perf_counter()
        try:
            return self.engine.model_input(work.query.pair, work.query.image, work.query.region)
        except ServiceError as exc:
            work.error = exc
            return None
        finally:
            work.result.decode_s += time.perf_counter() - started

    def _embed_and_search(self, batch: list[Work], arrays: dict[int, np.ndarray], side_by_side: bool) -> None:
        started = time.perf_counter()
        pair = batch[0].query.pair
        to_embed = [w for w in batch if w.query.vector is None and w.query.text_ids is None]
        texts = [w for w in batch if w.query.text_ids is not None]
        for work in batch:
            if work.query.vector is not None:
                work.result.vector = work.query.vector
        if to_embed:
            try:
                vectors = self.engine.embed(pair, [arrays[id(w)] for w in to_embed], side_by_side)
            except UndecodedImages as undecoded:  # the others of the batch go on
                vectors = undecoded.vectors
                for i, error in undecoded.errors.items():
                    to_embed[i].error = error
            for work, vector in zip(to_embed, vectors, strict=True):
                work.result.vector = vector
            to_embed = [w for w in to_embed if w.error is None]
        if texts:  # the batch's texts in one run of the text model, beside its images' run
            vectors = self.engine.embed_texts(pair, [w.query.text_ids for w in texts])
            for work, vector in zip(texts, vectors, strict=True):
                work.result.vector = vector
            to_embed += texts
        embedded = time.perf_counter()
        to_search = [w for w in batch if w.query.k > 0 and w.error is None]
        if to_search:
            k = max(w.query.k for w in to_search)
            vectors = np.stack([w.result.vector for w in to_search])
            found = self.engine.search(
                pair,
                vectors,
                k,
                [w.query.exclude for w in to_search],
                [w.query.scope for w in to_search],
                [w.query.k for w in to_search],
                latest_deadline(to_search),
            )
            for work, answer in zip(to_search, found, strict=True):
                grouped = work.query.scope.group_by is not None  # searched to its own k groups already
                work.result.hits = answer.hits if grouped else answer.hits[: work.query.k]
                cut = not grouped and work.query.scope.min_score is not None and len(answer.hits) > work.query.k
                work.result.truncated = answer.truncated or cut
                work.result.path = answer.path
                work.result.candidates = answer.candidates
                work.result.shards_answered = answer.shards_answered
                work.result.shards_missing = answer.shards_missing
                work.result.unavailable = answer.unavailable
        searched = time.perf_counter()
        self.metrics.batch_size.observe(len(batch))
        embedding, searching = set(map(id, to_embed)), set(map(id, to_search))
        for work in batch:
            work.result.embed_s = embedded - started if id(work) in embedding else 0.0
            work.result.search_s = searched - embedded if id(work) in searching else 0.0
            work.result.batch_size = len(batch)


def latest_deadline(batch: list[Work]) -> float | None:
    """When the last caller of a batch stops waiting (None: one of them waits as long as it takes)."""
    deadlines = [w.query.deadline for w in batch]
    return None if None in deadlines else max(deadlines)  # type: ignore[type-var]
