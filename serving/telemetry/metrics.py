"""Prometheus metrics of the search service (names listed in docs/architecture.md, prefix `simsearch_`).

Each server owns its registry, so several servers (tests, benchmarks) can live in one process.
The registry also carries prometheus-client's process collector (`process_resident_memory_bytes`,
`process_open_fds`, CPU seconds, …: what tells a server that grows over weeks from one that
holds up) and its Python GC collector.

A server of several processes (`serve --processes N`, `serving.workers`) counts in
prometheus-client's multiprocess mode: each worker writes its figures to files under
PROMETHEUS_MULTIPROC_DIR (set before the worker imports prometheus_client), and the supervisor
serves the one /metrics that sums them (`serve_multiprocess`). There a counter or histogram is
the sum over workers, the queue depth the live workers' sum, a Recall@K figure the workers'
mean weighted by their sample sizes (its sample size their sum), every other gauge the most
recent value any worker set; the process and GC collectors, per process, are left out.
"""

from __future__ import annotations

import datetime as _dt
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from core.artifacts.index_manifest import IndexManifest

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


GROUP_CANDIDATE_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 262144, 1048576, float("inf"))

# Each metric family: (attribute, kind, name, help, labels, buckets — a histogram's).
FAMILIES: tuple[tuple[str, type, str, str, tuple[str, ...], tuple[float, ...] | None], ...] = (
    ("requests", Counter, "simsearch_requests",
     "Calls answered, by method, gRPC status code and protocol (grpc, http)", ("method", "code", "protocol"), None),
    ("latency", Histogram, "simsearch_request_latency_seconds",
     "Call latency by method and protocol", ("method", "protocol"), LATENCY_BUCKETS),
    ("stage_latency", Histogram, "simsearch_stage_latency_seconds",
     "Time per request stage (decode, queue, embed, search)", ("stage",), LATENCY_BUCKETS),
    ("filtered_queries", Counter, "simsearch_filtered_queries",
     "Filtered queries by the planner's path: exact (over the matching rows) or index (faiss with a selector)",
     ("path",), None),
    ("group_candidates", Histogram, "simsearch_group_candidates",
     "Grouped queries: candidate rows the deciding round searched (the index size when the exact pass answered)",
     (), GROUP_CANDIDATE_BUCKETS),
    ("batch_size", Histogram, "simsearch_batch_size", "Queries per embedding/search batch", (), BATCH_BUCKETS),
    ("queue_depth", Gauge, "simsearch_queue_depth", "Queries waiting to be batched", (), None),
    # A sharded server's (`serve --ray`), by shard: a call's round trip from the ingress (the
    # hop and the shard's search), the shard's own search time, its rows and its replica's memory.
    ("shard_latency", Histogram, "simsearch_shard_latency_seconds",
     "A shard call's round trip from the ingress (hop and search), by shard and method", ("shard", "method"),
     LATENCY_BUCKETS),
    ("shard_search", Histogram, "simsearch_shard_search_seconds",
     "A shard call's search inside the shard replica, by shard", ("shard",), LATENCY_BUCKETS),
    ("shard_failures", Counter, "simsearch_shard_failures",
     "Shard calls that failed or missed their deadline (each try), by shard", ("shard",), None),
    ("shard_rows", Gauge, "simsearch_shard_rows", "Rows of the live version's shard, by shard", ("shard",), None),
    ("shard_memory", Gauge, "simsearch_shard_memory_bytes",
     "Resident memory of the replica that last answered, by shard", ("shard",), None),
    ("index_size", Gauge, "simsearch_index_size", "Vectors in the live index", (), None),
    ("index_info", Gauge, "simsearch_index_info",
     "Live index and model versions (value 1)", ("index_version", "index_id", "model_id", "factory"), None),
    ("recall_at_k", Gauge, "simsearch_recall_at_k",
     "Online Recall@K by source (probe, traffic, text, feedback)", ("k", "source"), None),
    ("ann_recall_at_k", Gauge, "simsearch_ann_recall_at_k",
     "Overlap of ANN top-K with exact top-K on sampled live queries", ("k",), None),
    ("recall_samples", Gauge, "simsearch_recall_samples",
     "What each Recall@K figure is a mean over (answers, probe queries, exact re-runs), by source (ann too)",
     ("k", "source"), None),
    ("reloads", Counter, "simsearch_reloads", "Successful model/index loads", (), None),
    ("worker_calls", Counter, "simsearch_worker_calls",
     "Calls answered by each worker process of a server of several (serve --processes), by worker", ("worker",),
     None),
    ("items_removed", Counter, "simsearch_items_removed", "Items taken down by RemoveItems", (), None),
    ("items_added", Counter, "simsearch_items_added", "Items added by AddItems (with upsert, replaced ones too)",
     (), None),
    ("reload_failures", Counter, "simsearch_reload_failures", "Failed model/index loads", (), None),
    ("loaded", Gauge, "simsearch_index_loaded", "1 when a model and index are loaded", (), None),
    # Figures of the live version's build, read from its manifest: the "Index builds" dashboard.
    ("build_seconds", Gauge, "simsearch_index_build_duration_seconds", "Build time of the live index", (), None),
    ("build_rows", Gauge, "simsearch_index_build_rows",
     "Catalog rows of the live index's build by state (indexed, skipped)", ("state",), None),
    ("build_ann_recall", Gauge, "simsearch_index_build_ann_recall",
     "ANN recall vs exact search measured at build time", (), None),
    ("build_probe_recall", Gauge, "simsearch_index_build_probe_recall_at_k",
     "Probe Recall@K measured at build time", ("k",), None),
    ("build_gate_forced", Gauge, "simsearch_index_build_gate_forced",
     "1 when the live index was published past a failed quality gate", (), None),
    ("build_created", Gauge, "simsearch_index_build_created_timestamp_seconds",
     "When the live index version was built", (), None),
)  # fmt: skip


class ServiceMetrics:
    requests: Counter
    latency: Histogram
    stage_latency: Histogram
    filtered_queries: Counter
    group_candidates: Histogram
    batch_size: Histogram
    queue_depth: Gauge
    shard_latency: Histogram
    shard_search: Histogram
    shard_failures: Counter
    shard_rows: Gauge
    shard_memory: Gauge
    index_size: Gauge
    index_info: Gauge
    recall_at_k: Gauge
    ann_recall_at_k: Gauge
    recall_samples: Gauge
    reloads: Counter
    worker_calls: Counter
    items_removed: Counter
    items_added: Counter
    reload_failures: Counter
    loaded: Gauge
    build_seconds: Gauge
    build_rows: Gauge
    build_ann_recall: Gauge
    build_probe_recall: Gauge
    build_gate_forced: Gauge
    build_created: Gauge

    def __init__(self, registry: CollectorRegistry | None = None, worker: int | None = None) -> None:
        """`worker`: this process's index among a server's workers (`serving.workers`), whose
        calls `worker_calls` counts; None for a server of one process."""
        self.registry = registry or CollectorRegistry()
        self.worker = worker
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        shared = multiprocess()
        for attribute, kind, name, help_text, labels, buckets in FAMILIES:
            extra: dict = {"buckets": buckets} if buckets is not None else {}
            if kind is Gauge and shared:  # how the workers' values make one (module docstring)
                extra["multiprocess_mode"] = (
                    "livesum" if attribute == "queue_depth" else "liveall" if name in MERGED_RECALL else "mostrecent"
                )
            setattr(self, attribute, kind(name, help_text, labels, registry=self.registry, **extra))
        for path in ("exact", "index"):  # both series from the start: a panel shows 0, not "no data"
            self.filtered_queries.labels(path)

    def count_call(self) -> None:
        """One call answered, counted for this worker (a server of several processes only)."""
        if self.worker is not None:
            self.worker_calls.labels(str(self.worker)).inc()

    def set_live(self, index_version: str, index_id: str, model_id: str, factory: str, size: int) -> None:
        _clear(self.index_info)
        self.index_info.labels(index_version, index_id, model_id, factory).set(1)
        self.index_size.set(size)
        self.loaded.set(1)

    def set_build_figures(self, manifest: IndexManifest) -> None:
        quality = manifest.quality
        self.build_seconds.set(manifest.build_seconds or 0.0)
        self.build_rows.labels("indexed").set(float(manifest.indexed_rows))
        self.build_rows.labels("skipped").set(float(manifest.rows.skipped_total if manifest.rows else 0))
        self.build_ann_recall.set(quality.ann_recall_at_k if quality is not None else 0.0)
        _clear(self.build_probe_recall)
        for k, value in ((quality.probe_recall_at_k if quality is not None else None) or {}).items():
            self.build_probe_recall.labels(str(k)).set(value)
        self.build_gate_forced.set(1.0 if manifest.quality_gate is not None and manifest.quality_gate.forced else 0.0)
        if manifest.created:
            self.build_created.set(_dt.datetime.fromisoformat(manifest.created).timestamp())

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _clear(gauge: Gauge) -> None:
    """Forget a labelled gauge's series. In multiprocess mode a series' value stays in the
    worker's file whatever this process forgets (prometheus-client does not clear there): 0 says
    it is gone."""
    if not multiprocess():
        gauge.clear()
        return
    for labels in list(gauge._metrics):
        gauge.labels(*labels).set(0)


def multiprocess() -> bool:
    """Whether this process counts into files a supervisor sums (prometheus-client's multiprocess
    mode, chosen by the environment before prometheus_client was imported)."""
    return bool(os.environ.get(MULTIPROC_ENV))


# Each worker measures Recall@K over the answers it gave: the server's figure is their mean
# weighted by each one's sample size, and its sample size their sum (`WorkersRecall`).
RECALL, ANN_RECALL, SAMPLES = "simsearch_recall_at_k", "simsearch_ann_recall_at_k", "simsearch_recall_samples"
MERGED_RECALL = (RECALL, ANN_RECALL, SAMPLES)


class WorkersRecall:
    """The workers' files (`MultiProcessCollector`) as the supervisor's /metrics serves them,
    with each Recall@K figure merged over the workers (written per process: "liveall") instead
    of the last one a worker wrote."""

    def __init__(self, directory: str) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.files = MultiProcessCollector(None, path=directory)

    def collect(self):
        families = {family.name: family for family in self.files.collect()}
        samples: dict[tuple[str, str], dict[str, float]] = {}  # (k, source) → pid → n
        if SAMPLES in families:
            for sample in families[SAMPLES].samples:
                labels = sample.labels
                samples.setdefault((labels["k"], labels["source"]), {})[labels["pid"]] = sample.value
        for family in families.values():
            if family.name in MERGED_RECALL:
                family.samples = _merged(family, samples)
            yield family


def _merged(family, samples: dict[tuple[str, str], dict[str, float]]) -> list:
    """`family`'s per-worker series as one series a label set: sample sizes summed, figures
    averaged weighted by their sample sizes (equally where none is known)."""
    from prometheus_client.samples import Sample

    groups: dict[tuple, list] = {}
    for sample in family.samples:
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
        groups.setdefault(key, []).append(sample)
    out = []
    for key, group in groups.items():
        labels = dict(key)
        source = "ann" if family.name == ANN_RECALL else labels.get("source")
        weights = samples.get((labels.get("k"), source), {})
        if family.name == SAMPLES:
            value = sum(s.value for s in group)
        else:
            value = merged_recall([s.value for s in group], [weights.get(s.labels["pid"], 0.0) for s in group])
        out.append(Sample(group[0].name, labels, value))
    return out


def merged_recall(values: list[float], samples: list[float]) -> float:
    """Several workers' figures of one Recall@K as the whole server's: their mean weighted by
    their sample sizes (equal weights where none is known)."""
    total = sum(samples)
    if not total:
        return sum(values) / len(values)
    return sum(value * n for value, n in zip(values, samples, strict=True)) / total


def serve_multiprocess(directory: str, port: int, host: str = "127.0.0.1") -> None:
    """Serve /metrics on `port`: what every worker wrote under `directory`, summed (Recall@K:
    merged, `WorkersRecall`)."""
    registry = CollectorRegistry()
    registry.register(WorkersRecall(directory))
    start_http_server(port, addr=host, registry=registry)
