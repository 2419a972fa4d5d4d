"""How the batcher carries out its queries (`serving.search.batching`): `SchedulingPolicy` decides
when a batch starts and how many queries it takes; `BatchedExecutor` (a queue and a batching task)
and `DirectExecutor` (batching off: one query per inference thread) carry it out, both through
`Inference`, the work of an inference thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

from serving.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from serving.search.answers import EVERY_ROW
from serving.search.inference import Inference, Work
from serving.search.threads import SearchThreads

log = logging.getLogger(__name__)

# A lone query by embedding whose searches take less than this is searched on the loop: the hop
# to an inference thread and back (a queue put, a thread wake-up, a future resolved across
# threads, the batching task's turn) costs ~0.3-0.6 ms of a 2-core machine's time, about what
# an HNSW or IVF search of one vector and its hits' gather take (0.1-0.4 ms at 100k rows); a
# longer search (a Flat scan of 100k rows, 2-3 ms) would hold every other call up meanwhile,
# where on a thread the loop goes on reading and answering calls beside it.
INLINE_SEARCH_S = 0.001
# Weight of a slower lone search in the running estimate of a pair's search time (`_measured`).
_ESTIMATE_WEIGHT = 0.1


class DecodePlacement(StrEnum):
    """Where a query's image is decoded."""

    ON_LOOP = "loop"  # on the event loop, before the query is submitted
    IN_BATCHER = "inference"  # by the inference thread that embeds it
    IN_POOL = "pool"  # in a decode thread, while the query waits for its batch
    AT_EMBEDDER = "embedder"  # where it is embedded: its bytes cross to the embedder deployment


# How long a probe query waits behind users' queries at most (`BatchedExecutor._lane`).
PROBE_MAX_WAIT_S = 2.0


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


class DirectExecutor:
    """Batching off: each query runs alone on an inference thread, `workers` of them at once."""

    def __init__(self, inference: Inference, workers: int, max_queue: int) -> None:
        self.inference = inference
        self.max_queue = max_queue
        self._threads = ThreadPoolExecutor(workers, "inference", SearchThreads.apply)
        self._in_flight = 0  # queries submitted and not yet answered

    async def run(self, work: Work) -> None:
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

    def _compute(self, work: Work) -> None:
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
        self._threads = ThreadPoolExecutor(policy.streams, "inference", SearchThreads.apply)
        self._queue: deque[Work] = deque()
        # The probe's lane: its queries are batched while no user query waits, one batch at a
        # time — or, under a load that never empties the users' queue, once the lane's oldest has
        # waited PROBE_MAX_WAIT_S: a user's query waits at most a probe batch that long, and
        # the round still ends (it starved behind 32 closed-loop callers, its figure stale).
        self._background: deque[Work] = deque()
        self._background_running = False
        self._running = 0  # batches handed to the inference threads and not yet answered
        self._filling = False  # a batch waits for more queries before it starts
        self._arrived = asyncio.Event()  # binds to a loop on first use, not here
        self._stream_freed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the batching task runs on
        # A lone plain search by embedding's time on the live pair, (its serial, seconds): what
        # decides whether the next one is searched on the loop (`_inline`). Per pair, since
        # another index (Flat for HNSW) searches at another speed; None until one is measured.
        self._lone_search: tuple[int, float] | None = None

    @property
    def queued(self) -> int:
        return len(self._queue) + len(self._background)

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
        while self._queue or self._background:
            work = (self._queue or self._background).popleft()
            if not work.future.done():
                work.future.set_exception(Unavailable("server is shutting down"))
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _inline(self, work: Work) -> bool:
        """Whether a query is searched on the loop, skipping the queue and the thread hop: a
        plain search by a ready vector (no image or text to embed, no filter, grouping or
        min_score, nothing excluded), a user's, while the batcher is idle (nothing queued,
        filling or running: there is no batch to join) and not paused, on a pair whose lone
        searches are measured below INLINE_SEARCH_S. Under load the queue is not empty, so
        queries by embedding still go to faiss together, one search a batch."""
        query = work.query
        if query.vector is None or query.text_ids is not None or query.background or not query.k:
            return False
        if self._running or self._queue or self._filling or self._paused or not self.inference.engine.searches_inline:
            return False
        if query.scope is not EVERY_ROW or query.exclude.ids or query.exclude.rows or query.exclude.groups:
            return False
        estimate = self._lone_search
        return estimate is not None and estimate[0] == query.pair.serial and estimate[1] < INLINE_SEARCH_S

    def _measured(self, batch: list[Work]) -> None:
        """Fold a lone plain search's time into its pair's estimate (`_inline`)."""
        if len(batch) != 1 or batch[0].error is not None:
            return
        work = batch[0]
        query = work.query
        if query.vector is None or query.text_ids is not None or not query.k or query.scope is not EVERY_ROW:
            return
        seconds, known = work.result.search_s, self._lone_search
        if known is not None and known[0] == query.pair.serial and seconds > known[1]:
            # Down at once, up slowly: what decides is the search's own cost, and a slower sample
            # is as often a thread preempted on a busy machine (or a cold first search) as a
            # dearer index; a Flat scan of many rows never gives a fast one.
            seconds = known[1] + _ESTIMATE_WEIGHT * (seconds - known[1])
        self._lone_search = (query.pair.serial, seconds)

    async def run(self, work: Work) -> None:
        if self._inline(work):
            if work.expired(time.monotonic()):
                raise DeadlineExceeded("deadline passed while the query was queued")
            self.inference([work], False)
            self._measured([work])
            if work.error is not None:
                raise work.error
            return
        lane = self._background if work.query.background else self._queue
        if len(lane) >= self.max_queue:
            raise ResourceExhausted(f"server overloaded: {self.max_queue} queries already queued")
        work.future = asyncio.get_running_loop().create_future()
        lane.append(work)
        self.inference.metrics.queue_depth.set(self.queued)
        self._arrived.set()
        await work.future  # cancelled with the RPC; the batcher then skips the query

    # -- batching task ----------------------------------------------------------------------

    def _lane(self, batch: list[Work]) -> deque[Work]:
        """Where the batch takes its queries from: the users' queue, or — while it is empty (or
        the probe's oldest has waited PROBE_MAX_WAIT_S), no background batch runs and the batch
        has no user query — the probe's lane."""
        if batch:
            return self._background if batch[0].query.background else self._queue
        if self._background and not self._background_running:
            if not self._queue or time.perf_counter() - self._background[0].enqueued > PROBE_MAX_WAIT_S:
                return self._background
        return self._queue

    def _take_ready(self, batch: list[Work]) -> bool:
        """Move queued queries of the batch's pair and lane into it (up to its limit), oldest
        first; whether the batch is full."""
        now = time.monotonic()
        kept: deque[Work] = deque()
        queue = self._lane(batch)
        limit = self.policy.limit(self._running, len(batch) + len(queue))
        while queue and len(batch) < limit:
            work = queue.popleft()
            if work.future.done():  # its caller went away
                continue
            if work.expired(now):
                work.future.set_exception(DeadlineExceeded("deadline passed while the query was queued"))
                continue
            if batch and work.query.pair is not batch[0].query.pair:
                kept.append(work)
                continue
            batch.append(work)
        queue.extendleft(reversed(kept))
        return self.policy.is_full(len(batch), limit, len(queue))

    async def _take_batch(self) -> list[Work]:
        loop = asyncio.get_running_loop()
        batch: list[Work] = []
        until: float | None = None
        while True:
            # Paused, no new batch starts; one already filling goes on filling.
            may_start = not self._paused and self.policy.may_start(self._running, len(self._lane(batch)))
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
                self._lane(batch).extendleft(reversed(batch))
                raise
            finally:
                self._filling = False
        self.inference.metrics.queue_depth.set(self.queued)
        return batch

    async def _batches(self) -> None:
        while True:
            while self._running >= self.policy.streams:
                self._stream_freed.clear()
                await self._stream_freed.wait()
            self._start_batch(await self._take_batch())

    def _start_batch(self, batch: list[Work]) -> None:
        # Not inline in `_batches`: its locals would keep the last batch, and through it a
        # pair swapped out since, alive until the next batch forms.
        self._running += 1
        self._background_running = self._background_running or bool(batch and batch[0].query.background)
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, batch: list[Work]) -> None:
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
            if batch and batch[0].query.background:
                self._background_running = False
            self._stream_freed.set()
            self._arrived.set()  # queries left waiting beside this batch may start now
        self._measured(batch)
        for work in batch:
            if work.future.done():
                continue
            if work.error is not None:
                work.future.set_exception(work.error)
            else:
                work.future.set_result(None)
