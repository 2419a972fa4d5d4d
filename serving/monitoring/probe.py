"""Probe rounds' queries, for the recall monitor (`serving.monitoring.monitor`, source 1): labelled images
through decode → batcher → search, exactly as client queries go, scored as offline evaluation
scores them."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from core.data.catalog import read_probe_catalog
from core.retrieval.metrics import recall_from_neighbor_labels, stable_order
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.monitoring.monitor import RecallMonitor
from serving.monitoring.probe_changes import ProbedQuery, ProbedRound, new_rows, touched
from serving.search.engine import SearchEngine, ServingPair


def _read(path: str | Path) -> bytes:
    """A probe image's bytes. Rounds keep items' paths as the table's strings: a `Path` per image
    per round interns each of its parts, and the interpreter's interned-string table, left with
    a dead entry for each, is rebuilt at twice its size (1.9 -> 3.75 MB, once, in minute 13 of a
    soak with a reload every 20 s)."""
    with open(path, "rb") as f:
        return f.read()


def probe_recall(neighbor_labels: list[list[str]], labels: list[str], ks: Sequence[int]) -> dict[int, float]:
    """Recall@K of probe answers, with the evaluation stage's definition."""
    width = max(ks)
    padded = np.array([(row + [None] * width)[:width] for row in neighbor_labels], dtype=object)
    return recall_from_neighbor_labels(padded, np.array(labels, dtype=object), ks)


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
        self._round: ProbedRound | None = None  # the last round, as `changes_round` brings it up
        self._round_lock = threading.Lock()  # one round or one update of it at a time
        self.asked_again = 0  # queries the last `changes_round` asked again

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
        with self._round_lock:
            pair = self.engine.pair
            paths, labels, excludes = self.probe_set(pair)
            if not paths:
                return None
            answers = self._answers([self._request(p, ex) for p, ex in zip(paths, excludes, strict=True)], loop)
            self.service.monitor.probe_round_size(len(answers))
            self._round = self._probed(pair, paths, labels, excludes, answers)
            return probe_recall([[n.label for n in a.neighbors] for a in answers], labels, self.ks)

    def _request(self, path: str | Path, exclude: list[str]) -> pb.SearchRequest:
        return pb.SearchRequest(
            image=_read(path), k=max(self.ks), exclude_ids=exclude, filter=self.probe_filter, group_by=""
        )

    def _probed(
        self, pair: ServingPair, paths: list, labels: list[str], excludes: list[list[str]], answers: list
    ) -> ProbedRound | None:
        """The round kept for `changes_round`: a sample of the index's own rows, whose exact
        vectors are their queries' embeddings (a held-out catalog's images have none to read, nor
        has a version whose rows are held elsewhere, serve --ray's ingress's)."""
        version = pair.index_version
        if self.probe_catalog or not isinstance(version, IndexVersion):  # serve --ray's ingress holds no rows
            return None
        rows = version.rows_of_ids([ex[0] for ex in excludes])
        if any(row is None for row in rows.values()):
            return None
        queries = [
            ProbedQuery(str(path), label, ex, version.vector(rows[ex[0]]), *self._answered(answer))
            for path, label, ex, answer in zip(paths, labels, excludes, answers, strict=True)
        ]
        return ProbedRound(pair.serial, version, queries)

    def _answered(self, answer: pb.SearchResponse) -> tuple[list[str], list[str], float]:
        neighbors = answer.neighbors
        kth = neighbors[max(self.ks) - 1].score if len(neighbors) >= max(self.ks) else -np.inf
        return [n.id for n in neighbors], [n.label for n in neighbors], float(kth)

    def changes_round(self, loop: asyncio.AbstractEventLoop) -> dict[int, float] | None:
        """The last round brought up to the live pair, grown from its own by ingests and
        takedowns (`serving.monitoring.probe_changes`): the queries a new row or a takedown may
        have changed are asked again as clients' are, the rest keep their answers; queries of
        items taken down leave the round. Recorded on the monitor; None when there is no round to
        bring up, the live pair did not grow from the round's, or the change is too large to score
        this way (the next scheduled round measures it)."""
        with self._round_lock:
            probed, monitor = self._round, self.service.monitor
            if probed is None or not self.engine.loaded:
                return None
            pair = self.engine.pair
            if pair.serial == probed.serial or not monitor.in_lineage(probed.serial):
                return None
            added = new_rows(probed.version, pair.index_version)
            if added is None:
                return None
            again, gone = touched(probed, pair.index_version, added)
            asked = [probed.queries[n] for n in again]
            answers = self._answers([self._request(q.path, q.exclude) for q in asked], loop)
            for query, answer in zip(asked, answers, strict=True):
                query.ids, query.labels, query.kth_score = self._answered(answer)
            left = set(gone)
            queries = [q for n, q in enumerate(probed.queries) if n not in left]
            self._round = ProbedRound(pair.serial, pair.index_version, queries)
            self.asked_again = len(again)
            values = probe_recall([q.labels for q in queries], [q.label for q in queries], self.ks) if queries else None
        monitor.record_probe(pair, values, len(queries))
        return values

    def _answers(self, requests: list[pb.SearchRequest], loop: asyncio.AbstractEventLoop) -> list[pb.SearchResponse]:
        answers = []
        for start in range(0, len(requests), self.max_batch_queries):
            chunk = requests[start : start + self.max_batch_queries]
            # The probe's lane: users' queries are batched first, for up to PROBE_MAX_WAIT_S (issue 61).
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
