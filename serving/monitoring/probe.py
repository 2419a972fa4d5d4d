"""Probe rounds' queries, for the recall monitor (`serving.monitoring.monitor`, source 1): labelled images
through decode → batcher → search, exactly as client queries go, scored as offline evaluation
scores them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from core.data.catalog import read_probe_catalog
from core.retrieval.metrics import stable_order
from protos.simsearch.v1 import search_pb2 as pb
from serving.monitoring.monitor import RecallMonitor, probe_recall
from serving.search.engine import SearchEngine, ServingPair


def _read(path: str | Path) -> bytes:
    """A probe image's bytes. Rounds keep items' paths as the table's strings: a `Path` per image
    per round interns each of its parts, and the interpreter's interned-string table, left with
    a dead entry for each, is rebuilt at twice its size (1.9 -> 3.75 MB, once, in minute 13 of a
    soak with a reload every 20 s)."""
    with open(path, "rb") as f:
        return f.read()


class ProbedService(Protocol):
    """What a probe round asks of the search service (`serving.api.search_service.SearchService`,
    which sits above this room): its queries answered as a client's are, and the monitor they
    report to."""

    monitor: RecallMonitor

    async def search_many(
        self, requests: list[pb.SearchRequest], timeout: float | None, named: bool = False, background: bool = False
    ) -> list[pb.SearchResponse]: ...


class ProbeRunner:
    """One probe round on demand: `run(loop)` from any thread but the loop's own."""

    def __init__(
        self,
        service: ProbedService,
        engine: SearchEngine,
        ks: Sequence[int],
        probe_size: int,
        max_batch_queries: int,
        probe_catalog: str | None = None,
        probe_filter: pb.Filter | None = None,
    ) -> None:
        self.service = service
        self.engine = engine
        self.ks = tuple(ks)
        self.probe_size = probe_size
        self.max_batch_queries = max_batch_queries
        self.probe_catalog = probe_catalog
        self.probe_filter = probe_filter  # every probe query carries it: the filtered path is measured

    def probe_set(self, pair: ServingPair) -> tuple[list[str | Path], list[str], list[list[str]]]:
        """(image paths, labels, ids to exclude): a held-out catalog, or a fixed sample of items,
        chosen by their ids (the same items whatever the catalog's row order: `IndexVersion.probe_sample`,
        over the shards on a sharded server)."""
        if not pair.index_version.labelled:
            return [], [], []  # answers without labels cannot be scored (build-time figures say so)
        if self.probe_catalog:
            catalog = read_probe_catalog(self.probe_catalog)
            rows = stable_order(catalog.ids)[: self.probe_size]
            return [catalog.paths[r] for r in rows], [catalog.labels[r] for r in rows], [[] for _ in rows]
        sample = pair.index_version.probe_sample(self.probe_size)
        picked = [s for s in sample if s.live and os.path.isfile(s.path)]
        return [s.path for s in picked], [s.label for s in picked], [[s.id] for s in picked]

    def run(self, loop: asyncio.AbstractEventLoop) -> dict[int, float] | None:
        """Recall@K of one round, its queries answered on `loop`; None with nothing to score."""
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # waiting here would block the very loop that must answer the queries
            raise RuntimeError("a probe round is run from another thread than the server's loop")
        if not self.engine.loaded:
            return None
        paths, labels, excludes = self.probe_set(self.engine.pair)
        if not paths:
            return None
        k = max(self.ks)
        requests = [
            pb.SearchRequest(image=_read(p), k=k, exclude_ids=ex, filter=self.probe_filter, group_by="")
            for p, ex in zip(paths, excludes, strict=True)
        ]
        answers = self._answers(requests, loop)
        self.service.monitor.probe_round_size(len(answers))
        return probe_recall([[n.label for n in a.neighbors] for a in answers], labels, self.ks)

    def _answers(self, requests: list[pb.SearchRequest], loop: asyncio.AbstractEventLoop) -> list[pb.SearchResponse]:
        answers = []
        for start in range(0, len(requests), self.max_batch_queries):
            chunk = requests[start : start + self.max_batch_queries]
            # The probe's lane: a user query waiting is always batched first (issue 61).
            answering = self.service.search_many(chunk, 60.0, background=True)
            answers += asyncio.run_coroutine_threadsafe(answering, loop).result()
        return answers

    def item_round(self, loop: asyncio.AbstractEventLoop) -> dict[int, float] | None:
        """Item Recall@K where the live version has an item field: a fixed sample of rows (by
        their ids) whose item has another row queries by its image, grouped by item, its own row left out; a hit
        when its item is among the K best. Labels are not needed. Recorded on the monitor unless
        a reload swapped the pair meanwhile; None with no item field or nothing to score."""
        if not self.engine.loaded:
            return None
        pair = self.engine.pair
        field = pair.manifest.item_field
        if not field:
            return None
        picked = [s for s in pair.index_version.probe_sample(self.probe_size, field) if os.path.isfile(s.path)]
        if not picked:
            return None
        k = max(self.ks)
        requests = [
            pb.SearchRequest(
                image=_read(s.path), k=k, exclude_ids=[s.id], group_by=field, filter=self.probe_filter,
            )
            for s in picked
        ]  # fmt: skip
        answers = self._answers(requests, loop)
        ranked = [[n.group for n in a.neighbors] for a in answers]
        firsts = [[g for i, g in enumerate(top) if i == 0 or top[i - 1] != g] for top in ranked]
        values = {
            kk: float(np.mean([s.value in top[:kk] for s, top in zip(picked, firsts, strict=True)])) for kk in self.ks
        }
        self.service.monitor.record_item_probe(pair, values, len(picked))
        return values
