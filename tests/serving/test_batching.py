"""DynamicBatcher on its own asyncio loop, over the real model and index of the demo chain."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time

import numpy as np
import pytest
from PIL import Image

from core.data.catalog import read_catalog
from core.data.preprocess import load_image
from serving.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from serving.search.answers import NOTHING_EXCLUDED
from serving.search.batching import DynamicBatcher
from serving.search.checks import RequestChecks
from serving.search.engine import Limits, SearchEngine, load_pair
from serving.search.executors import DecodePlacement
from serving.search.inference import Query, Result
from serving.telemetry.metrics import ServiceMetrics
from tests.support.images import encode

CHECKS = RequestChecks(Limits())  # what the service checks before a query reaches the batcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_and_pairs(demo_run):
    """An engine and two distinct loaded pairs (same version, different objects)."""
    engine = SearchEngine()
    first, second = load_pair(demo_run / "index"), load_pair(demo_run / "index")
    engine.swap(first)
    return engine, first, second


@pytest.fixture(scope="module")
def arrays(demo_run, engine_and_pairs):
    engine, pair, _ = engine_and_pairs
    catalog = read_catalog(demo_run / "train" / "splits" / "test.csv")
    return [engine.model_input(pair, CHECKS.open_image(p.read_bytes())) for p in catalog.paths[:12]]


def batcher(engine: SearchEngine, **kwargs) -> DynamicBatcher:
    defaults = dict(max_batch_size=32, max_wait_s=0.0, max_queue=64)
    return DynamicBatcher(engine, ServiceMetrics(), **{**defaults, **kwargs})


def answer_all(engine: SearchEngine, jobs: list[Query], **kwargs) -> list[Result | BaseException]:
    """Run the queries at once through a started batcher; their results (exceptions returned)."""

    async def main():
        b = batcher(engine, **kwargs)
        b.start()
        try:
            return await asyncio.gather(*(b.run(j) for j in jobs), return_exceptions=True)
        finally:
            await b.stop()

    return asyncio.run(main())


async def until(predicate, timeout: float = 60.0) -> None:
    """Let the loop run until `predicate()` holds: a wait for a condition, the timeout only a
    bound on a hang (whatever runs in the inference threads takes as long as the machine needs)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def in_batcher(b: DynamicBatcher) -> bool:
    """Whether an image too large for the loop would be decoded by the inference thread now."""
    return b.decode_placement is DecodePlacement.IN_BATCHER


def job(pair, array, k: int = 5, deadline: float | None = None) -> Query:
    return Query(pair=pair, k=k, array=array, deadline=deadline)


def exact(engine: SearchEngine, pair, array, k: int = 5) -> list[int]:
    vector = engine.embed(pair, [array])
    return [h.row for h in engine.search(pair, vector, k, [NOTHING_EXCLUDED])[0].hits]


def test_engine_decodes_large_jpegs_at_reduced_scale_where_the_contract_allows(engine_and_pairs):
    engine, pair, _ = engine_and_pairs
    contract = dataclasses.replace(pair.embedder.contract, resize=32, reducing_gap=2.0)
    embedder = copy.copy(pair.embedder)
    embedder.contract = contract
    reducing = dataclasses.replace(pair, embedder=embedder)
    photo = encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (600, 800), dtype=np.uint8)), "JPEG")
    image = CHECKS.open_image(photo)
    array = engine.model_input(reducing, image)
    assert image.size == (100, 75)  # shorter side 32, gap 2: the decoder went down to 1/8
    np.testing.assert_array_equal(array, load_image(photo, contract))  # as the index saw it


def test_batched_answers_equal_one_at_a_time_and_pairs_never_mix(engine_and_pairs, arrays):
    engine, first, second = engine_and_pairs
    pairs = [first if i % 3 else second for i in range(len(arrays))]  # interleaved
    jobs = [job(p, a) for p, a in zip(pairs, arrays, strict=True)]

    answers = answer_all(engine, jobs)
    for j, r in zip(jobs, answers, strict=True):
        assert [h.row for h in r.hits] == exact(engine, j.pair, j.array)
    # All were queued before the first batch was taken: one batch per pair, never mixed.
    sizes = [(j.pair, r.batch_size) for j, r in zip(jobs, answers, strict=True)]
    assert {n for p, n in sizes if p is first} == {sum(p is first for p in pairs)}
    assert {n for p, n in sizes if p is second} == {sum(p is second for p in pairs)}


@pytest.mark.parametrize("enabled", [True, False])
def test_embed_only_jobs_share_the_batch_and_are_not_searched(engine_and_pairs, arrays, enabled):
    engine, pair, _ = engine_and_pairs
    jobs = [job(pair, a, k=0 if i % 2 else 5) for i, a in enumerate(arrays[:8])]

    answers = answer_all(engine, jobs, enabled=enabled, workers=2)
    for j, r in zip(jobs, answers, strict=True):
        np.testing.assert_allclose(r.vector, engine.embed(pair, [j.array])[0], atol=1e-5)
        assert r.embed_s > 0
        if j.k:
            assert [h.row for h in r.hits] == exact(engine, pair, j.array) and r.search_s > 0
        else:
            assert r.hits == [] and r.search_s == 0.0
    assert {r.batch_size for r in answers} == ({8} if enabled else {1})  # embeds ride in the queries' batch


def test_wait_window_coalesces_staggered_queries_and_zero_wait_does_not(engine_and_pairs, arrays):
    engine, pair, _ = engine_and_pairs

    async def staggered(max_wait_s: float, max_batch_size: int = 4, n: int = 4) -> list[Result]:
        b = batcher(engine, max_wait_s=max_wait_s, max_batch_size=max_batch_size)
        b.start()
        jobs = [job(pair, a) for a in arrays[:n]]
        tasks = []
        try:
            for j in jobs:
                tasks.append(asyncio.ensure_future(b.run(j)))
                await asyncio.sleep(0.01)
            async with asyncio.timeout(120):  # a window that never closed would hang here
                return await asyncio.gather(*tasks)
        finally:
            await b.stop()

    # A window far longer than the arrivals take, however slow the machine: the batch leaves
    # when full, the four in it.
    assert {j.batch_size for j in asyncio.run(staggered(60.0))} == {4}
    # Without a window the first query (the batcher idle) starts a batch of its own at once.
    assert max(j.batch_size for j in asyncio.run(staggered(0.0))) < 4
    # A window that closes sends the batch it has, not full.
    assert {j.batch_size for j in asyncio.run(staggered(0.05, max_batch_size=32, n=1))} == {1}


def test_full_queue_is_refused_at_once_and_stop_fails_what_is_queued(engine_and_pairs, arrays):
    engine, pair, _ = engine_and_pairs

    async def main():
        b = batcher(engine, max_queue=2)  # not started: nothing drains the queue
        waiting = [asyncio.ensure_future(b.run(job(pair, a))) for a in arrays[:2]]
        await until(lambda: b.queued == 2)
        # At once: the call raises on its first step, never waiting for room.
        with pytest.raises(ResourceExhausted, match="2 queries already queued"):
            b.run(job(pair, arrays[2])).send(None)
        await b.stop()
        for task in waiting:
            with pytest.raises(Unavailable):
                await task
        with pytest.raises(Unavailable):
            await b.run(job(pair, arrays[3]))

    asyncio.run(main())


def test_cancelled_and_expired_jobs_cost_no_work(engine_and_pairs, arrays):
    engine, pair, _ = engine_and_pairs

    async def main():
        b = batcher(engine)
        gone = asyncio.ensure_future(b.run(job(pair, arrays[0])))
        expired = asyncio.ensure_future(b.run(job(pair, arrays[1], deadline=time.monotonic() - 1)))
        live = job(pair, arrays[2])
        answer = asyncio.ensure_future(b.run(live))
        await until(lambda: b.queued == 3)
        gone.cancel()  # the caller went away while its query was queued
        b.start()
        try:
            with pytest.raises(DeadlineExceeded, match="queued"):
                await expired
            result = await answer
            assert [h.row for h in result.hits] == exact(engine, pair, arrays[2])
        finally:
            await b.stop()
        return result, b

    live, b = asyncio.run(main())
    assert live.batch_size == 1  # neither the cancelled nor the expired query was embedded
    samples = {s.name: s.value for s in b.metrics.batch_size.collect()[0].samples}
    assert samples["simsearch_batch_size_sum"] == 1


def test_unbatched_mode_answers_each_query_alone(engine_and_pairs, arrays):
    engine, pair, _ = engine_and_pairs
    jobs = [job(pair, a) for a in arrays[:6]]

    answers = answer_all(engine, jobs, enabled=False, workers=3)
    assert all(r.batch_size == 1 for r in answers)
    for j, r in zip(jobs, answers, strict=True):
        assert [h.row for h in r.hits] == exact(engine, pair, j.array)


@pytest.mark.parametrize("enabled", [True, False])
def test_images_left_to_the_inference_thread_are_decoded_there_and_a_corrupt_one_fails_alone(
    demo_run, engine_and_pairs, enabled
):
    engine, pair, _ = engine_and_pairs
    blobs = [p.read_bytes() for p in read_catalog(demo_run / "train" / "splits" / "test.csv").paths[:3]]
    good = [Query(pair=pair, k=5, image=CHECKS.open_image(b)) for b in blobs[:2]]
    truncated = blobs[2][: len(blobs[2]) // 2]  # the header reads fine, the pixels do not
    broken = Query(pair=pair, k=5, image=CHECKS.open_image(truncated))

    first, failed, second = answer_all(engine, [good[0], broken, good[1]], enabled=enabled, workers=2)
    assert isinstance(failed, InvalidArgument), failed
    assert "cannot decode image" in str(failed)
    for blob, r in zip(blobs[:2], (first, second), strict=True):
        assert [h.row for h in r.hits] == exact(engine, pair, engine.model_input(pair, CHECKS.open_image(blob)))
        assert r.decode_s > 0  # decoded by the inference thread: the query carried no pixels
        assert r.batch_size == (2 if enabled else 1)  # the broken one took no place in the batch


def test_images_go_to_the_inference_thread_only_when_it_would_take_them_at_once(engine_and_pairs, arrays):
    engine, pair, _ = engine_and_pairs

    async def main():
        # A batch of two waits up to a minute for its second query: it fills until the test sends it.
        b = batcher(engine, max_wait_s=60.0, max_batch_size=2)
        b.start()
        try:
            idle = in_batcher(b)
            first = asyncio.ensure_future(b.run(job(pair, arrays[0])))
            await until(lambda: not in_batcher(b) and b.queued == 0)  # taken into a batch, which waits
            filling = in_batcher(b)  # the batch waits for more: images should decode meanwhile
            b.pause()
            second = asyncio.ensure_future(b.run(job(pair, arrays[1])))
            third = asyncio.ensure_future(b.run(job(pair, arrays[2])))
            await asyncio.gather(first, second)  # the filling batch takes one, and runs; the third waits
            queued = in_batcher(b)  # a query queued: the next batch will not start at once
            b.resume()
            await until(lambda: b.queued == 0)
            await asyncio.gather(third, b.run(job(pair, arrays[3])))
            return idle, filling, queued, in_batcher(b)
        finally:
            await b.stop()

    assert asyncio.run(main()) == (True, False, False, True)
    assert in_batcher(batcher(engine, enabled=False))  # unbatched: a free thread takes it


class RecordingSession:
    """An ORT session that notes in `log` under `name` each run it makes, then makes it."""

    def __init__(self, session, name: str, log: list[str]) -> None:
        self.session, self.name, self.log = session, name, log

    def run(self, *args, **kwargs):
        self.log.append(self.name)
        return self.session.run(*args, **kwargs)


def test_unbatched_queries_run_side_by_side_single_threaded_and_alone_on_every_thread(demo_run, arrays):
    engine = SearchEngine()
    pair = load_pair(demo_run / "index", provider="cpu", intra_op_threads=2, runs_at_once=2)
    engine.swap(pair)
    embedder = pair.embedder
    assert embedder.session.get_session_options().intra_op_num_threads == 2
    assert embedder.side_by_side_session.get_session_options().intra_op_num_threads == 1
    used: list[str] = []
    embedder.session = RecordingSession(embedder.session, "all threads", used)
    embedder.side_by_side_session = RecordingSession(embedder.side_by_side_session, "single-threaded", used)
    jobs = [job(pair, a) for a in arrays[:8]]

    async def main():
        b = batcher(engine, enabled=False, workers=2)
        try:
            alone = [await b.run(j) for j in jobs[:2]]  # one at a time: each query runs alone
            return alone + list(await asyncio.gather(*(b.run(j) for j in jobs[2:])))
        finally:
            await b.stop()

    answers = asyncio.run(main())
    assert used[:2] == ["all threads", "all threads"]
    # Six at once on two threads: all but the first to start (and the last, should it find the
    # others answered) run beside another query.
    assert used[2:].count("single-threaded") >= 4, used
    for j, r in zip(jobs, answers, strict=True):
        assert [h.row for h in r.hits] == exact(engine, pair, j.array)


class MeetingSession(RecordingSession):
    """A recording session whose runs wait for one another at `barrier`: a run made while no
    other is under way breaks it (after `timeout`, a bound on a hang: two runs started together
    meet at once), so the log proves runs overlapped."""

    def __init__(self, session, name: str, log: list[str], barrier: threading.Barrier) -> None:
        super().__init__(session, name, log)
        self.barrier = barrier

    def run(self, *args, **kwargs):
        self.barrier.wait()
        return super().run(*args, **kwargs)


def test_batch_streams_share_out_the_queue_and_run_side_by_side_single_threaded(demo_run, arrays):
    engine = SearchEngine()
    pair = load_pair(demo_run / "index", provider="cpu", intra_op_threads=2, runs_at_once=2)
    engine.swap(pair)
    embedder = pair.embedder
    used: list[str] = []
    meet = threading.Barrier(2, timeout=60)
    embedder.session = RecordingSession(embedder.session, "all threads", used)
    embedder.side_by_side_session = MeetingSession(embedder.side_by_side_session, "single-threaded", used, meet)
    jobs = [job(pair, a) for a in arrays[:12]]

    answers = answer_all(engine, jobs, streams=2, max_batch_size=12)
    # Queued at once, the twelve are two full shares: split between the two streams, whose
    # batches meet inside the single-threaded session, so they ran at the same time.
    assert used == ["single-threaded", "single-threaded"]
    assert {r.batch_size for r in answers} == {6}
    for j, r in zip(jobs, answers, strict=True):
        assert [h.row for h in r.hits] == exact(engine, pair, j.array)

    # A batch alone gets every thread; so does a lone query with a stream to spare.
    del used[:]
    lone = job(pair, arrays[0])
    answer = answer_all(engine, [lone], streams=2)[0]
    assert used == ["all threads"]
    assert [h.row for h in answer.hits] == exact(engine, pair, lone.array)


@pytest.mark.parametrize(
    ("streams", "max_batch_size", "sizes"), [(1, 8, {8, 4}), (2, 8, {6}), (3, 8, {4}), (2, 16, {12})]
)
def test_the_queue_is_shared_out_in_full_shares(engine_and_pairs, arrays, streams, max_batch_size, sizes):
    engine, pair, _ = engine_and_pairs
    jobs = [job(pair, a) for a in arrays[:12]]
    # A share is the batch size over the streams: 12 queued make 3 shares of 4 with 2 streams
    # (split in 2), 4 of 3 with 3 streams (split in 3), but less than 2 of 8 (not split).
    answers = answer_all(engine, jobs, streams=streams, max_batch_size=max_batch_size)
    assert {r.batch_size for r in answers} == sizes


class GatedSession(RecordingSession):
    """A recording session whose first run waits until `gate` is set; `entered` is set once it
    waits there."""

    def __init__(self, session, name: str, log: list[str], gate: threading.Event) -> None:
        super().__init__(session, name, log)
        self.gate = gate
        self.entered = threading.Event()

    def run(self, *args, **kwargs):
        if not self.log:
            self.entered.set()
            assert self.gate.wait(120), "the test never opened the gate"
        return super().run(*args, **kwargs)


@pytest.mark.parametrize(
    ("beside", "before_the_first_ends", "runs"),
    [
        (3, [], ["all threads", "all threads"]),  # they wait for the held batch, then run alone
        (5, ["single-threaded"], ["single-threaded", "all threads"]),  # they run beside it
    ],
)
def test_jobs_beside_a_running_batch_start_one_once_half_a_share_is_queued(
    demo_run, arrays, beside, before_the_first_ends, runs
):
    engine = SearchEngine()
    pair = load_pair(demo_run / "index", provider="cpu", intra_op_threads=2, runs_at_once=2)
    engine.swap(pair)
    used: list[str] = []
    gate = threading.Event()
    held = pair.embedder.session = GatedSession(pair.embedder.session, "all threads", used, gate)
    pair.embedder.side_by_side_session = RecordingSession(pair.embedder.side_by_side_session, "single-threaded", used)
    first, *later = [job(pair, a) for a in arrays[: 1 + beside]]

    async def main():
        b = batcher(engine, streams=2, max_batch_size=16)  # a share is 8 queries: 4 start a batch beside
        b.start()
        try:
            running = asyncio.ensure_future(b.run(first))
            await until(held.entered.is_set)  # the first batch is in its inference thread, held at the gate
            waiting = [asyncio.ensure_future(b.run(j)) for j in later]
            # Those that start a batch beside the held one run it to the end meanwhile; those
            # that do not stay queued (the batcher decides on the loop, before `until` looks).
            left = 0 if before_the_first_ends else beside
            await until(lambda: b.queued == left and len(used) == len(before_the_first_ends))
            started = list(used)
            gate.set()
            return started, await asyncio.gather(running, *waiting)
        finally:
            gate.set()
            await b.stop()

    started, (first_result, *later_results) = asyncio.run(main())
    assert started == before_the_first_ends
    assert used == runs
    assert first_result.batch_size == 1 and {r.batch_size for r in later_results} == {beside}


def test_a_batcher_needs_at_least_one_stream(engine_and_pairs):
    with pytest.raises(ValueError, match="streams must be ≥ 1"):
        batcher(engine_and_pairs[0], streams=0)
