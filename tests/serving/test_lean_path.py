"""The lean path for vectors (issue 62): a lone plain query by embedding is searched on the loop
once its pair's lone searches are measured fast, with the answer the inference thread gives;
anything else — paused, busy, filtered, excluding, a slow index — still goes through the queue."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from benchmarks.bench_shards import clustered_part, publish_vectors
from serving.search import executors
from serving.search.answers import Exclusion, Scope
from serving.search.batching import DynamicBatcher
from serving.search.engine import SearchEngine, load_pair
from serving.search.inference import Query
from serving.telemetry.metrics import ServiceMetrics
from tests.support.index import write_tiny_model


class Recording:
    """The batcher's `Inference`, noting the thread each batch is searched on."""

    def __init__(self, inner) -> None:
        self.inner, self.engine, self.metrics = inner, inner.engine, inner.metrics
        self.where: list[str] = []

    def __call__(self, batch, side_by_side: bool = False) -> None:
        self.where.append(threading.current_thread().name)
        self.inner(batch, side_by_side)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lean")
    model = write_tiny_model(folder / "model", dim=16)
    root = folder / "root"
    publish_vectors(root, clustered_part(0, 600, 16), 1, factory="HNSW32", params={"efSearch": 64}, model=model)
    engine = SearchEngine()
    engine.swap(load_pair(root))
    return engine


def answered_where(engine: SearchEngine, queries: list[Query], pause_first: bool = False) -> list[tuple[str, list]]:
    """Each query run in turn through a started batcher: the thread that searched it and its hits."""

    async def main():
        b = DynamicBatcher(engine, ServiceMetrics(), max_wait_s=0.0)
        b.start()
        b.executor.inference = recording = Recording(b.executor.inference)
        where = recording.where
        out = []
        try:
            for i, query in enumerate(queries):
                if pause_first and i == len(queries) - 1:
                    b.pause()
                    task = asyncio.ensure_future(b.run(query))
                    await asyncio.sleep(0.05)
                    assert not task.done() and b.queued == 1  # held in the queue, not searched inline
                    b.resume()
                    result = await task
                else:
                    result = await b.run(query)
                out.append((where[-1], [(h.row, h.score) for h in result.hits]))
        finally:
            await b.stop()
        return out

    return asyncio.run(main())


def vector_query(engine: SearchEngine, i: int, **kwargs) -> Query:
    return Query(engine.pair, 10, vector=clustered_part(1, 8, 16)[i], **kwargs)


@pytest.fixture
def fast(monkeypatch):
    """Every search counts as fast: what is tested is where a query goes, not this machine's speed."""
    monkeypatch.setattr(executors, "INLINE_SEARCH_S", 10.0)


def test_a_lone_query_by_embedding_is_searched_on_the_loop_with_the_same_answer(engine, fast):
    queries = [vector_query(engine, i % 4) for i in range(8)]
    answers = answered_where(engine, queries)
    loop_thread = threading.main_thread().name
    assert answers[0][0] != loop_thread  # nothing measured yet: the inference thread, which measures it
    assert all(where == loop_thread for where, _ in answers[1:]), [w for w, _ in answers]
    for i in range(4):  # the same query, on a thread and on the loop: the same hits
        assert answers[i][1] == answers[i + 4][1]
        scores, rows = engine.pair.index.search(np.ascontiguousarray(queries[i].vector[None]), 10)
        assert [r for r, _ in answers[i][1]] == rows[0].tolist()


def test_paused_filtered_or_excluding_queries_keep_the_queue(engine, fast):
    loop_thread = threading.main_thread().name
    allowed = np.ones(engine.pair.index_version.size, dtype=bool)
    queries = [
        vector_query(engine, 0),
        vector_query(engine, 1),  # measured by now: on the loop
        vector_query(engine, 2, scope=Scope(allowed)),
        vector_query(engine, 3, exclude=Exclusion(ids=frozenset({"id0000001"}))),
        vector_query(engine, 4),  # paused: queued
    ]
    where = [w for w, _ in answered_where(engine, queries, pause_first=True)]
    assert where[1] == loop_thread
    assert all(w != loop_thread for w in where[2:]), where


def test_a_slow_index_is_never_searched_on_the_loop(engine, monkeypatch):
    monkeypatch.setattr(executors, "INLINE_SEARCH_S", 0.0)  # every search counts as slow
    where = [w for w, _ in answered_where(engine, [vector_query(engine, i) for i in range(4)])]
    assert threading.main_thread().name not in where
