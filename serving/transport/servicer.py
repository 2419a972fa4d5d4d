"""The gRPC servicers, thin in the shape of grpc's own asyncio examples: protobuf in, a call on
the service layer (`serving.api.search_service`, `serving.api.admin_service`), protobuf or a status code out. Every
RPC, Reload included, goes through `RpcCall`: one error mapping (`serving.errors.status_of`), and
the `CallRecorder` the HTTP routes share (`serving.transport.calls`: one count in
`simsearch_requests_total{method,code,protocol}`, one latency observation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.api.admin_service import AdminService
from serving.api.search_service import SearchService
from serving.api.siblings import FRESH, RELAYED
from serving.errors import ServiceError
from serving.transport.auth import Scope, Tokens, token_fingerprint
from serving.transport.calls import CallRecorder

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
    """Runs an RPC's body: a failure is answered with its status; counted by the `CallRecorder`."""

    def __init__(self, recorder: CallRecorder) -> None:
        self.recorder = recorder

    async def __call__(self, method: str, context: grpc.aio.ServicerContext, body: Awaitable[T]) -> T:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await body
        except asyncio.CancelledError:  # the client went away or its deadline passed
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, message = self.recorder.failed(method, exc)
        finally:
            self.recorder.finished(method, "grpc", code, time.perf_counter() - started)
        # Out of the except block: grpc keeps an aborted call's AbortError past the call (under
        # traffic an ingress kept its first pair's over 60 s), and one raised while the failure
        # was being handled carries it as its context — its traceback, the request's frames, the
        # pair that answered — so a pair swapped out stayed referenced (issue 47).
        await context.abort(code, message)


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
        relayed = RELAYED in dict(context.invocation_metadata() or ())  # a sibling's: this worker's own
        return await self.call("GetInfo", context, self.service.info(whole_server=not relayed))


class AdminServicer(pb_grpc.IndexAdminServicer):
    def __init__(self, admin: AdminService, call: RpcCall) -> None:
        self.admin = admin
        self.call = call

    async def Reload(self, request, context):
        # Loading takes seconds, off the loop, which keeps answering queries meanwhile.
        relayed = dict(context.invocation_metadata() or ()).get(RELAYED)
        if relayed is not None:  # a sibling worker's (serving.api.siblings)
            return await self.call("Reload", context, self.admin.reload_relayed(request, relayed == FRESH))
        return await self.call("Reload", context, self.admin.reload(request, caller_identity(context), "grpc"))

    async def RemoveItems(self, request, context):
        removal = self.admin.remove_items(request, caller_identity(context), "grpc")
        return await self.call("RemoveItems", context, removal)

    async def AddItems(self, request, context):
        ingest = self.admin.add_items(request, caller_identity(context), "grpc")
        return await self.call("AddItems", context, ingest)


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who made an authenticated call, for the audit log: its token's fingerprint and the peer."""
    supplied = dict(context.invocation_metadata() or ()).get("authorization")
    return f"{token_fingerprint(supplied)} from {context.peer()}"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens (`serving.transport.auth.Tokens`): always for IndexAdmin, for SimilaritySearch when a
    search token is set."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(f"/{ADMIN_SERVICE}/"):
            scope = Scope.ADMIN
        elif method.startswith(f"/{SEARCH_SERVICE}/"):
            scope = Scope.SEARCH
        else:
            return await continuation(handler_call_details)
        try:
            self.tokens.check(scope, dict(handler_call_details.invocation_metadata or ()).get("authorization"))
        except ServiceError as exc:
            return _deny(exc.code, exc.message)
        return await continuation(handler_call_details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)
