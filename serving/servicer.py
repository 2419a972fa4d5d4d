"""The gRPC servicers, thin in the shape of grpc's own asyncio examples: protobuf in, a call on
the service layer (`serving.service`), protobuf or a status code out. Every RPC, Reload
included, goes through `RpcCall`: one error mapping (`serving.errors.status_of`), one count in
`simsearch_requests_total{method,code}` and one latency observation.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.errors import status_of
from serving.metrics import ServiceMetrics
from serving.service import AdminService, SearchService

log = logging.getLogger(__name__)
T = TypeVar("T")

SEARCH_SERVICE = pb.DESCRIPTOR.services_by_name["SimilaritySearch"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["IndexAdmin"].full_name

# gRPC reports a call without a deadline as ~2**63 ns remaining, which no wait accepts.
_NO_DEADLINE_S = 365 * 24 * 3600.0


def time_left(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds until the call's deadline, or None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_S else max(0.0, remaining)


class RpcCall:
    """Runs an RPC's body: counts and times it, and answers a failure with its status."""

    def __init__(self, metrics: ServiceMetrics, access_log: bool = False) -> None:
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, method: str, context: grpc.aio.ServicerContext, body: Awaitable[T]) -> T:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await body
        except asyncio.CancelledError:  # the client went away or its deadline passed
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, message = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method, extra={"method": method, "code": code.name})
            else:
                log.warning("%s: %s", method, message, extra={"method": method, "code": code.name})
            await context.abort(code, message)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(elapsed)
            if self.access_log:
                log.info("rpc", extra={"method": method, "code": code.name, "ms": round(elapsed * 1e3, 3)})


class SearchServicer(pb_grpc.SimilaritySearchServicer):
    def __init__(self, service: SearchService, call: RpcCall) -> None:
        self.service = service
        self.call = call

    async def Search(self, request, context):
        return await self.call("Search", context, self.service.search(request, time_left(context)))

    async def SearchBatch(self, request, context):
        return await self.call("SearchBatch", context, self.service.search_batch(request, time_left(context)))

    async def Embed(self, request, context):
        return await self.call("Embed", context, self.service.embed(request, time_left(context)))

    async def Feedback(self, request, context):
        return await self.call("Feedback", context, self.service.feedback(request))

    async def GetInfo(self, request, context):
        return await self.call("GetInfo", context, self.service.info())


class AdminServicer(pb_grpc.IndexAdminServicer):
    def __init__(self, admin: AdminService, call: RpcCall) -> None:
        self.admin = admin
        self.call = call

    async def Reload(self, request, context):
        # Loading takes seconds, off the loop, which keeps answering queries meanwhile.
        return await self.call("Reload", context, self.admin.reload(request))

    async def RemoveItems(self, request, context):
        return await self.call("RemoveItems", context, self.admin.remove_items(request, caller_identity(context)))


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who made an authenticated call, for the audit log: a fingerprint of its bearer token
    (never the token itself), and the peer address."""
    supplied = dict(context.invocation_metadata() or ()).get("authorization", "")
    token = supplied.removeprefix("Bearer ")
    fingerprint = f"token sha256:{hashlib.sha256(token.encode()).hexdigest()[:12]}" if token else "no token"
    return f"{fingerprint} from {context.peer()}"


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
