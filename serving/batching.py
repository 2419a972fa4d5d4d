"""Dynamic batching: concurrent queries coalesced into one ONNX Runtime batch and one faiss search.

The batcher lives on the server's asyncio loop. RPC handlers decode their images (small ones on
the loop, larger ones in the decode pool) and `await batcher.run(job)`; one task takes the
oldest job, waits at most `max_wait_s` for more (up to `max_batch_size`), and hands the whole
batch to an inference thread that embeds every image in one ORT call (or in runs of the rows
per run measured fastest for the model, see `OnnxEmbedder.tune_run_rows`) and searches every
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

A job may arrive with its image opened but not decoded (`image`): the inference thread decodes
it before embedding. The servicer hands over images this way when the hop to a decode thread
would cost about what decoding does (small images), or only add latency (with batching off, and
with batching on when the batcher is idle); a job whose pixels turn out corrupt fails alone,
not its batch.

An Embed call is a job with k = 0: embedded in the batch it lands in, searched for nothing.

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
        streams: int = 1,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_s < 0 or workers < 1 or streams < 1:
            raise ValueError("max_batch_size, max_queue, workers and streams must be ≥ 1, max_wait_s ≥ 0")
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.enabled = enabled
        # Batched: `streams` batches run at once, each on its own inference thread.
        # Unbatched: each query runs alone, `workers` of them at once.
        self.streams = streams if enabled else 1
        self._share = -(-max_batch_size // self.streams)  # the batch a stream takes beside others
        self._beside = -(-self._share // 2)  # queued jobs that start a batch beside a running one
        self._inference = ThreadPoolExecutor(self.streams if enabled else workers, thread_name_prefix="inference")
        self._queue: deque[Job] = deque()
        self._in_flight = 0  # unbatched queries submitted and not yet answered
        self._running = 0  # batches handed to the inference threads and not yet answered
        self._filling = False  # a batch waits for more jobs before it starts
        self._arrived = asyncio.Event()  # binds to a loop on first use, not here
        self._stream_freed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()
        self._stopped = False
        self._paused = False  # see pause()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the batching task runs on

    # -- lifecycle (on the loop) ------------------------------------------------------------

    def start(self) -> None:
        """Start the batching task on the running loop."""
        if self.enabled and self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._batches(), name="batcher")

    def pause(self) -> None:
        """Start no new batch until `resume`: jobs queue up meanwhile (and the queue can fill),
        while a batch already taken finishes. A hook for tests and drills that need a full
        queue or queued work at a moment they choose, not at whatever moment load happens to
        produce one; safe from any thread. Without batching there is no queue: no effect."""
        self._paused = True

    def resume(self) -> None:
        """Undo `pause`: the queued jobs are taken as if they had just arrived, in batches up
        to the size limit. Safe from any thread."""
        self._paused = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._arrived.set)  # wake the batching task

    @property
    def queued(self) -> int:
        """Jobs waiting for a batch (not those taken into one)."""
        return len(self._queue)

    async def stop(self) -> None:
        """Refuse new jobs, fail queued and running ones with UNAVAILABLE, and stop the inference threads."""
        self._stopped = True
        tasks = [t for t in (self._task, *self._batch_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
        thread either way), or when nothing is queued, filling up or running (its batch would
        start at once)."""
        return not self.enabled or (not self._queue and not self._filling and self._running == 0)

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

    def _may_start(self) -> bool:
        """Whether a free stream starts a batch now: when no other batch is running, or when half
        a share is queued. A few jobs beside a running batch wait for it instead (many small
        batches cost the loop more than they gain); more would leave a core idle meanwhile."""
        return self._running == 0 or len(self._queue) >= self._beside

    def _take_ready(self, batch: list[Job]) -> bool:
        """Move queued jobs of the batch's pair into it (up to its limit), oldest first; whether
        the batch is full (at the size limit, or at its share with jobs left for another)."""
        now = time.monotonic()
        kept: deque[Job] = deque()
        # With other streams free, a queue holding several full shares is split evenly among
        # as many of them, so batches run side by side instead of one after another.
        free = self.streams - self._running  # this batch's stream among them
        total = len(batch) + len(self._queue)
        limit = min(self.max_batch_size, -(-total // max(1, min(free, total // self._share))))
        while self._queue and len(batch) < limit:
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
        return len(batch) >= self.max_batch_size or (len(batch) >= limit and bool(self._queue))

    async def _take_batch(self) -> list[Job]:
        loop = asyncio.get_running_loop()
        batch: list[Job] = []
        until: float | None = None
        while True:
            # Paused, no new batch starts; one already filling goes on filling.
            if (batch or (not self._paused and self._may_start())) and self._take_ready(batch):
                break
            if batch:
                until = until if until is not None else loop.time() + self.max_wait_s
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
            except asyncio.CancelledError:  # stopping: the jobs go back, to be failed by stop()
                self._queue.extendleft(reversed(batch))
                raise
            finally:
                self._filling = False
        self.metrics.queue_depth.set(len(self._queue))
        return batch

    async def _batches(self) -> None:
        while True:
            while self._running >= self.streams:
                self._stream_freed.clear()
                await self._stream_freed.wait()
            self._start_batch(await self._take_batch())

    def _start_batch(self, batch: list[Job]) -> None:
        # Not inline in `_batches`: its locals would keep the last batch, and through it a
        # pair swapped out since, alive until the next batch forms.
        self._running += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, batch: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._inference, self._compute_batch, batch)
        except asyncio.CancelledError:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(Unavailable("server is shutting down"))
            raise
        except Exception as exc:  # a bug must fail the batch's requests, not the batcher
            log.exception("batch of %d failed", len(batch))
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self._running -= 1
            self._stream_freed.set()
            self._arrived.set()  # jobs left waiting beside this batch may start now
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
        # Another query in flight means runs side by side: each takes the session with a share
        # of the threads rather than sharing the full one's pool; a query alone gets them all.
        hits = self._compute([job], side_by_side=self._in_flight > 1)[0]
        if job.error is not None:
            raise job.error
        return hits

    def _compute_batch(self, batch: list[Job]) -> list[list[Hit]]:
        # A batch beside another runs on the session with a share of the threads (where the
        # model has one); a batch alone gets them all.
        return self._compute(batch, side_by_side=self._running > 1)

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
