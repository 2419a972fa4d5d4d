"""Dynamic batching: concurrent queries coalesced into one ONNX Runtime batch and one faiss search.

RPC threads decode their images (in the gRPC thread pool, off the batching thread) and submit
jobs; one batching thread takes the oldest job, waits at most `max_wait_s` for more (up to
`max_batch_size`), embeds every image of the batch in one ORT call and searches every vector in
one faiss call. The queue is bounded: when full, `submit` fails at once with RESOURCE_EXHAUSTED
instead of queueing forever. A batch never mixes model/index pairs, so each answer comes from
exactly the pair its request started on. Jobs whose deadline passed while queued are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from serving.engine import SearchEngine, ServingPair
from serving.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One query: an image to embed (`array`) or a ready vector, searched for k neighbours."""

    pair: ServingPair
    k: int
    exclude: set[int]
    array: np.ndarray | None = None
    vector: np.ndarray | None = None
    deadline: float | None = None  # time.monotonic() value
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    decode_s: float = 0.0
    queue_s: float = 0.0
    embed_s: float = 0.0
    search_s: float = 0.0
    batch_size: int = 1
    embedding: np.ndarray | None = None


class DynamicBatcher:
    def __init__(
        self,
        engine: SearchEngine,
        metrics: ServiceMetrics,
        max_batch_size: int = 32,
        max_wait_s: float = 0.002,
        max_queue: int = 1024,
        enabled: bool = True,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_s < 0:
            raise ValueError("max_batch_size and max_queue must be ≥ 1, max_wait_s ≥ 0")
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.enabled = enabled
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if enabled:
            self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
            self._thread.start()

    # -- submission -------------------------------------------------------------------------

    def submit(self, job: Job) -> Future:
        if not self.enabled:  # batching off: run the job alone, in the caller's thread
            self._run([job])
            return job.future
        with self._cond:
            if self._stopped:
                raise Unavailable("server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already queued")
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()
        return job.future

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- batching thread --------------------------------------------------------------------

    def _take_batch(self) -> list[Job]:
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if not self._queue:
                return []
            first = self._queue.popleft()
            batch = [first]
            until = time.perf_counter() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                same_pair = next((j for j in self._queue if j.pair is first.pair), None)
                if same_pair is not None:
                    self._queue.remove(same_pair)
                    batch.append(same_pair)
                    continue
                remaining = until - time.perf_counter()
                if remaining <= 0 or self._stopped:
                    break
                self._cond.wait(remaining)
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            try:
                self._run(batch)
            except Exception as exc:  # a bug must fail the batch's requests, not the thread
                log.exception("batch of %d failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _run(self, batch: list[Job]) -> None:
        now_mono, now = time.monotonic(), time.perf_counter()
        live = []
        for job in batch:
            job.queue_s = now - job.enqueued
            if job.future.cancelled():
                continue
            if job.deadline is not None and now_mono > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while the query was queued"))
                continue
            live.append(job)
        if not live:
            return
        pair = live[0].pair
        to_embed = [j for j in live if j.vector is None]
        started = time.perf_counter()
        if to_embed:
            vectors = self.engine.embed(pair, [j.array for j in to_embed])
            for job, vector in zip(to_embed, vectors, strict=True):
                job.vector = vector
                job.embedding = vector
        embed_s = time.perf_counter() - started
        embedded = {id(j) for j in to_embed}
        started = time.perf_counter()
        k = max(j.k for j in live)
        hits = self.engine.search(pair, np.stack([j.vector for j in live]), k, [j.exclude for j in live])
        search_s = time.perf_counter() - started
        self.metrics.batch_size.observe(len(live))
        for job, job_hits in zip(live, hits, strict=True):
            job.embed_s = embed_s if id(job) in embedded else 0.0
            job.search_s = search_s
            job.batch_size = len(live)
            if not job.future.cancelled():
                job.future.set_result(job_hits[: job.k])
