"""gRPC server on grpc.aio: thin servicers over the search logic, plus health, reflection, auth
and metrics.

One asyncio event loop takes every RPC; nothing on it blocks. Tiny images are decoded on the
loop; small ones, and any the inference thread would take at once (batching off, or the batcher
idle), by the inference thread that embeds them; the rest in a worker pool while they wait.
Embedding and search run in the batcher's inference threads (a batch per stream), reloads in
the loop's default executor. The servicers only translate: protobuf in, plain calls on
`SearchEngine` / `DynamicBatcher` / `RecallMonitor`, protobuf or a status code out.
`SearchServer` keeps a blocking API (start, stop, reload, run_probe) for the CLI, tests and
background threads.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
import uuid
import weakref
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from PIL import Image

from core import artifacts
from core.artifacts import ArtifactError
from index.build import read_probe_catalog
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.batching import DynamicBatcher, Job
from serving.engine import Hit, Limits, SearchEngine, ServingPair, load_pair
from serving.errors import DeadlineExceeded, InvalidArgument, ServiceError
from serving.memory import pin_mmap_threshold, reclaim
from serving.metrics import ServiceMetrics
from serving.monitor import MonitorConfig, RecallMonitor, probe_recall

log = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC reports a call without a deadline as ~2**63 ns remaining, which no wait accepts.
_NO_DEADLINE_S = 365 * 24 * 3600.0

SEARCH_SERVICE = pb.DESCRIPTOR.services_by_name["SimilaritySearch"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["IndexAdmin"].full_name


@dataclass
class ServerConfig:
    index_root: str = "runs/index"
    model: str | None = None  # default: the model directory the index manifest records
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9100
    provider: str = "auto"
    workers: int | None = None  # decode threads (and inference threads with batching off); default: CPUs
    event_loop: str = "uvloop"  # or "asyncio"; one loop per process, chosen by its first server
    inline_decode_pixels: int = 4096  # decode on the event loop when image and model input are this small
    inference_decode_pixels: int = 65_536  # decode in the inference thread images this small, not in the pool
    intra_op_threads: int | None = None
    ort_spinning: bool = False  # busy-waiting ORT threads steal the cores gRPC and decoding need
    run_rows: int | None = None  # images per ORT run; None: measured at load; 0: a batch in one run
    admin_token: str | None = None
    search_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_k: int = 1000
    max_message_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_batch_queries: int = 256
    batching: bool = True
    max_batch_size: int = 32
    batch_streams: int = 2  # batches run at once, each on its own inference thread
    max_wait_ms: float = 0.0  # greedy: a batch is whatever queued while the last one ran
    max_queue: int = 1024
    feedback_window: int = 10_000
    recall_ks: list[int] | None = None
    recall_window: int = 1000
    ann_sample_rate: float = 0.05
    probe_interval_s: float = 60.0  # 0: no probe rounds, neither scheduled nor after a reload
    probe_size: int = 200
    probe_catalog: str | None = None
    watch_current: bool = False
    watch_interval_s: float = 5.0
    access_log: bool = False
    # A connection older than this is asked to go (GOAWAY; its calls get the grace to finish) and
    # the client reconnects: behind an L4 load balancer that spreads clients over replicas added
    # since they connected. 0: connections live as long as the clients keep them.
    max_connection_age_s: float = 300.0
    max_connection_age_grace_s: float = 30.0
    # Ping a connection idle this long; one that does not answer within 20 s is closed, so a
    # vanished client's connection is not kept open. 0: no pings.
    keepalive_s: float = 60.0

    @property
    def worker_threads(self) -> int:
        """Decode threads, and inference threads with batching off: `workers`, by default the CPUs."""
        return self.workers or os.cpu_count() or 1

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

    @property
    def runs_at_once(self) -> int:
        """ORT runs the server makes at once — batch streams with batching on, inference threads
        with it off — among which the intra-op threads are shared out (a run made alone still
        gets them all); 1 when the operator fixed the threads every run takes."""
        if self.intra_op_threads is not None:
            return 1
        return self.batch_streams if self.batching else self.worker_threads

    @property
    def largest_run(self) -> int:
        """The most images one ORT call may be asked to embed: a full batch, or one query
        unbatched (a SearchBatch call's queries run one by one then)."""
        return self.max_batch_size if self.batching else 1

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be within 0..65535, got {value}")
        for name in ("workers", "intra_op_threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        for name in ("inline_decode_pixels", "inference_decode_pixels", "run_rows"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        for name in (
            "max_k",
            "max_message_bytes",
            "max_image_pixels",
            "max_batch_queries",
            "max_batch_size",
            "batch_streams",
            "max_queue",
            "recall_window",
            "probe_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_connection_age_s", "max_connection_age_grace_s", "keepalive_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be ≥ 0 seconds (0: off), got {getattr(self, name)}")
        if self.max_wait_ms < 0 or self.watch_interval_s <= 0:
            raise ValueError("max_wait_ms must be ≥ 0; watch_interval_s > 0")
        if not 0 <= self.probe_interval_s < float("inf"):
            raise ValueError(f"probe_interval_s must be ≥ 0 seconds (0: no probe rounds), got {self.probe_interval_s}")
        if not Path(self.index_root).is_dir():
            raise ValueError(f"index root not found: {self.index_root}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "probe_catalog"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name.replace('_', '-')} file not found: {path}")
        if self.probe_catalog is not None:
            read_probe_catalog(self.probe_catalog)
        MonitorConfig(
            ks=tuple(self.recall_ks or (1, 5, 10)),
            ann_sample_rate=self.ann_sample_rate,
            probe_interval_s=self.probe_interval_s,
        )


@asynccontextmanager
async def _deadline(timeout: float | None) -> AsyncIterator[float | None]:
    """The call's deadline over what it awaits: past it, DEADLINE_EXCEEDED. Yields the deadline
    as a `time.monotonic()` value (None without one), for the jobs that must not start late."""
    try:
        async with asyncio.timeout(timeout):
            yield None if timeout is None else time.monotonic() + timeout
    except TimeoutError:
        raise DeadlineExceeded("deadline exceeded before the answer was ready") from None


def time_left(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds until the call's deadline, or None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_S else max(0.0, remaining)


class SearchServicer(pb_grpc.SimilaritySearchServicer):
    """Maps protobuf messages to engine/batcher calls and service errors to status codes."""

    def __init__(self, server: SearchServer) -> None:
        self.engine = server.engine
        self.batcher = server.batcher
        self.metrics = server.metrics
        self.monitor = server.monitor
        self.decode_pool = server.decode_pool
        self.inline_decode_pixels = server.config.inline_decode_pixels
        self.inference_decode_pixels = server.config.inference_decode_pixels
        self.access_log = server.config.access_log
        # request id → (serial of the load that answered, rows it returned): the serial, not the
        # pair, or the window would keep every pair it saw answering alive.
        # Rows, not ids: one small array an answer instead of a list of strings (the window holds
        # thousands of answers, and churns with every query).
        self._recent: OrderedDict[str, tuple[int, array]] = OrderedDict()
        self._feedback_window = server.config.feedback_window

    async def _rpc(self, method: str, context: grpc.aio.ServicerContext, body: Awaitable[T]) -> T:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await body
        except ServiceError as exc:
            code = exc.code
            log.warning("%s: %s", method, exc.message, extra={"method": method, "code": code.name})
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:  # the client went away or its deadline passed
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", method, extra={"method": method, "code": code.name})
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see server logs")
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(elapsed)
            if self.access_log:
                log.info("rpc", extra={"method": method, "code": code.name, "ms": round(elapsed * 1e3, 3)})

    # -- Search -----------------------------------------------------------------------------

    def decoder(self, pair: ServingPair, image: Image.Image) -> str:
        """Where an opened image's pixels are decoded: "loop" when image and model input are both
        tiny (a thread hop costs more than decoding them); "inference", by the inference thread
        that embeds it, when that thread would take the job at once or the image is small (the
        hop to a decode thread costs about what decoding it does: a 28×28 glyph PNG for a
        224×224 model, 0.2 ms); else "pool": in a decode thread, in parallel with the others,
        while the job waits for its batch."""
        contract = pair.embedder.contract
        pixels = image.width * image.height
        if max(pixels, contract.height * contract.width) <= self.inline_decode_pixels:
            return "loop"
        if pixels <= self.inference_decode_pixels or self.batcher.decodes_cheaply:
            return "inference"
        return "pool"

    async def _take_image(self, job: Job, data: bytes) -> None:
        """Give the job its image: decoded here or in the decode pool, or only opened, for the
        inference thread to decode."""
        image = self.engine.open_image(data)
        decoder = self.decoder(job.pair, image)
        if decoder == "inference":
            job.image = image
        elif decoder == "loop":
            job.array = self.engine.model_input(job.pair, image)
        else:
            loop = asyncio.get_running_loop()
            job.array = await loop.run_in_executor(self.decode_pool, self.engine.model_input, job.pair, image)
        job.decode_s = time.perf_counter() - job.received

    async def _prepare(self, request: pb.SearchRequest, pair: ServingPair, deadline: float | None) -> Job:
        engine = self.engine
        engine.check_k(request.k)
        exclude = engine.exclude_rows(pair, list(request.exclude_ids))
        kind = request.WhichOneof("query")
        job = Job(pair=pair, k=request.k, exclude=exclude, deadline=deadline)
        if kind == "image":
            await self._take_image(job, request.image)
        elif kind == "embedding":
            job.vector = engine.check_embedding(pair, request.embedding.values)
        elif kind == "item_id":
            job.vector, row = engine.item_vector(pair, request.item_id)
            job.exclude.add(row)
        else:
            raise InvalidArgument("request has no query: set image, embedding or item_id")
        return job

    async def _answer(self, request: pb.SearchRequest, pair: ServingPair, deadline: float | None) -> pb.SearchResponse:
        job = await self._prepare(request, pair, deadline)
        hits = await self.batcher.run(job)
        return self._respond(request, job, hits)

    def _respond(self, request: pb.SearchRequest, job: Job, hits: list[Hit]) -> pb.SearchResponse:
        pair = job.pair
        items = pair.items
        request_id = request.request_id or uuid.uuid4().hex
        timings = self._timings(job)
        neighbors = [
            pb.Neighbor(id=items.ids[h.row], score=h.score, label=items.labels[h.row], metadata=items.metadata[h.row])
            for h in hits
        ]
        rows = [h.row for h in hits]
        self._remember(request_id, pair.serial, rows)
        if request.HasField("label") and items.labelled:
            self.monitor.record_labelled(pair.serial, request.label, [n.label for n in neighbors])
        self.monitor.maybe_sample_ann(pair.serial, job.vector, rows, job.exclude)
        return pb.SearchResponse(
            neighbors=neighbors,
            request_id=request_id,
            index_version=pair.version,
            index_id=pair.index_id,
            model_id=pair.model_id,
            timings=timings,
        )

    def _timings(self, job: Job) -> pb.StageTimings:
        """The job's stage times, observed in the stage histograms and returned for its answer."""
        for stage, seconds in (
            ("decode", job.decode_s),
            ("queue", job.queue_s),
            ("embed", job.embed_s),
            ("search", job.search_s),
        ):
            if seconds:
                self.metrics.stage_latency.labels(stage).observe(seconds)
        return pb.StageTimings(
            decode_ms=job.decode_s * 1e3,
            queue_ms=job.queue_s * 1e3,
            embed_ms=job.embed_s * 1e3,
            search_ms=job.search_s * 1e3,
            total_ms=(time.perf_counter() - job.received) * 1e3,
        )

    async def search_many(self, requests: list[pb.SearchRequest], timeout: float | None) -> list[pb.SearchResponse]:
        """Queries answered on one pair (the one live when they arrived), batched with others."""
        pair = self.engine.pair
        async with _deadline(timeout) as deadline:
            if len(requests) == 1:
                return [await self._answer(requests[0], pair, deadline)]
            tasks = [asyncio.ensure_future(self._answer(r, pair, deadline)) for r in requests]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:  # one bad query fails the call: its siblings stop costing work
                for task in tasks:
                    task.cancel()
                raise

    def _remember(self, request_id: str, serial: int, rows: list[int]) -> None:
        self._recent[request_id] = (serial, array("l", rows))  # only the loop thread touches it: no lock
        while len(self._recent) > self._feedback_window:
            self._recent.popitem(last=False)

    async def Search(self, request, context):
        return await self._rpc("Search", context, self._search_one(request, time_left(context)))

    async def _search_one(self, request: pb.SearchRequest, timeout: float | None) -> pb.SearchResponse:
        return (await self.search_many([request], timeout))[0]

    async def SearchBatch(self, request, context):
        async def body():
            limit = self.engine.limits.max_batch_queries
            if len(request.requests) > limit:
                raise InvalidArgument(f"{len(request.requests)} queries exceed the batch limit of {limit}")
            return pb.SearchBatchResponse(responses=await self.search_many(list(request.requests), time_left(context)))

        return await self._rpc("SearchBatch", context, body())

    async def Embed(self, request, context):
        return await self._rpc("Embed", context, self._embed(request, time_left(context)))

    async def _embed(self, request: pb.EmbedRequest, timeout: float | None) -> pb.EmbedResponse:
        """An image embedded in a batch with the queries (a job searched for nothing)."""
        pair = self.engine.pair
        async with _deadline(timeout) as deadline:
            job = Job(pair=pair, k=0, exclude=set(), deadline=deadline)
            await self._take_image(job, request.image)
            await self.batcher.run(job)
        return pb.EmbedResponse(
            embedding=job.vector.tolist(),
            model_id=pair.model_id,
            request_id=request.request_id or uuid.uuid4().hex,
            timings=self._timings(job),
        )

    async def Feedback(self, request, context):
        async def body():
            returned = self._recent.get(request.request_id)
            if returned is None:
                raise InvalidArgument(f"unknown or expired request_id {request.request_id!r}")
            serial, rows = returned
            # Not accepted when the answer came from a pair swapped out since: it no longer
            # describes what is served (and its rows may name other items now).
            pair = self.engine.pair
            ids = [pair.items.ids[r] for r in rows] if pair.serial == serial else []
            return pb.FeedbackResponse(accepted=self.monitor.record_feedback(serial, ids, list(request.relevant_ids)))

        return await self._rpc("Feedback", context, body())

    async def GetInfo(self, request, context):
        async def body():
            pair = self.engine.pair
            limits = self.engine.limits
            recall = [
                pb.RecallFigure(source=source, k=k, value=v)
                for source, values in self.monitor.figures().items()
                for k, v in values.items()
            ]
            ann = [pb.RecallFigure(source="ann", k=k, value=v) for k, v in self.monitor.ann_values().items()]
            return pb.GetInfoResponse(
                model_id=pair.model_id,
                index_version=pair.version,
                index_id=pair.index_id,
                index_size=pair.index.ntotal,
                embedding_dim=pair.dim,
                factory=pair.manifest.factory,
                providers=pair.embedder.session.get_providers(),
                limits=pb.Limits(
                    max_k=limits.max_k,
                    max_message_bytes=limits.max_message_bytes,
                    max_image_pixels=limits.max_image_pixels,
                    max_batch_queries=limits.max_batch_queries,
                ),
                recall_at_k=recall,
                ann_recall_at_k=ann,
            )

        return await self._rpc("GetInfo", context, body())


class AdminServicer(pb_grpc.IndexAdminServicer):
    def __init__(self, server: SearchServer) -> None:
        self.server = server

    async def Reload(self, request, context):
        loop = asyncio.get_running_loop()
        try:  # loading takes seconds: off the loop, which keeps answering queries meanwhile
            old, new = await loop.run_in_executor(
                None, self.server.reload, request.index_version or None, request.model_dir or None
            )
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"reload failed, still serving the old pair: {exc}"
            )
        return pb.ReloadResponse(
            index_version=new.version, model_id=new.model_id, previous_index_version=old.version if old else ""
        )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens: always for IndexAdmin, for SimilaritySearch when a search token is set."""

    def __init__(self, admin_token: str | None, search_token: str | None) -> None:
        self.admin_token = admin_token
        self.search_token = search_token

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(f"/{ADMIN_SERVICE}/"):
            if self.admin_token is None:
                return _deny(
                    grpc.StatusCode.PERMISSION_DENIED, "admin API disabled: start the server with --admin-token"
                )
            expected = self.admin_token
        elif method.startswith(f"/{SEARCH_SERVICE}/") and self.search_token is not None:
            expected = self.search_token
        else:
            return await continuation(handler_call_details)
        supplied = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if not supplied.startswith("Bearer "):
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
        if not hmac.compare_digest(supplied[len("Bearer ") :].encode(), expected.encode()):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "invalid token")
        return await continuation(handler_call_details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


EVENT_LOOPS = ("uvloop", "asyncio")
_loop: asyncio.AbstractEventLoop | None = None
_loop_kind: str | None = None
_loop_lock = threading.Lock()


def event_loop(kind: str = "uvloop") -> asyncio.AbstractEventLoop:
    """The process's gRPC event loop, running on its own thread. One for every server in the
    process: grpc.aio shares one completion queue between loops, and each extra loop is woken
    for every event. uvloop by default: it took ~11% off the loop thread's CPU per query."""
    global _loop, _loop_kind
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {kind!r}")
    with _loop_lock:
        if _loop is None:
            if kind == "uvloop":
                import uvloop

                _loop = uvloop.new_event_loop()
            else:
                _loop = asyncio.new_event_loop()
            _loop_kind = kind
            threading.Thread(target=_loop.run_forever, name="grpc-aio", daemon=True).start()
        elif kind != _loop_kind:
            raise ValueError(f"this process already runs its servers on a {_loop_kind} loop, not {kind}")
        return _loop


class SearchServer:
    """Owns the engine, batcher, recall monitor, gRPC server, health status and metrics endpoint."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        pin_mmap_threshold()  # before the first pair: see serving/memory.py
        self.metrics = ServiceMetrics()
        self.engine = SearchEngine(
            Limits(config.max_k, config.max_message_bytes, config.max_image_pixels, config.max_batch_queries)
        )
        workers = config.worker_threads
        self.batcher = DynamicBatcher(
            self.engine,
            self.metrics,
            config.max_batch_size,
            config.max_wait_ms / 1e3,
            config.max_queue,
            enabled=config.batching,
            workers=workers,
            streams=config.batch_streams,
        )
        self.decode_pool = ThreadPoolExecutor(workers, thread_name_prefix="decode")
        self.monitor = RecallMonitor(
            MonitorConfig(
                ks=tuple(config.recall_ks or (1, 5, 10)),
                window=config.recall_window,
                ann_sample_rate=config.ann_sample_rate,
                probe_interval_s=config.probe_interval_s,
                probe_size=config.probe_size,
            ),
            self.metrics,
        )
        self.health = health.aio.HealthServicer()
        self._reload_lock = threading.Lock()
        self._stopping = threading.Event()
        self._watched_failure: str | None = None
        self._loop = event_loop(config.event_loop)
        self.servicer = SearchServicer(self)
        self.port = self._call(self._build(config, max_concurrent_rpcs=config.max_queue + workers))

    async def _build(self, config: ServerConfig, max_concurrent_rpcs: int) -> int:
        """Create the grpc.aio server on the loop (it belongs to the loop it was made on)."""
        self.grpc_server = grpc.aio.server(
            interceptors=[TokenAuthInterceptor(config.admin_token, config.search_token)],
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                *config.connection_options,
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        pb_grpc.add_SimilaritySearchServicer_to_server(self.servicer, self.grpc_server)
        pb_grpc.add_IndexAdminServicer_to_server(AdminServicer(self), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SEARCH_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        await self._set_health(False)
        address = f"{config.host}:{config.port}"
        if config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
            port = self.grpc_server.add_secure_port(address, credentials)
        else:
            port = self.grpc_server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC port {address}")
        return port

    def _call(self, coroutine: Coroutine[object, object, T], timeout: float | None = None) -> T:
        """Run a coroutine on the server's loop from another thread and wait for its result."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # waiting here would block the very loop that must run the coroutine
            raise RuntimeError("blocking call made on the server's event loop")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SEARCH_SERVICE):
            await self.health.set(service, status)

    def reload(
        self, version: str | None = None, model_dir: str | None = None
    ) -> tuple[ServingPair | None, ServingPair]:
        """Load a pair off the request path and swap it in; on failure the old pair keeps serving."""
        with self._reload_lock:
            try:
                new = load_pair(
                    self.config.index_root,
                    version,
                    model_dir or self.config.model,
                    self.config.provider,
                    self.config.intra_op_threads,
                    self.config.ort_spinning,
                    runs_at_once=self.config.runs_at_once,
                    run_rows=self.config.run_rows,
                    batch_rows=self.config.largest_run,
                    previous=self.engine.pair if self.engine.loaded else None,
                )
            except Exception:
                self.metrics.reload_failures.inc()
                raise
            old = self.engine.swap(new)
        self.metrics.reloads.inc()
        self.metrics.set_live(new.version, new.index_id, new.model_id, new.manifest.factory, new.index.ntotal)
        self.metrics.set_build_figures(new.manifest)
        self.monitor.reset(new)
        self._call(self._set_health(True))
        log.info(
            "serving index %s with model %s (%d items)",
            new.version,
            new.model_id,
            new.index.ntotal,
            extra={"index_version": new.version, "model_id": new.model_id},
        )
        if old is not None and self.monitor.config.probes:  # probe_interval_s 0: probes are off
            threading.Thread(target=self._probe_now, name="probe-after-reload", daemon=True).start()
        if old is not None:  # its memory goes back to the OS once the requests that took it finish
            released = weakref.ref(old)
            threading.Thread(target=reclaim, args=(released, 60.0, self._stopping), name="reclaim", daemon=True).start()
        return old, new

    # -- probe set --------------------------------------------------------------------------

    def probe_set(self, pair: ServingPair) -> tuple[list[Path], list[str], list[list[str]]]:
        """(image paths, labels, ids to exclude): a held-out catalog, or a fixed sample of items."""
        if not pair.items.labelled:
            return [], [], []  # answers without labels cannot be scored (build-time figures say so)
        if self.config.probe_catalog:
            catalog = read_probe_catalog(self.config.probe_catalog)
            rows = np.random.default_rng(0).permutation(len(catalog))[: self.config.probe_size]
            return [catalog.paths[r] for r in rows], [catalog.labels[r] for r in rows], [[] for _ in rows]
        items = pair.items
        rows = np.random.default_rng(0).permutation(len(items))[: self.config.probe_size]
        rows = [r for r in rows if Path(items.paths[r]).is_file()]
        return [Path(items.paths[r]) for r in rows], [items.labels[r] for r in rows], [[items.ids[r]] for r in rows]

    def run_probe(self) -> dict[int, float] | None:
        """Probe images through decode → batcher → search, exactly as client queries go."""
        if not self.engine.loaded:
            return None
        paths, labels, excludes = self.probe_set(self.engine.pair)
        if not paths:
            return None
        k = max(self.monitor.config.ks)
        requests = [
            pb.SearchRequest(image=p.read_bytes(), k=k, exclude_ids=ex) for p, ex in zip(paths, excludes, strict=True)
        ]
        answers = []
        for start in range(0, len(requests), self.config.max_batch_queries):
            chunk = requests[start : start + self.config.max_batch_queries]
            answers += self._call(self.servicer.search_many(chunk, 60.0))
        return probe_recall([[n.label for n in a.neighbors] for a in answers], labels, self.monitor.config.ks)

    def _probe_now(self) -> None:
        try:
            self.monitor.run_probe(self.run_probe)
        except Exception:
            log.exception("probe after reload failed")

    # -- CURRENT watcher --------------------------------------------------------------------

    def _watch_current(self) -> None:
        while not self._stopping.wait(self.config.watch_interval_s):
            target = artifacts.current_version(self.config.index_root)
            live = self.engine._pair.version if self.engine.loaded else None
            if target is None or target == live or target == self._watched_failure:
                continue
            try:
                self.reload(target)
                self._watched_failure = None
            except Exception as exc:
                self._watched_failure = target  # retried only once CURRENT names something else
                log.error("CURRENT names %s but it cannot be loaded: %s", target, exc)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self.reload()
        except (ArtifactError, FileNotFoundError) as exc:
            log.warning("starting without a loaded index: %s", exc)
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        self._call(self._start_serving())
        self.monitor.start(self.run_probe)  # probe rounds only where probe_interval_s > 0
        if self.config.watch_current:
            threading.Thread(target=self._watch_current, name="watch-current", daemon=True).start()
        log.info("listening on %s:%d", self.config.host, self.port)

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop taking RPCs, let in-flight ones finish (up to `grace` seconds), then stop workers."""
        self._stopping.set()
        self._call(self._shutdown(grace))
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.monitor.stop()

    async def _start_serving(self) -> None:
        self.batcher.start()
        await self.grpc_server.start()

    async def _shutdown(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await self.batcher.stop()

    def wait(self) -> None:
        self._call(self.grpc_server.wait_for_termination())
