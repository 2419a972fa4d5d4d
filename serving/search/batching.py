"""Dynamic batching: concurrent queries coalesced into one ONNX Runtime batch and one faiss search.

A `Query` (immutable) goes in, its `Result` comes out. `SchedulingPolicy` decides when a batch
starts and how many queries it takes; `BatchedExecutor` (a queue and a batching task) and
`DirectExecutor` (batching off: one query per inference thread) carry it out, both through
`Inference`, the work of an inference thread. `DynamicBatcher` is the one the server holds.

The batcher lives on the server's asyncio loop. RPC handlers decode their images (small ones on
the loop, larger ones in the decode pool) and `await batcher.run(query)`; one task takes the
oldest job, waits at most `max_wait_s` for more (up to `max_batch_size`), and hands the whole
batch to an inference thread that embeds every image in one ORT call (or in runs of the rows
per run measured fastest for the model, see `QueryEmbedder.tune_run_rows`) and searches every
vector in one faiss call. A batch costs one thread hop, not one per query, and the loop stays
free to take RPCs while it runs.

Up to `streams` batches run at once, each on its own inference thread. A batch alone runs on
the model's full session; a batch beside another on the session with a share of ORT's threads
(where the model has one): two batches side by side keep the cores busy while each one's
Python work (stacking, faiss results, answers) runs, where one batch on every thread leaves
them idle then and stalls whenever a core is taken by decoding or gRPC. A free stream starts a
batch beside a running one once half a share (a share: max batch size / streams) is queued,
and a queue of several shares is split evenly among free streams: a few queries do not make a
batch of their own, which would cost the loop more per query than it gains.

The queue is bounded: when full, `run` fails at once with RESOURCE_EXHAUSTED instead of queueing
forever. A batch never mixes model/index pairs, so each answer comes from exactly the pair its
request started on. Jobs whose deadline passed while queued are answered DEADLINE_EXCEEDED, and
jobs whose caller went away (cancelled, deadline) are dropped before they cost any work.

A query may arrive with its image opened but not decoded (`image`): the inference thread decodes
it before embedding. The servicer hands over images this way when the hop to a decode thread
would cost about what decoding does (small images), or only add latency (with batching off, and
with batching on when the batcher is idle); a job whose pixels turn out corrupt fails alone,
not its batch.

An Embed call is a query with k = 0: embedded in the batch it lands in, searched for nothing.

With batching off, a query that finds others in flight likewise runs on the session with a
share of the threads (one each, by default) and a query alone on the full one: side by side,
runs sharing one intra-op pool would fight over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
from PIL import Image

from core.preprocess import EncodedImage, Region
from serving.errors import DeadlineExceeded, ResourceExhausted, ServiceError, Unavailable
from serving.monitoring.metrics import ServiceMetrics
from serving.search.engine import (
    EVERY_ROW,
    NOTHING_EXCLUDED,
    Exclusion,
    Hit,
    Scope,
    SearchEngine,
    ServingPair,
    UndecodedImages,
)

log = logging.getLogger(__name__)


class DecodePlacement(StrEnum):
    """Where a query's image is decoded."""

    ON_LOOP = "loop"  # on the event loop, before the query is submitted
    IN_BATCHER = "inference"  # by the inference thread that embeds it
    IN_POOL = "pool"  # in a decode thread, while the query waits for its batch
    AT_EMBEDDER = "embedder"  # where it is embedded: its bytes cross to the embedder deployment


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


@dataclass(eq=False, slots=True)
class Result:
    """A query's answer: its top-k hits (none for k = 0), its vector, and its stage times."""

    hits: list[Hit] = field(default_factory=list)
    truncated: bool = False  # min_score: more rows reach it than `hits` holds
    path: str | None = None  # a filtered query's: exact or index, as the planner chose
    candidates: int | None = None  # a grouped query's: rows its deciding round searched
    shards_answered: tuple[str, ...] = ()  # a sharded search's (`serving.search.engine.Answer`)
    shards_missing: tuple[str, ...] = ()
    unavailable: str | None = None
    vector: np.ndarray | None = None
    decode_s: float = 0.0
    queue_s: float = 0.0
    embed_s: float = 0.0
    search_s: float = 0.0
    batch_size: int = 1


@dataclass(eq=False, slots=True)
class _Work:
    """A query on its way through the batcher, with what the inference thread fills in."""

    query: Query
    result: Result
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    error: ServiceError | None = None  # its image failed to decode in the inference thread

    def expired(self, now: float) -> bool:
        return self.query.deadline is not None and now > self.query.deadline


@dataclass(frozen=True)
class SchedulingPolicy:
    """When a free stream starts a batch, and how many queued queries it takes: a function of
    the batcher's state (queued, running, filling), never of the queries themselves."""

    max_batch_size: int = 32
    streams: int = 1
    max_wait_s: float = 0.0

    @property
    def share(self) -> int:
        """The batch a stream takes beside others."""
        return -(-self.max_batch_size // self.streams)

    @property
    def beside(self) -> int:
        """Queued queries that start a batch beside a running one: half a share."""
        return -(-self.share // 2)

    def may_start(self, running: int, queued: int) -> bool:
        """Whether a free stream starts a batch now: when no other batch is running, or when half
        a share is queued. A few queries beside a running batch wait for it instead (many small
        batches cost the loop more than they gain); more would leave a core idle meanwhile."""
        return running == 0 or queued >= self.beside

    def limit(self, running: int, total: int) -> int:
        """How many of `total` (taken and queued) queries a batch takes. With other streams
        free, a queue holding several full shares is split evenly among as many of them, so
        batches run side by side instead of one after another."""
        free = self.streams - running  # this batch's stream among them
        return min(self.max_batch_size, -(-total // max(1, min(free, total // self.share))))

    def is_full(self, taken: int, limit: int, left: int) -> bool:
        """Whether a batch stops taking queries: at the size limit, or at its share with queries
        left for another."""
        return taken >= self.max_batch_size or (taken >= limit and left > 0)

    def decode_placement(self, queued: int, filling: bool, running: int) -> DecodePlacement:
        """Where an image not tiny enough for the loop is best decoded: by the inference thread
        when it would take the query at once (nothing queued, filling up or running: its batch
        would start at once), a decode thread only adding a round trip; else in the pool, while
        the query waits."""
        return DecodePlacement.IN_BATCHER if not queued and not filling and running == 0 else DecodePlacement.IN_POOL


class Inference:
    """The work of an inference thread, batched or not: decode what was left to it, embed every
    image in one ORT call and search every vector in one faiss call."""

    def __init__(self, engine: SearchEngine, metrics: ServiceMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def __call__(self, batch: list[_Work], side_by_side: bool = False) -> None:
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

    def _decode(self, work: _Work) -> np.ndarray | None:
        started = time.perf_counter()
        try:
            return self.engine.model_input(work.query.pair, work.query.image, work.query.region)
        except ServiceError as exc:
            work.error = exc
            return None
        finally:
            work.result.decode_s += time.perf_counter() - started

    def _embed_and_search(self, batch: list[_Work], arrays: dict[int, np.ndarray], side_by_side: bool) -> None:
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
                _latest_deadline(to_search),
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


def _latest_deadline(batch: list[_Work]) -> float | None:
    """When the last caller of a batch stops waiting (None: one of them waits as long as it takes)."""
    deadlines = [w.query.deadline for w in batch]
    return None if None in deadlines else max(deadlines)  # type: ignore[type-var]


class DirectExecutor:
    """Batching off: each query runs alone on an inference thread, `workers` of them at once."""

    def __init__(self, inference: Inference, workers: int, max_queue: int) -> None:
        self.inference = inference
        self.max_queue = max_queue
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="inference")
        self._in_flight = 0  # queries submitted and not yet answered

    async def run(self, work: _Work) -> None:
        if self._in_flight >= self.max_queue:
            raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already in flight")
        self._in_flight += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._threads, self._compute, work)
        finally:
            self._in_flight -= 1

    queued = 0  # no queue: a query waits for a thread, not for a batch

    @property
    def decode_placement(self) -> DecodePlacement:
        return DecodePlacement.IN_BATCHER  # the query runs alone on an inference thread either way

    def start(self) -> None:
        pass

    def pause(self) -> None:
        pass  # no queue to hold

    def resume(self) -> None:
        pass

    def _compute(self, work: _Work) -> None:
        if work.expired(time.monotonic()):
            raise DeadlineExceeded("deadline passed while the query was queued")
        # Another query in flight means runs side by side: each takes the session with a share
        # of the threads rather than sharing the full one's pool; a query alone gets them all.
        self.inference([work], side_by_side=self._in_flight > 1)
        if work.error is not None:
            raise work.error

    async def stop(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


class BatchedExecutor:
    """Batching on: a bounded queue and a batching task on the loop that forms batches by the
    policy and runs up to `policy.streams` of them at once, each on its own inference thread."""

    def __init__(self, inference: Inference, policy: SchedulingPolicy, max_queue: int) -> None:
        self.inference = inference
        self.policy = policy
        self.max_queue = max_queue
        self._threads = ThreadPoolExecutor(policy.streams, thread_name_prefix="inference")
        self._queue: deque[_Work] = deque()
        self._running = 0  # batches handed to the inference threads and not yet answered
        self._filling = False  # a batch waits for more queries before it starts
        self._arrived = asyncio.Event()  # binds to a loop on first use, not here
        self._stream_freed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the batching task runs on

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def decode_placement(self) -> DecodePlacement:
        return self.policy.decode_placement(len(self._queue), self._filling, self._running)

    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._batches(), name="batcher")

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._arrived.set)  # wake the batching task

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._batch_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._queue:
            work = self._queue.popleft()
            if not work.future.done():
                work.future.set_exception(Unavailable("server is shutting down"))
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(self, work: _Work) -> None:
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already queued")
        work.future = asyncio.get_running_loop().create_future()
        self._queue.append(work)
        self.inference.metrics.queue_depth.set(len(self._queue))
        self._arrived.set()
        await work.future  # cancelled with the RPC; the batcher then skips the query

    # -- batching task ----------------------------------------------------------------------

    def _take_ready(self, batch: list[_Work]) -> bool:
        """Move queued queries of the batch's pair into it (up to its limit), oldest first;
        whether the batch is full."""
        now = time.monotonic()
        kept: deque[_Work] = deque()
        limit = self.policy.limit(self._running, len(batch) + len(self._queue))
        while self._queue and len(batch) < limit:
            work = self._queue.popleft()
            if work.future.done():  # its caller went away
                continue
            if work.expired(now):
                work.future.set_exception(DeadlineExceeded("deadline passed while the query was queued"))
                continue
            if batch and work.query.pair is not batch[0].query.pair:
                kept.append(work)
                continue
            batch.append(work)
        self._queue.extendleft(reversed(kept))
        return self.policy.is_full(len(batch), limit, len(self._queue))

    async def _take_batch(self) -> list[_Work]:
        loop = asyncio.get_running_loop()
        batch: list[_Work] = []
        until: float | None = None
        while True:
            # Paused, no new batch starts; one already filling goes on filling.
            may_start = not self._paused and self.policy.may_start(self._running, len(self._queue))
            if (batch or may_start) and self._take_ready(batch):
                break
            if batch:
                until = until if until is not None else loop.time() + self.policy.max_wait_s
                remaining = until - loop.time()
                if remaining <= 0:
                    break
            self._arrived.clear()
            # A batch waiting to fill counts as running: images arriving now decode in the pool
            # while it waits, not one after another in the inference thread once it is full.
            self._filling = bool(batch)
            try:
                if not batch:
                    await self._arrived.wait()
                    continue
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                self._take_ready(batch)
                break
            except asyncio.CancelledError:  # stopping: the queries go back, to be failed by stop()
                self._queue.extendleft(reversed(batch))
                raise
            finally:
                self._filling = False
        self.inference.metrics.queue_depth.set(len(self._queue))
        return batch

    async def _batches(self) -> None:
        while True:
            while self._running >= self.policy.streams:
                self._stream_freed.clear()
                await self._stream_freed.wait()
            self._start_batch(await self._take_batch())

    def _start_batch(self, batch: list[_Work]) -> None:
        # Not inline in `_batches`: its locals would keep the last batch, and through it a
        # pair swapped out since, alive until the next batch forms.
        self._running += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, batch: list[_Work]) -> None:
        loop = asyncio.get_running_loop()
        # A batch beside another runs on the session with a share of the threads (where the
        # model has one); a batch alone gets them all.
        try:
            await loop.run_in_executor(self._threads, self.inference, batch, self._running > 1)
        except asyncio.CancelledError:
            for work in batch:
                if not work.future.done():
                    work.future.set_exception(Unavailable("server is shutting down"))
            raise
        except Exception as exc:  # a bug must fail the batch's requests, not the batcher
            log.exception("batch of %d failed", len(batch))
            for work in batch:
                if not work.future.done():
                    work.future.set_exception(exc)
            return
        finally:
            self._running -= 1
            self._stream_freed.set()
            self._arrived.set()  # queries left waiting beside this batch may start now
        for work in batch:
            if work.future.done():
                continue
            if work.error is not None:
                work.future.set_exception(work.error)
            else:
                work.future.set_result(None)


class DynamicBatcher:
    """The server's batcher: batched (`enabled`) or direct, over one `Inference`."""

    def __init__(
        self,
        engine: SearchEngine,
        metrics: ServiceMetrics,
        max_batch_size: int = 32,
        max_wait_s: float = 0.002,
        max_queue: int = 1024,
        enabled: bool = True,
        workers: int = 1,
        streams: int = 1,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_s < 0 or workers < 1 or streams < 1:
            raise ValueError("max_batch_size, max_queue, workers and streams must be ≥ 1, max_wait_s ≥ 0")
        self.metrics = metrics
        self.enabled = enabled
        inference = Inference(engine, metrics)
        self.executor: BatchedExecutor | DirectExecutor = (
            BatchedExecutor(inference, SchedulingPolicy(max_batch_size, streams, max_wait_s), max_queue)
            if enabled
            else DirectExecutor(inference, workers, max_queue)
        )
        self._stopped = False

    def start(self) -> None:
        """Start the batching task on the running loop."""
        self.executor.start()

    def pause(self) -> None:
        """Start no new batch until `resume`: queries queue up meanwhile (and the queue can fill),
        while a batch already taken finishes. A hook for tests and drills that need a full
        queue or queued work at a moment they choose, not at whatever moment load happens to
        produce one; safe from any thread. Without batching there is no queue: no effect."""
        self.executor.pause()

    def resume(self) -> None:
        """Undo `pause`: the queued queries are taken as if they had just arrived, in batches up
        to the size limit. Safe from any thread."""
        self.executor.resume()

    @property
    def queued(self) -> int:
        """Queries waiting for a batch (not those taken into one)."""
        return self.executor.queued

    @property
    def decode_placement(self) -> DecodePlacement:
        """Where an image too large for the loop is best decoded now: IN_BATCHER, by the
        inference thread, when it would take the query at once (always with batching off);
        else IN_POOL, while the query waits."""
        return self.executor.decode_placement

    async def run(self, query: Query) -> Result:
        """The query's result, computed in a batch with whatever else is queued."""
        if self._stopped:
            raise Unavailable("server is shutting down")
        work = _Work(query, Result(decode_s=query.decode_s))
        await self.executor.run(work)
        return work.result

    async def stop(self) -> None:
        """Refuse new queries, fail queued and running ones with UNAVAILABLE, and stop the inference threads."""
        self._stopped = True
        await self.executor.stop()
