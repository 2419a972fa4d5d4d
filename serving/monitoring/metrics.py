"""Prometheus metrics of the search service (names listed in docs/architecture.md, prefix `simsearch_`).

Each server owns its registry, so several servers (tests, benchmarks) can live in one process.
The registry also carries prometheus-client's process collector (`process_resident_memory_bytes`,
`process_open_fds`, CPU seconds, …: what tells a server that grows over weeks from one that
holds up) and its Python GC collector.
"""

from __future__ import annotations

import datetime as _dt

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from core.index_manifest import IndexManifest

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


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "simsearch_requests",
            "Calls answered, by method, gRPC status code and protocol (grpc, http)",
            ["method", "code", "protocol"],
            registry=r,
        )
        self.latency = Histogram(
            "simsearch_request_latency_seconds",
            "Call latency by method and protocol",
            ["method", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_latency = Histogram(
            "simsearch_stage_latency_seconds",
            "Time per request stage (decode, queue, embed, search)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.filtered_queries = Counter(
            "simsearch_filtered_queries",
            "Filtered queries by the planner's path: exact (over the matching rows) or index (faiss with a selector)",
            ["path"],
            registry=r,
        )
        for path in ("exact", "index"):  # both series from the start: a panel shows 0, not "no data"
            self.filtered_queries.labels(path)
        self.group_candidates = Histogram(
            "simsearch_group_candidates",
            "Grouped queries: candidate rows the deciding round searched (the index size when the exact pass answered)",
            buckets=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 262144, 1048576, float("inf")),
            registry=r,
        )
        self.batch_size = Histogram(
            "simsearch_batch_size",
            "Queries per embedding/search batch",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("simsearch_queue_depth", "Queries waiting to be batched", registry=r)
        # A sharded server's (`serve --ray`), by shard: a call's round trip from the ingress (the
        # hop and the shard's search), the shard's own search time, its rows and its replica's memory.
        self.shard_latency = Histogram(
            "simsearch_shard_latency_seconds",
            "A shard call's round trip from the ingress (hop and search), by shard and method",
            ["shard", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shard_search = Histogram(
            "simsearch_shard_search_seconds",
            "A shard call's search inside the shard replica, by shard",
            ["shard"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shard_failures = Counter(
            "simsearch_shard_failures", "Shard calls that failed or missed their deadline (each try), by shard",
            ["shard"], registry=r,
        )  # fmt: skip
        self.shard_rows = Gauge(
            "simsearch_shard_rows", "Rows of the live version's shard, by shard", ["shard"], registry=r
        )
        self.shard_memory = Gauge(
            "simsearch_shard_memory_bytes", "Resident memory of the replica that last answered, by shard", ["shard"],
            registry=r,
        )  # fmt: skip
        self.index_size = Gauge("simsearch_index_size", "Vectors in the live index", registry=r)
        self.index_info = Gauge(
            "simsearch_index_info",
            "Live index and model versions (value 1)",
            ["index_version", "index_id", "model_id", "factory"],
            registry=r,
        )
        self.recall_at_k = Gauge(
            "simsearch_recall_at_k",
            "Online Recall@K by source (probe, traffic, text, feedback)",
            ["k", "source"],
            registry=r,
        )
        self.ann_recall_at_k = Gauge(
            "simsearch_ann_recall_at_k",
            "Overlap of ANN top-K with exact top-K on sampled live queries",
            ["k"],
            registry=r,
        )
        self.reloads = Counter("simsearch_reloads", "Successful model/index loads", registry=r)
        self.items_removed = Counter("simsearch_items_removed", "Items taken down by RemoveItems", registry=r)
        self.items_added = Counter(
            "simsearch_items_added", "Items added by AddItems (with upsert, replaced ones too)", registry=r
        )
        self.reload_failures = Counter("simsearch_reload_failures", "Failed model/index loads", registry=r)
        self.loaded = Gauge("simsearch_index_loaded", "1 when a model and index are loaded", registry=r)
        # Figures of the live version's build, read from its manifest: the "Index builds" dashboard.
        self.build_seconds = Gauge("simsearch_index_build_duration_seconds", "Build time of the live index", registry=r)
        self.build_rows = Gauge(
            "simsearch_index_build_rows",
            "Catalog rows of the live index's build by state (indexed, skipped)",
            ["state"],
            registry=r,
        )
        self.build_ann_recall = Gauge(
            "simsearch_index_build_ann_recall", "ANN recall vs exact search measured at build time", registry=r
        )
        self.build_probe_recall = Gauge(
            "simsearch_index_build_probe_recall_at_k", "Probe Recall@K measured at build time", ["k"], registry=r
        )
        self.build_gate_forced = Gauge(
            "simsearch_index_build_gate_forced",
            "1 when the live index was published past a failed quality gate",
            registry=r,
        )
        self.build_created = Gauge(
            "simsearch_index_build_created_timestamp_seconds", "When the live index version was built", registry=r
        )

    def set_live(self, index_version: str, index_id: str, model_id: str, factory: str, size: int) -> None:
        self.index_info.clear()
        self.index_info.labels(index_version, index_id, model_id, factory).set(1)
        self.index_size.set(size)
        self.loaded.set(1)

    def set_build_figures(self, manifest: IndexManifest) -> None:
        quality = manifest.quality
        self.build_seconds.set(manifest.build_seconds or 0.0)
        self.build_rows.labels("indexed").set(float(manifest.indexed_rows))
        self.build_rows.labels("skipped").set(float(manifest.rows.skipped_total if manifest.rows else 0))
        self.build_ann_recall.set(quality.ann_recall_at_k if quality is not None else 0.0)
        self.build_probe_recall.clear()
        for k, value in ((quality.probe_recall_at_k if quality is not None else None) or {}).items():
            self.build_probe_recall.labels(str(k)).set(value)
        self.build_gate_forced.set(1.0 if manifest.quality_gate is not None and manifest.quality_gate.forced else 0.0)
        if manifest.created:
            self.build_created.set(_dt.datetime.fromisoformat(manifest.created).timestamp())

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
