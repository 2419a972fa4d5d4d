"""Dynamic batching: concurrent queries coalesced into one ONNX Runtime batch and one faiss search.

A `Query` (immutable) goes in, its `Result` comes out. `SchedulingPolicy` decides when a batch
starts and how many queries it takes; `BatchedExecutor` (a queue and a batching task) and
`DirectExecutor` (batching off: one query per inference thread) carry it out
(`serving.search.executors`), both through `Inference`, the work of an inference thread
(`serving.search.inference`). `DynamicBatcher`, here, is the one the server holds.

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

A query by embedding that finds the batcher idle (nothing queued, filling or running) has no
batch to join: when its pair's lone searches are measured under `executors.INLINE_SEARCH_S`
(an HNSW or IVF index, not a large Flat scan) it is searched on the loop at once, without the
queue and the two thread hops that cost more than such a search. Under load the queue is not
empty, and queries by embedding go to faiss together, one search a batch, as images do.

With batching off, a query that finds others in flight likewise runs on the session with a
share of the threads (one each, by default) and a query alone on the full one: side by side,
runs sharing one intra-op pool would fight over it.
"""

from __future__ import annotations

from serving.errors import Unavailable
from serving.search.engine import SearchEngine
from serving.search.executors import BatchedExecutor, DecodePlacement, DirectExecutor, SchedulingPolicy
from serving.search.inference import Inference, Query, Result, Work
from serving.telemetry.metrics import ServiceMetrics


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
        work = Work(query, Result(decode_s=query.decode_s))
        await self.executor.run(work)
        return work.result

    async def stop(self) -> None:
        """Refuse new queries, fail queued and running ones with UNAVAILABLE, and stop the inference threads."""
        self._stopped = True
        await self.executor.stop()
