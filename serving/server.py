"""gRPC server: thin servicers over `SearchEngine`, plus health, reflection, auth and metrics."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from index.artifacts import ArtifactError
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.engine import Limits, SearchEngine, ServingPair, load_pair
from serving.errors import InvalidArgument, ServiceError
from serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)

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
    workers: int = 16
    admin_token: str | None = None
    max_k: int = 1000
    max_message_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_batch_queries: int = 256
    feedback_window: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536 or (self.metrics_port is not None and not 0 <= self.metrics_port < 65536):
            raise ValueError("ports must be within 0..65535")
        for name in ("workers", "max_k", "max_message_bytes", "max_image_pixels", "max_batch_queries"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not Path(self.index_root).is_dir():
            raise ValueError(f"index root not found: {self.index_root}")


class SearchServicer(pb_grpc.SimilaritySearchServicer):
    """Maps protobuf messages to engine calls and engine errors to status codes."""

    def __init__(self, engine: SearchEngine, metrics: ServiceMetrics, feedback_window: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self._recent: OrderedDict[str, tuple[str | None, list[str]]] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._feedback_window = feedback_window

    def _rpc(self, method: str, context: grpc.ServicerContext, body: Callable[[], object]):
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return body()
        except ServiceError as exc:
            code = exc.code
            context.abort(exc.code, exc.message)
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, "internal error; see server logs")
        finally:
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    def _search_one(self, request: pb.SearchRequest, pair: ServingPair) -> pb.SearchResponse:
        engine = self.engine
        started = time.perf_counter()
        engine.check_k(request.k)
        request_id = request.request_id or uuid.uuid4().hex
        timings = pb.StageTimings()
        exclude = engine.exclude_rows(pair, list(request.exclude_ids))
        kind = request.WhichOneof("query")
        if kind == "image":
            if len(request.image) == 0:
                raise InvalidArgument("image bytes are empty")
            t = time.perf_counter()
            array = engine.decode(pair, request.image)
            timings.decode_ms = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            vector = engine.embed(pair, [array])[0]
            timings.embed_ms = (time.perf_counter() - t) * 1e3
        elif kind == "embedding":
            vector = engine.check_embedding(pair, request.embedding.values)
        elif kind == "item_id":
            vector, row = engine.item_vector(pair, request.item_id)
            exclude.add(row)
        else:
            raise InvalidArgument("request has no query: set image, embedding or item_id")
        t = time.perf_counter()
        (hits,) = engine.search(pair, vector[None, :], request.k, [exclude])
        timings.search_ms = (time.perf_counter() - t) * 1e3
        for stage in ("decode", "embed", "search"):
            value = getattr(timings, f"{stage}_ms")
            if value:
                self.metrics.stage_latency.labels(stage).observe(value / 1e3)
        items = pair.items
        response = pb.SearchResponse(
            request_id=request_id,
            index_version=pair.version,
            index_id=pair.index_id,
            model_id=pair.model_id,
            neighbors=[
                pb.Neighbor(
                    id=items.ids[h.row], score=h.score, label=items.labels[h.row], metadata=items.metadata[h.row]
                )
                for h in hits
            ],
        )
        timings.total_ms = (time.perf_counter() - started) * 1e3
        response.timings.CopyFrom(timings)
        self._remember(
            request_id, request.label if request.HasField("label") else None, [n.id for n in response.neighbors]
        )
        return response

    def _remember(self, request_id: str, label: str | None, ids: list[str]) -> None:
        with self._recent_lock:
            self._recent[request_id] = (label, ids)
            while len(self._recent) > self._feedback_window:
                self._recent.popitem(last=False)

    def Search(self, request, context):
        return self._rpc("Search", context, lambda: self._search_one(request, self.engine.pair))

    def SearchBatch(self, request, context):
        def body():
            if len(request.requests) > self.engine.limits.max_batch_queries:
                raise InvalidArgument(
                    f"{len(request.requests)} queries exceed the batch limit of {self.engine.limits.max_batch_queries}"
                )
            pair = self.engine.pair
            return pb.SearchBatchResponse(responses=[self._search_one(r, pair) for r in request.requests])

        return self._rpc("SearchBatch", context, body)

    def Embed(self, request, context):
        def body():
            pair = self.engine.pair
            if len(request.image) == 0:
                raise InvalidArgument("image bytes are empty")
            t = time.perf_counter()
            vector = self.engine.embed(pair, [self.engine.decode(pair, request.image)])[0]
            return pb.EmbedResponse(
                embedding=vector.tolist(),
                model_id=pair.model_id,
                request_id=request.request_id or uuid.uuid4().hex,
                timings=pb.StageTimings(total_ms=(time.perf_counter() - t) * 1e3),
            )

        return self._rpc("Embed", context, body)

    def Feedback(self, request, context):
        def body():
            with self._recent_lock:
                known = request.request_id in self._recent
            if not known:
                raise InvalidArgument(f"unknown or expired request_id {request.request_id!r}")
            return pb.FeedbackResponse(accepted=True)

        return self._rpc("Feedback", context, body)

    def GetInfo(self, request, context):
        def body():
            pair = self.engine.pair
            limits = self.engine.limits
            return pb.GetInfoResponse(
                model_id=pair.model_id,
                index_version=pair.version,
                index_id=pair.index_id,
                index_size=pair.index.ntotal,
                embedding_dim=pair.dim,
                factory=pair.manifest.get("factory", ""),
                providers=pair.embedder.session.get_providers(),
                limits=pb.Limits(
                    max_k=limits.max_k,
                    max_message_bytes=limits.max_message_bytes,
                    max_image_pixels=limits.max_image_pixels,
                    max_batch_queries=limits.max_batch_queries,
                ),
            )

        return self._rpc("GetInfo", context, body)


class AdminServicer(pb_grpc.IndexAdminServicer):
    def __init__(self, server: SearchServer) -> None:
        self.server = server

    def Reload(self, request, context):
        try:
            old, new = self.server.reload(request.index_version or None, request.model_dir or None)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"reload failed, still serving the old pair: {exc}")
        return pb.ReloadResponse(
            index_version=new.version, model_id=new.model_id, previous_index_version=old.version if old else ""
        )


class AdminAuthInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on IndexAdmin methods."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{ADMIN_SERVICE}/"):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = metadata.get("authorization", "")
        if self.token is None:
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "admin API disabled: start the server with --admin-token")
        if not supplied.startswith("Bearer "):
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
        import hmac

        if not hmac.compare_digest(supplied[len("Bearer ") :].encode(), self.token.encode()):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "invalid admin token")
        return continuation(handler_call_details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class SearchServer:
    """Owns the engine, the gRPC server, health status and the metrics endpoint."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServiceMetrics()
        self.engine = SearchEngine(
            Limits(config.max_k, config.max_message_bytes, config.max_image_pixels, config.max_batch_queries)
        )
        self.health = health.HealthServicer()
        self._reload_lock = threading.Lock()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ]
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="rpc"),
            interceptors=[AdminAuthInterceptor(config.admin_token)],
            options=options,
        )
        pb_grpc.add_SimilaritySearchServicer_to_server(
            SearchServicer(self.engine, self.metrics, config.feedback_window), self.grpc_server
        )
        pb_grpc.add_IndexAdminServicer_to_server(AdminServicer(self), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SEARCH_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        self._set_health(False)
        self.port = self.grpc_server.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC port {config.host}:{config.port}")

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SEARCH_SERVICE):
            self.health.set(service, status)

    def reload(
        self, version: str | None = None, model_dir: str | None = None
    ) -> tuple[ServingPair | None, ServingPair]:
        """Load a pair off the request path and swap it in; on failure the old pair keeps serving."""
        with self._reload_lock:
            try:
                new = load_pair(self.config.index_root, version, model_dir or self.config.model, self.config.provider)
            except Exception:
                self.metrics.reload_failures.inc()
                raise
            old = self.engine.swap(new)
        self.metrics.reloads.inc()
        self.metrics.set_live(
            new.version, new.index_id, new.model_id, new.manifest.get("factory", ""), new.index.ntotal
        )
        self._set_health(True)
        log.info("serving index %s with model %s (%d items)", new.version, new.model_id, new.index.ntotal)
        return old, new

    def start(self) -> None:
        try:
            self.reload()
        except (ArtifactError, FileNotFoundError) as exc:
            log.warning("starting without a loaded index: %s", exc)
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        self.grpc_server.start()
        log.info("listening on %s:%d", self.config.host, self.port)

    def stop(self, grace: float | None = 5.0) -> None:
        self._set_health(False)
        self.grpc_server.stop(grace).wait()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()
