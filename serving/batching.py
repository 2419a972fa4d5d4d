"""Dynamic batching: concurrent queries coalesced into one ONNX Runtime batch and one faiss search.

The batcher lives on the server's asyncio loop. RPC handlers decode their images (small ones on
the loop, larger ones in the decode pool) and `await batcher.run(job)`; one task takes the oldest job, waits at most
`max_wait_s` for more (up to `max_batch_size`), and hands the whole batch to one inference thread
that embeds every image in one ORT call and searches every vector in one faiss call. A batch
costs one thread hop, not one per query, and the loop stays free to take RPCs while it runs.

The queue is bounded: when full, `run` fails at once with RESOURCE_EXHAUSTED instead of queueing
forever. A batch never mixes model/index pairs, so each answer comes from exactly the pair its
request started on. Jobs whose deadline passed while queued are answered DEADLINE_EXCEEDED, and
jobs whose caller went away (cancelled, deadline) are dropped before they cost any work.

A job may arrive with its image opened but not decoded (`image`): the inference thread decodes
it before embedding. The servicer hands over images this way when the hop to a decode thread
would only add latency — with batching off, and with batching on when the batcher is idle —
and a job whose pixels turn out corrupt fails alone, not its batch.

An Embed call is a job with k = 0: embedded in the batch it lands in, searched for nothing.

With batching off, a query that finds others in flight runs on the model's single-threaded
session (where it has one) and a query alone on the multi-threaded one: side by side, runs
sharing one intra-op pool would fight over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from serving.engine import Hit, SearchEngine, ServingPair
from serving.errors import DeadlineExceeded, ResourceExhausted, ServiceError, Unavailable
from serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One query: an image to embed (`array`, or `image` still to decode) or a ready vector,
    searched for k neighbours; with k = 0 (an Embed call) only embedded, its `vector` the answer."""

    pair: ServingPair
    k: int
    exclude: set[int]
    array: np.ndarray | None = None
    image: Image.Image | None = None  # opened, pixels not decoded: the inference thread decodes it
    vector: np.ndarray | None = None
    deadline: float | None = None  # time.monotonic() value
    future: asyncio.Future | None = None
    received: float = field(default_factory=time.perf_counter)
    enqueued: float = 0.0
    decode_s: float = 0.0
    queue_s: float = 0.0
    embed_s: float = 0.0
    search_s: float = 0.0
    batch_size: int = 1
    error: ServiceError | None = None  # its image failed to decode in the inference thread


class DynamicBatcher:
    def __init__(
        self,
        engine: SearchEngine,
        metrics: ServiceMetrics,
        max_batch_size: int = 32,
        max_wait_s: float = 0.002,
        max_queue: int = 1024,
        enabled: bool = True,
        workers: int = 1,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_s < 0 or workers < 1:
            raise ValueError("max_batch_size, max_queue and workers must be ≥ 1, max_wait_s ≥ 0")
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.enabled = enabled
        # Batched: one thread runs one batch at a time (ORT and faiss use the cores themselves).
        # Unbatched: each query runs alone, `workers` of them at once.
        self._inference = ThreadPoolExecutor(1 if enabled else workers, thread_name_prefix="inference")
        self._queue: deque[Job] = deque()
        self._in_flight = 0  # unbatched queries submitted and not yet answered
        self._busy = False  # a batch is in the inference thread, or filling up
        self._arrived = asyncio.Event()  # binds to a loop on first use, not here
        self._task: asyncio.Task | None = None
        self._stopped = False

    # -- lifecycle (on the loop) ------------------------------------------------------------

    def start(self) -> None:
        """Start the batching task on the running loop."""
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._batches(), name="batcher")

    async def stop(self) -> None:
        """Refuse new jobs, fail queued ones with UNAVAILABLE, and stop the inference thread."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(Unavailable("server is shutting down"))
        self._inference.shutdown(wait=False, cancel_futures=True)

    # -- submission (on the loop) -----------------------------------------------------------

    @property
    def decodes_cheaply(self) -> bool:
        """Whether a job's image is best decoded by the inference thread, a decode thread
        only adding a round trip: with batching off (the query runs alone on an inference
        thread either way), or when no batch is queued, filling up or running (it would
        start at once)."""
        return not self.enabled or (not self._queue and not self._busy)

    async def run(self, job: Job) -> list[Hit]:
        """The job's top-k hits, computed in a batch with whatever else is queued."""
        if self._stopped:
            raise Unavailable("server is shutting down")
        loop = asyncio.get_running_loop()
        job.enqueued = time.perf_counter()
        if not self.enabled:
            if self._in_flight >= self.max_queue:
                raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already in flight")
            self._in_flight += 1
            try:
                return await loop.run_in_executor(self._inference, self._compute_one, job)
            finally:
                self._in_flight -= 1
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already queued")
        job.future = loop.create_future()
        self._queue.append(job)
        self.metrics.queue_depth.set(len(self._queue))
        self._arrived.set()
        return await job.future  # cancelled with the RPC; the batcher then skips the job

    # -- batching task ----------------------------------------------------------------------

    def _take_ready(self, batch: list[Job]) -> None:
        """Move queued jobs of the batch's pair into it (up to the size limit), oldest first."""
        now = time.monotonic()
        kept: deque[Job] = deque()
        while self._queue and len(batch) < self.max_batch_size:
            job = self._queue.popleft()
            if job.future.done():  # its caller went away
                continue
            if job.deadline is not None and now > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while the query was queued"))
                continue
            if batch and job.pair is not batch[0].pair:
                kept.append(job)
                continue
            batch.append(job)
        self._queue.extendleft(reversed(kept))

    async def _take_batch(self) -> list[Job]:
        loop = asyncio.get_running_loop()
        batch: list[Job] = []
        until: float | None = None
        while True:
            self._take_ready(batch)
            if len(batch) >= self.max_batch_size:
                break
            if batch:
                until = until if until is not None else loop.time() + self.max_wait_s
                remaining = until - loop.time()
                if remaining <= 0:
                    break
            self._arrived.clear()
            # A batch waiting to fill counts as running: images arriving now decode in the pool
            # while it waits, not one after another in the inference thread once it is full.
            self._busy = bool(batch)
            try:
                if not batch:
                    await self._arrived.wait()
                    continue
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                self._take_ready(batch)
                break
            except asyncio.CancelledError:  # stopping: the jobs go back, to be failed by stop()
                self._queue.extendleft(reversed(batch))
                raise
        self.metrics.queue_depth.set(len(self._queue))
        return batch

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._take_batch()
            self._busy = True
            try:
                results = await loop.run_in_executor(self._inference, self._compute, batch)
            except asyncio.CancelledError:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(Unavailable("server is shutting down"))
                raise
            except Exception as exc:  # a bug must fail the batch's requests, not the task
                log.exception("batch of %d failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            finally:
                self._busy = False
            for job, hits in zip(batch, results, strict=True):
                if job.future.done():
                    continue
                if job.error is not None:
                    job.future.set_exception(job.error)
                else:
                    job.future.set_result(hits)

    # -- inference thread -------------------------------------------------------------------

    def _compute_one(self, job: Job) -> list[Hit]:
        if job.deadline is not None and time.monotonic() > job.deadline:
            raise DeadlineExceeded("deadline passed while the query was queued")
        # Another query in flight means runs side by side: each takes a single-threaded session
        # rather than sharing the multi-threaded one; a query alone gets every core.
        hits = self._compute([job], side_by_side=self._in_flight > 1)[0]
        if job.error is not None:
            raise job.error
        return hits

    def _decode(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            job.array = self.engine.model_input(job.pair, job.image)
        except ServiceError as exc:
            job.error = exc
        job.image = None
        job.decode_s += time.perf_counter() - started

    def _compute(self, batch: list[Job], side_by_side: bool = False) -> list[list[Hit]]:
        """Each job's hits; a job whose image fails to decode here gets none and its `error` set."""
        started = time.perf_counter()
        for job in batch:
            job.queue_s = started - job.enqueued
            if job.image is not None:
                self._decode(job)
        answered = [j for j in batch if j.error is None]
        if not answered:
            return [[] for _ in batch]
        hits = dict(zip(map(id, answered), self._embed_and_search(answered, side_by_side), strict=True))
        return [hits.get(id(j), []) for j in batch]

    def _embed_and_search(self, batch: list[Job], side_by_side: bool = False) -> list[list[Hit]]:
        """Embed the batch's images in one ORT call and search every vector (but those of
        embed-only jobs) in one faiss call."""
        started = time.perf_counter()
        pair = batch[0].pair
        to_embed = [j for j in batch if j.vector is None]
        embedding = {id(j) for j in to_embed}
        if to_embed:
            vectors = self.engine.embed(pair, [j.array for j in to_embed], side_by_side)
            for job, vector in zip(to_embed, vectors, strict=True):
                job.vector = vector
        embedded = time.perf_counter()
        to_search = [j for j in batch if j.k > 0]
        hits: dict[int, list[Hit]] = {}
        if to_search:
            k = max(j.k for j in to_search)
            found = self.engine.search(pair, np.stack([j.vector for j in to_search]), k, [j.exclude for j in to_search])
            hits = {id(job): job_hits[: job.k] for job, job_hits in zip(to_search, found, strict=True)}
        searched = time.perf_counter()
        self.metrics.batch_size.observe(len(batch))
        for job in batch:
            job.embed_s = embedded - started if id(job) in embedding else 0.0
            job.search_s = searched - embedded if id(job) in hits else 0.0
            job.batch_size = len(batch)
        return [hits.get(id(job), []) for job in batch]
