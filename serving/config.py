"""`serving serve`'s configuration: the index it serves, and its transport, batching and runtime
sections (the limits are `serving.search.engine.Limits`, the quality monitor's
`serving.monitoring.monitor.MonitorConfig`), resolved as every stage's are (`core.config`), and how it
loads the pair it serves."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.artifacts import layout as artifacts
from core.config import DEVICES, option, resolve_config, section
from core.data.catalog import read_probe_catalog
from index.versions.merge_policy import TIERED, WHOLE
from index.versions.segments import MAX_SEGMENTS
from serving.monitoring.monitor import MonitorConfig
from serving.search.engine import Limits, ServingPair, load_pair
from serving.search.query_embedder import MEASURE_BUDGET_S, Progress

EVENT_LOOPS = ("uvloop", "asyncio")


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity, bounded by a cgroup v2 CPU quota (a
    container's --cpus, a pod's limit), which the affinity does not show — a pod limited to 2
    CPUs on a 64-core node must not start 64 server processes."""
    cpus = len(os.sched_getaffinity(0)) or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota == "max":
            return cpus
        return max(1, min(cpus, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        return cpus


@dataclass
class Transport:
    """How clients reach the server: address, TLS, tokens, connection lifetime."""

    host: str = option("127.0.0.1", help="address to bind")
    port: int = option(50051, help="gRPC port (0 picks a free one)")
    metrics_port: int | None = option(9100, help="Prometheus HTTP port ('none': no metrics endpoint)")
    http_port: int | None = option(
        None, help="HTTP/JSON API and web console port (0 picks a free one; default: none, no HTTP)"
    )
    http_cors_origin: str | None = option(
        None, help="an origin (https://host:port) whose pages may call the HTTP API (default: no CORS)"
    )
    tls_cert: str | None = option(None, help="PEM certificate chain (enables TLS, with --tls-key)")
    tls_key: str | None = option(None, help="PEM private key")
    admin_token: str | None = option(None, help="bearer token for IndexAdmin (or SIMSEARCH_ADMIN_TOKEN)")
    search_token: str | None = option(None, help="bearer token required for search (or SIMSEARCH_SEARCH_TOKEN)")
    # Behind an L4 load balancer, a client that reconnects is spread over replicas added since.
    max_connection_age_s: float = option(
        300.0, help="ask a connection this old to go (GOAWAY), so clients reconnect and spread over replicas; 0: never"
    )
    max_connection_age_grace_s: float = option(30.0, help="how long an old connection's calls may take to finish")
    keepalive_s: float = option(
        60.0, help="ping a connection idle this long and close it if no answer within 20 s; 0: no pings"
    )

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be within 0..65535, got {value}")
        for name in ("max_connection_age_s", "max_connection_age_grace_s", "keepalive_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be ≥ 0 seconds (0: off), got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")

    @property
    def connection_options(self) -> list[tuple[str, int]]:
        """gRPC channel arguments for connection lifetime and keepalive."""
        options = []
        if self.max_connection_age_s:
            options += [
                ("grpc.max_connection_age_ms", round(self.max_connection_age_s * 1e3)),
                ("grpc.max_connection_age_grace_ms", round(self.max_connection_age_grace_s * 1e3)),
            ]
        if self.keepalive_s:
            options += [
                ("grpc.keepalive_time_ms", round(self.keepalive_s * 1e3)),
                ("grpc.keepalive_timeout_ms", 20_000),
            ]
        # Clients may ping an idle connection every 10 s (gRPC's default refuses more often
        # than every 5 minutes, and answers a client keepalive of a minute with GOAWAY).
        options += [("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
        return options


DEFAULT_BATCH_STREAMS = 2  # one server's batch streams: two ORT runs overlap, each with half the threads


@dataclass
class Batching:
    """Dynamic batching: queries that arrive together share one ONNX Runtime run and one search."""

    enabled: bool = option(True, flag="--batching", help="dynamic batching (off: each query runs alone)")
    max_batch_size: int = option(32, help="queries per ONNX Runtime/faiss batch")
    batch_streams: int | None = option(
        None,
        help="batches run at once, each on its own thread and share of the ONNX Runtime threads; one starts "
        "beside another once half of batch size / streams queries are queued (default 2; with --ray 1: its "
        "batches wait on the shards, and one stream makes them bigger, so fewer shard calls)",
    )
    max_wait_ms: float = option(0.0, help="longest wait to fill a batch (0: a batch is what queued meanwhile)")
    max_queue: int = option(1024, help="queued queries before RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "batch_streams", "max_queue"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ValueError("max_wait_ms must be ≥ 0")


@dataclass
class Runtime:
    """Where and on how many threads queries are decoded, embedded and searched."""

    provider: str = option("auto", choices=DEVICES, help="where ONNX Runtime embeds")
    workers: int | None = option(
        None, help="decode threads, and inference threads with batching off (default: CPU count)"
    )
    # Processes, not threads: one Python process tops out at about a core of gRPC and decoding
    # however many threads it has (the GIL); workers share the index's mapped pages.
    processes: int | None = option(
        None,
        help="server processes answering on the same ports, each a whole server sharing the index's memory-mapped "
        "segments; one /metrics for all (default: CPU count, within a container's CPU limit; 1: one process, no "
        "supervisor)",
    )
    search_threads: int | None = option(
        None,
        help="faiss (OpenMP) and BLAS threads one search may use, in each process that searches — a serve worker, "
        "a serve --ray shard replica (default: the CPUs less one a process for its event loop, shared out among "
        "those processes; at least 1)",
    )
    event_loop: str = option("uvloop", choices=EVENT_LOOPS, help="the gRPC event loop")
    inline_decode_pixels: int = option(
        4096, help="decode on the event loop when image and model input have at most this many pixels (0: never)"
    )
    inference_decode_pixels: int = option(
        65_536,
        help="decode images of at most this many pixels in the inference thread that embeds them, sparing a "
        "hop to a decode thread; larger ones decode in the pool while they wait",
    )
    intra_op_threads: int | None = option(
        None,
        help="ONNX Runtime threads per run (default: CPU count, at most 8, for a run made alone, shared out "
        "among the runs made at once); setting it uses that many for every run",
    )
    ort_spinning: bool = option(
        False, help="let idle ONNX Runtime threads busy-wait (off: they would steal gRPC's cores)"
    )
    run_rows: int | None = option(
        None,
        help="embed a batch in ONNX Runtime runs of at most this many images (0: the whole batch in one run; "
        "default: the fastest, measured when a model loads)",
    )
    run_rows_budget_s: float = option(
        MEASURE_BUDGET_S,
        help="longest the measurement of rows per run may hold up a model's load; past it, whole batches "
        "(as --run-rows 0), with a warning",
    )

    def __post_init__(self) -> None:
        if not 0 < self.run_rows_budget_s < float("inf"):
            raise ValueError(f"run_rows_budget_s must be > 0 seconds, got {self.run_rows_budget_s}")
        for name in ("workers", "intra_op_threads", "processes", "search_threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("inline_decode_pixels", "inference_decode_pixels", "run_rows"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")

    @property
    def server_processes(self) -> int:
        """Server processes: `processes`, by default the CPUs this process may run on."""
        return self.processes or available_cpus()

    def search_threads_of(self, processes: int) -> int:
        """Threads a search may use in one of `processes` server processes: `search_threads`, by
        default the CPUs less one a process, shared out — each process's event loop holds about a
        core (the GIL), and a search thread on the core it needs costs more than it gives
        (`serving.search.threads.SearchThreads` says what was measured)."""
        if self.search_threads is not None:
            return self.search_threads
        return max(1, (available_cpus() - processes) // processes)

    @property
    def worker_threads(self) -> int:
        """Decode threads, and inference threads with batching off: `workers`, by default the CPUs."""
        return self.workers or os.cpu_count() or 1


@dataclass
class Sharding:
    """`serve --ray`: the index served on Ray Serve — an ingress (these ports, this service), an
    embedder, and one deployment per shard of the version (`serving.ray_serve.deployment`)."""

    ray: bool = option(
        False,
        help="serve on Ray Serve (the cluster at RAY_ADDRESS, else a local Ray): the ingress, the embedder and "
        "one deployment per index shard",
    )
    shard_replicas: int = option(1, help="replicas of each shard deployment (with --ray; 2: a replica may fail)")
    embedder_replicas: int = option(
        1, help="replicas of the embedder deployment (with --ray): it decodes and embeds every query's image"
    )
    shard_timeout_s: float = option(
        5.0,
        help="a shard call's deadline (with --ray): past it, or failed, the call is tried again; then the shard "
        "is missing from the answer",
    )
    shard_retries: int = option(2, help="further tries of a shard call that failed or timed out (with --ray)")

    def __post_init__(self) -> None:
        if self.shard_replicas < 1:
            raise ValueError(f"shard_replicas must be at least 1, got {self.shard_replicas}")
        if self.embedder_replicas < 1:
            raise ValueError(f"embedder_replicas must be at least 1, got {self.embedder_replicas}")
        if not 0 < self.shard_timeout_s < float("inf"):
            raise ValueError(f"shard_timeout_s must be > 0 seconds, got {self.shard_timeout_s}")
        if self.shard_retries < 0:
            raise ValueError(f"shard_retries must be ≥ 0, got {self.shard_retries}")


@dataclass
class ServerConfig:
    """`serving serve`: the index it serves, and its transport, limits, batching, runtime and
    quality monitor, each a section of its own."""

    index_root: str = option("runs/index", help="index root with versions/ and CURRENT")
    model: str | None = option(None, help="model artifact directory (default: the one the index records)")
    watch_current: bool = option(False, help="reload when the index root's CURRENT changes")
    watch_interval_s: float = option(5.0, help="how often CURRENT is read with --watch-current")
    access_log: bool = option(False, help="log every RPC")
    keep_versions: int = option(5, help="index versions a RemoveItems takedown or an AddItems ingest keeps in the root")
    drain_timeout_s: float = option(
        30.0, help="RemoveItems returns once no request answers from the old version, or after this long"
    )
    max_segments: int = option(
        MAX_SEGMENTS,
        help="with --merges whole: compact a shard (merge its segments, drop deleted rows) once it holds more "
        "segments, as index add --max-segments",
    )
    merges: str = option(
        TIERED,
        choices=(TIERED, WHOLE),
        help="after AddItems/RemoveItems: tiered: the merges the tiered policy has due (segments of one size class, "
        "the base once the rows beside it pass half its own), in a process of its own; whole: a shard past "
        "--max-segments compacted whole, as index add --merges",
    )
    ingest_window_ms: float = option(
        150.0,
        help="AddItems/RemoveItems calls arriving within this long of each other are published as one segment "
        "and one version (0: each call its own)",
    )
    transport: Transport = section(Transport, help="address, TLS, tokens, connection lifetime")
    limits: Limits = section(Limits, help="what one request may ask")
    batching: Batching = section(Batching, help="dynamic batching")
    runtime: Runtime = section(Runtime, help="decoding, ONNX Runtime and event-loop threads")
    monitor: MonitorConfig = section(MonitorConfig, help="online Recall@K, ANN fidelity and probe rounds")
    sharding: Sharding = section(Sharding, help="serving on Ray Serve, one deployment per index shard")

    @classmethod
    def flat(cls, **options: Any) -> ServerConfig:
        """The configuration from options named flat, as on the command line (`port=0, batching=False`)."""
        return resolve_config(cls, options)

    def __post_init__(self) -> None:
        if self.batching.batch_streams is None:
            self.batching.batch_streams = 1 if self.sharding.ray else DEFAULT_BATCH_STREAMS
        if self.watch_interval_s <= 0:
            raise ValueError("watch_interval_s must be > 0")
        if self.sharding.ray and (self.runtime.processes or 1) > 1:  # Ray Serve scales by replicas instead
            raise ValueError("processes is for serve without --ray (--ray scales by --shard-replicas)")
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be at least 1, got {self.keep_versions}")
        if self.max_segments < 1:
            raise ValueError(f"max_segments must be at least 1, got {self.max_segments}")
        if not 0 <= self.ingest_window_ms < float("inf"):
            raise ValueError(f"ingest_window_ms must be ≥ 0 milliseconds, got {self.ingest_window_ms}")
        if not 0 < self.drain_timeout_s < float("inf"):
            raise ValueError(f"drain_timeout_s must be > 0 seconds, got {self.drain_timeout_s}")

    def check_inputs(self) -> None:
        """What reads files, before the server starts: the index root, TLS files, the probe catalog."""
        if not Path(self.index_root).is_dir():
            raise ValueError(f"index root not found: {self.index_root}")
        if not self.watch_current:  # watching, it waits for a first version to be published
            artifacts.check_index_root(self.index_root)
        for name in ("tls_cert", "tls_key"):
            path = getattr(self.transport, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name.replace('_', '-')} file not found: {path}")
        if self.monitor.probe_catalog is not None:
            if not Path(self.monitor.probe_catalog).is_file():
                raise ValueError(f"probe-catalog file not found: {self.monitor.probe_catalog}")
            read_probe_catalog(self.monitor.probe_catalog)

    @property
    def runs_at_once(self) -> int:
        """ORT runs the server makes at once — batch streams with batching on, inference threads
        with it off — among which the intra-op threads are shared out (a run made alone still
        gets them all); 1 when the operator fixed the threads every run takes."""
        if self.runtime.intra_op_threads is not None:
            return 1
        return self.batching.batch_streams if self.batching.enabled else self.runtime.worker_threads

    @property
    def largest_run(self) -> int:
        """The most images one ORT call may be asked to embed: a full batch, or one query
        unbatched (a SearchBatch call's queries run one by one then)."""
        return self.batching.max_batch_size if self.batching.enabled else 1

    def load(
        self,
        version: str | None = None,
        model_dir: str | None = None,
        previous: ServingPair | None = None,
        progress: Progress | None = None,
    ) -> ServingPair:
        """The pair this configuration serves: `version` of the index (default: the one CURRENT
        names) with `model_dir` (default: `model`, else the one the index records), loaded for
        its provider and its runs at once. `previous`: the live pair, whose measured rows per ORT run
        a new index for the same model reuses. `progress` hears how the run-size measurement goes."""
        return load_pair(
            self.index_root,
            version,
            model_dir or self.model,
            self.runtime.provider,
            self.runtime.intra_op_threads,
            self.runtime.ort_spinning,
            runs_at_once=self.runs_at_once,
            run_rows=self.runtime.run_rows,
            batch_rows=self.largest_run,
            previous=previous,
            measure_budget_s=self.runtime.run_rows_budget_s,
            progress=progress,
        )
