"""Online Recall@K from the three sources of docs/architecture.md, published as Prometheus gauges.

1. probe: labelled images held with the index are queried through the full serving path (a gRPC
   client to this very server) on a schedule; Recall@K as in offline evaluation, self excluded.
2. traffic / feedback: queries that carry a `label`, and `Feedback` calls naming the relevant
   results of an earlier request, give Recall@K over a sliding window.
3. ANN fidelity: a sampled fraction of live queries is re-run with exact search over the
   version's stored vectors in a background thread, off the request path; the figure is the
   fraction of the exact top K that the index returned, rows (groups) tied with the exact K-th
   best counted as equal (`index.search.faiss_index.recall_with_ties`, as the build's ANN recall).
   Like is compared with like: a grouped answer's first K groups with the exact top K groups
   (`index.search.grouping.exact_group_scores`), a plain answer's first K rows with the exact top K
   rows, each within the same filter, exclusions and takedowns.

Every buffer is bounded, so neither traffic nor feedback can grow the server's memory. Figures
describe the live pair only: each record names the pair that produced it, and one from a pair
swapped out meanwhile — a probe that spanned a reload, a sampled query checked late, an
in-flight answer — is dropped rather than published beside the new pair's figures.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import json_format

from core.config import option
from core.retrieval.ranking import best_k
from index.search.ann_recall import recall_with_ties
from index.search.filters import Filter
from index.search.grouping import Groups, exact_group_scores
from protos.simsearch.v1 import search_pb2 as pb
from serving.monitoring.ann_samples import ANN_BATCH, ANN_GATHER_S, EXACT_DEPTH, ExactQuery, ExactRanking, SampledQuery
from serving.monitoring.windows import SlidingRecall
from serving.search.answers import EVERY_ROW, Exclusion, Hit, Scope
from serving.search.engine import ServingPair
from serving.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorConfig:
    """What the server measures of its own quality: labelled answers and Feedback (online
    Recall@K), ANN fidelity (sampled queries re-run exactly) and probe rounds."""

    ks: tuple[int, ...] = option((1, 5, 10), flag="--recall-ks", help="K values for online Recall@K")
    window: int = option(1000, flag="--recall-window", help="labelled answers per sliding Recall@K window")
    ann_sample_rate: float = option(0.05, help="fraction of queries re-run exactly to measure ANN recall")
    ann_queue: int = option(256, cli=False, help="sampled queries waiting for their exact re-run")
    ann_cpu_share: float = option(
        0.05,
        help="the most of one core the exact re-runs may take (1: no bound); past it, sampled queries are dropped, "
        "and the figure's sample size says how many it holds",
    )
    probe_interval_s: float = option(
        60.0, help="seconds between probe rounds; one also runs at start and after each reload (0: none at all)"
    )
    probe_size: int = option(200, help="probe images per round")
    probe_catalog: str | None = option(None, help="labelled catalog of held-out probe images")
    probe_k_extra: int = option(1, cli=False, help="probes exclude themselves, so they ask for one more")
    probe_filter: str | None = option(
        None,
        help='a filter every probe query carries, as the protocol\'s JSON, e.g. \'{"must": [{"field": "category", '
        '"value": "shoes"}]}\' (measures the filtered path)',
    )
    feedback_window: int = option(10_000, cli=False, help="answers remembered for Feedback calls to score")

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise ValueError("recall ks must be positive")
        if not 0 <= self.ann_sample_rate <= 1:
            raise ValueError("ann_sample_rate must be within [0, 1]")
        if not 0 < self.ann_cpu_share <= 1:
            raise ValueError(f"ann_cpu_share must be within (0, 1], got {self.ann_cpu_share}")
        if self.window < 1 or self.probe_size < 1 or self.feedback_window < 1:
            raise ValueError("window, probe_size and feedback_window must be positive")
        self.probe_filter_message()  # a malformed filter fails at start, not in every probe round
        if not 0 <= self.probe_interval_s < float("inf"):
            raise ValueError(f"probe_interval_s must be ≥ 0 seconds (0: no probe rounds), got {self.probe_interval_s}")

    def probe_filter_message(self) -> pb.Filter | None:
        """`probe_filter` parsed (its fields are checked against each version by the queries)."""
        if self.probe_filter is None:
            return None
        try:
            message = json_format.Parse(self.probe_filter, pb.Filter())
        except json_format.ParseError as exc:
            raise ValueError(f"probe_filter is not a filter in the protocol's JSON: {exc}") from None
        if not (message.must or message.should or message.must_not):
            raise ValueError("probe_filter has no conditions")
        return message

    @property
    def probes(self) -> bool:
        """Whether probe rounds run at all: on a schedule and after each reload."""
        return self.probe_interval_s > 0


class RecallMonitor:
    def __init__(self, config: MonitorConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.traffic = SlidingRecall(config.ks, config.window)
        self.feedback = SlidingRecall(config.ks, config.window)
        self.text = SlidingRecall(config.ks, config.window)  # labelled text queries, apart from images'
        self.ann = {k: deque(maxlen=config.window) for k in config.ks}
        self.probe: dict[int, float] | None = None
        self.probe_items: dict[int, float] | None = None  # item Recall@K of the probe round, where items exist
        self._live: ServingPair | None = None  # figures are kept for this pair only
        # The loads whose records still count: the live one and those it grew from by ingests and
        # takedowns alone (`reset(..., grown=True)`); bounded, as a stream reloads without end.
        self._lineage: deque[int] = deque(maxlen=64)
        self.probe_queries: dict[str, int] = {}  # queries behind each probe source's last round
        self._round_queries = 0  # the running probe round's, once it has its answers
        self._lock = threading.Lock()  # a record checks the pair and publishes while no reset runs
        self._ann_jobs: queue.Queue = queue.Queue(maxsize=config.ann_queue)
        self._stop = threading.Event()
        self._grew = threading.Event()  # a reload grew the live version since the probe last caught up
        self._threads: list[threading.Thread] = []
        self._rng = random.Random(0)
        # (pair, k, queries) → each query's exact top k rows (groups, grouped) and their scores,
        # best first: set by a sharded server, whose vectors live in its shards (`serving.shards.fanout`).
        self.exact_top: Callable[[ServingPair, int, list[ExactQuery]], list[ExactRanking]] | None = None

    # -- live traffic -----------------------------------------------------------------------

    def record_labelled(self, serial: int, label: str, neighbor_labels: Sequence[str], source: str = "traffic") -> None:
        """A labelled query's answer, given by the load `serial`: `source` "traffic" for images,
        embeddings and ids, "text" for a text query (a text model's recall is its own figure)."""
        rank = next((i for i, lab in enumerate(neighbor_labels) if lab == label), None)
        self._record(serial, source, self.text if source == "text" else self.traffic, rank, len(neighbor_labels))

    def record_feedback(
        self, serial: int, returned_ids: Sequence[str], relevant_ids: Sequence[str], request_id: str | None = None
    ) -> bool:
        """Feedback on the answer the load `serial` gave (`returned_ids`): which ids were
        relevant (one the answer left out is a miss). One mark per `request_id`: a later one
        replaces it. Whether it counts: not when that load has been swapped out since."""
        relevant = set(relevant_ids)
        rank = next((i for i, item in enumerate(returned_ids) if item in relevant), None)
        return self._record(serial, "feedback", self.feedback, rank, len(returned_ids), request_id)

    def _is_live(self, serial: int) -> bool:
        return serial in self._lineage

    def in_lineage(self, serial: int) -> bool:
        """Whether load `serial` is live, or the live one grew from it by changes alone."""
        with self._lock:
            return self._is_live(serial)

    def _record(
        self, serial: int, source: str, window: SlidingRecall, rank: int | None, length: int, key: object = None
    ) -> bool:
        """Add a first-hit rank of an answer of `length` to `window` and publish it, if load
        `serial` is still the live one."""
        with self._lock:
            if not self._is_live(serial):
                return False
            window.add(rank, length, key)
            self._publish(source, window.values())
        return True

    def maybe_sample_ann(
        self,
        serial: int,
        vector: np.ndarray,
        hits: Sequence[Hit],
        exclude: Exclusion,
        scope: Scope = EVERY_ROW,
    ) -> None:
        """Queue a live query, answered by load `serial` with `hits`, for an exact re-run within
        its scope (a filtered query's read-only mask kept by reference); never blocks the request."""
        if self.config.ann_sample_rate <= 0 or self._rng.random() >= self.config.ann_sample_rate:
            return
        rows = [h.row for h in hits]
        seen = list(dict.fromkeys(h.group for h in hits)) if scope.group_by is not None else None
        job = SampledQuery(serial, np.array(vector, dtype=np.float32), rows, exclude, scope, seen)
        try:
            self._ann_jobs.put_nowait(job)
        except queue.Full:
            pass  # the checker is behind; dropping a sample costs nothing but precision

    def reset(self, pair: ServingPair, grown: bool = False) -> None:
        """`pair` is live now: figures of the old one no longer describe what is served — unless
        it only `grown` from the old one (`serving.monitoring.lineage.grew_from`: items added or
        taken down), whose figures, the probe's last round and answers still in flight go on counting."""
        with self._lock:
            if not grown:
                self._lineage.clear()
            self._lineage.append(pair.serial)
            self._live = pair
            if grown:
                self._grew.set()  # the probe's last round is brought up to it (`ProbeRunner.changes_round`)
                return
            self.traffic.clear()
            self.feedback.clear()
            self.text.clear()
            for window in self.ann.values():
                window.clear()
            self.probe = None
            self.probe_items = None
            self.probe_queries.clear()
            self.metrics.recall_at_k.clear()
            self.metrics.ann_recall_at_k.clear()
            self.metrics.recall_samples.clear()

    # -- background work --------------------------------------------------------------------

    def start(
        self,
        probe: Callable[[], dict[int, float] | None] | None,
        probe_changes: Callable[[], dict[int, float] | None] | None = None,
    ) -> None:
        """Start the ANN fidelity checker and, unless probes are off (`probe_interval_s` 0),
        the probe rounds — one at once, then one every `probe_interval_s` — and `probe_changes`
        after each reload that grew the live version (however many came while one ran: once)."""
        checker = threading.Thread(target=self._ann_loop, name="ann-fidelity", daemon=True)
        checker.start()
        self._threads.append(checker)
        if probe is not None and self.config.probes:
            prober = threading.Thread(target=self._probe_loop, args=(probe,), name="probe", daemon=True)
            prober.start()
            self._threads.append(prober)
        if probe_changes is not None and self.config.probes:
            follower = threading.Thread(target=self._changes_loop, args=(probe_changes,), name="probe-changes")
            follower.daemon = True
            follower.start()
            self._threads.append(follower)

    def stop(self) -> None:
        self._stop.set()
        try:
            self._ann_jobs.put_nowait(None)
        except queue.Full:
            pass

    def run_probe(self, probe: Callable[[], dict[int, float] | None]) -> dict[int, float] | None:
        """One probe round, published unless the live pair changed while it ran (its answers
        may then come from either pair; the reload's own round follows)."""
        live = self._live
        self._round_queries = 0
        try:
            values = probe()
        except Exception:
            if self._stop.is_set():  # the server stopped under the round: not a failure of the round
                log.info("probe round ended unfinished: the server is stopping")
                return None
            raise
        return values if self._keep_probe("probe", live, values, self._round_queries) else None

    def record_item_probe(self, pair: ServingPair, values: dict[int, float] | None, queries: int = 0) -> bool:
        """A probe round's item Recall@K (`ProbeRunner.item_round`) over `queries`, kept if `pair`
        is still live (or grew into the live one)."""
        return self._keep_probe("probe_items", pair, values, queries)

    def probe_round_size(self, queries: int) -> None:
        """The queries of the probe round now ending (`ProbeRunner.run`), for its figure's sample size."""
        self._round_queries = queries

    def _keep_probe(
        self, source: str, pair: ServingPair | None, values: dict[int, float] | None, queries: int = 0
    ) -> bool:
        """Keep and publish a probe round's figures as `source` (the attribute of that name)
        while `pair`, the pair live when the round started, is still live (or grew into it)."""
        with self._lock:
            # No pair at all (a monitor never given one) is still "the same pair".
            still_live = self._live is None if pair is None else self._is_live(pair.serial)
            if values is None or not still_live:
                return False
            setattr(self, source, values)
            self.probe_queries[source] = queries
            self._publish(source, values)
        return True

    def record_probe(self, pair: ServingPair, values: dict[int, float] | None, queries: int) -> bool:
        """A probe round brought up to `pair` (`ProbeRunner.changes_round`), kept if `pair` is
        still live (or grew into the live one)."""
        return self._keep_probe("probe", pair, values, queries)

    def _changes_loop(self, probe_changes: Callable[[], dict[int, float] | None]) -> None:
        while not self._stop.is_set():
            if not self._grew.wait(1.0):
                continue
            self._grew.clear()
            try:
                probe_changes()
            except Exception:
                if not self._stop.is_set():  # logged; the next growth or round measures again
                    log.exception("probe of a grown version failed")

    def _probe_loop(self, probe: Callable[[], dict[int, float] | None]) -> None:
        while not self._stop.is_set():
            try:
                self.run_probe(probe)
            except Exception:  # a failed probe round is logged and retried next interval
                log.exception("probe round failed")
            self._stop.wait(self.config.probe_interval_s)

    def _ann_loop(self) -> None:
        while not self._stop.is_set():
            jobs = [self._ann_jobs.get()]
            # A sharded server checks the queries sampled within ANN_GATHER_S in one call to its
            # shards: a call each cost the shards as many calls as the searches they checked.
            gathered = time.monotonic() + ANN_GATHER_S
            while self.exact_top is not None and jobs[-1] is not None and len(jobs) < ANN_BATCH:
                try:
                    jobs.append(self._ann_jobs.get(timeout=max(0.0, gathered - time.monotonic())))
                except queue.Empty:
                    break
            checked = [job for job in jobs if job is not None]
            started = time.thread_time()
            try:
                if self.exact_top is not None and checked:
                    self.check_ann_remote(checked)
                elif checked:
                    self.check_sampled(checked[0])
            except Exception:
                log.exception("ANN fidelity check failed")
            finally:
                for _ in jobs:
                    self._ann_jobs.task_done()
            if len(checked) < len(jobs):
                return
            # Bounded CPU: an exact re-run reads every stored vector (5% of 1,000 q/s over 100k
            # rows took 30% of a worker's time, beside the users' queries it slowed).
            spent = time.thread_time() - started
            self._stop.wait(spent * (1 / self.config.ann_cpu_share - 1))

    def ann_settled(self, timeout: float | None = None) -> bool:
        """Wait until every query sampled so far has been checked (or dropped); whether that
        happened within `timeout`. For tests and drills that read the ANN figure only once it
        covers what they sent, rather than after a pause they hope is long enough."""
        done = self._ann_jobs.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._ann_jobs.unfinished_tasks, timeout)

    def check_sampled(self, job: SampledQuery) -> None:
        """`check_ann` for a sampled query, its exclusion resolved over the live pair's rows."""
        pair = self._live
        if pair is None or pair.serial != job.serial:
            return
        scope = job.scope
        skip = set(job.exclude.rows_in(pair.index_version, scope.groups))
        self.check_ann(job.serial, job.vector, job.rows, skip, scope.allowed, scope.groups, scope.filter)

    def check_ann(
        self,
        serial: int,
        vector: np.ndarray,
        rows: list[int],
        exclude: set[int],
        allowed: np.ndarray | None = None,
        groups: Groups | None = None,
        filter: Filter | None = None,
    ) -> None:
        """Re-run a query answered by load `serial` exactly (among the `allowed` rows, when its
        filter gave some; for its top groups when it was grouped by `groups`), if that load is
        still live."""
        pair = self._live
        if pair is None or pair.serial != serial:  # sampled before a reload: it no longer describes the index served
            return
        depth = max(self.config.ks)
        if groups is None:
            scores = pair.index_version.exact_scores(vector)
            if allowed is not None:
                scores[~allowed] = -np.inf
            if exclude:
                scores[list(exclude)] = -np.inf
            top = _best(scores, depth)
            self._score_ann(serial, rows, scores[rows].tolist(), top.tolist(), scores[top].tolist())
            return
        # A grouped answer holds one item's rows together and never a second group's sibling
        # rows: only its groups compare with an exact answer, the exact top groups.
        live = pair.index_version.live_mask
        if live is not None:
            allowed = live if allowed is None else allowed & live
        best = exact_group_scores(vector, pair.vectors, groups, allowed, frozenset(exclude))
        answered = groups.first_seen(rows)
        top = _best(best, depth)
        their = [float(best[g]) if g >= 0 else -np.inf for g in answered]
        self._score_ann(serial, answered, their, top.tolist(), best[top].tolist())

    def check_ann_remote(self, jobs: list[SampledQuery]) -> None:
        """`check_ann` for queued queries whose exact answers come from `exact_top` (a sharded
        server), all of them in one call. The answers' rows are scored from the exact ranking,
        which lists EXACT_DEPTH×K of them: one past it scores below every row that can tie."""
        pair = self._live
        jobs = [job for job in jobs if pair is not None and job.serial == pair.serial]
        if not jobs:
            return
        queries = [ExactQuery(job.vector, job.exclude, job.scope.filter, job.scope.group_by) for job in jobs]
        ranked = self.exact_top(pair, EXACT_DEPTH * max(self.config.ks), queries)
        for job, (ids, scores) in zip(jobs, ranked, strict=True):
            answered = job.rows if job.scope.group_by is None else job.groups_seen
            known = dict(zip(ids, scores, strict=True))
            self._score_ann(job.serial, answered, [known.get(a, -np.inf) for a in answered], ids, scores)

    def _score_ann(
        self,
        serial: int,
        answered: Sequence[int | str],
        answered_scores: list[float],
        exact: Sequence[int | str],
        exact_scores: list[float],
    ) -> None:
        """One checked query's ANN fidelity at each K its answer reaches, while load `serial` is
        live: `answered` (rows or groups) with their exact scores, against the exact ranking."""
        for k in self.config.ks:
            if len(answered) < k:
                continue
            fidelity = recall_with_ties(answered, answered_scores, exact, exact_scores, k)
            with self._lock:
                if not self._is_live(serial):
                    return
                self.ann[k].append(fidelity)
                self.metrics.ann_recall_at_k.labels(str(k)).set(float(np.mean(self.ann[k])))
                self.metrics.recall_samples.labels(str(k), "ann").set(len(self.ann[k]))

    def ann_values(self) -> dict[int, float]:
        return {k: float(np.mean(v)) for k, v in self.ann.items() if v}

    def samples(self) -> dict[str, dict[int, int]]:
        """The sample behind each figure of `figures()` and `ann_values()`, by source and K:
        answers in the window, a probe round's queries, exact re-runs."""
        out = {source: {k: n for k in values} for source, n in self.probe_queries.items()
               if (values := getattr(self, source))}  # fmt: skip
        for source, window in (("traffic", self.traffic), ("text", self.text), ("feedback", self.feedback)):
            if counts := window.counts():
                out[source] = counts
        out["ann"] = {k: len(v) for k, v in self.ann.items() if v}
        return out

    def figures(self) -> dict[str, dict[int, float]]:
        out = {}
        for source, values in (
            ("probe", self.probe),
            ("probe_items", self.probe_items),
            ("traffic", self.traffic.values()),
            ("text", self.text.values()),
            ("feedback", self.feedback.values()),
        ):
            if values:
                out[source] = values
        return out

    def _publish(self, source: str, values: dict[int, float] | None) -> None:
        if values:
            samples = self.samples().get(source, {})
            for k in self.config.ks:
                if k in values:
                    self.metrics.recall_at_k.labels(str(k), source).set(values[k])
                    self.metrics.recall_samples.labels(str(k), source).set(samples.get(k, 0))
                else:  # no answer in the window reaches K any more: no figure rather than a stale one
                    with contextlib.suppress(KeyError):
                        self.metrics.recall_at_k.remove(str(k), source)


def _best(scores: np.ndarray, depth: int) -> np.ndarray:
    """The places of the `depth` best finite `scores`, best first (ties: the lower place)."""
    top = best_k(scores, depth)
    return top[np.isfinite(scores[top])]
