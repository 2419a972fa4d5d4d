"""Where the search server listens: each port claimed before anything loads (`claim_port`,
`PortInUse`), the event loop it serves on (`loop_factory`), and its gRPC server with the
servicers, health and reflection (`new_grpc_server`). The app (`serving.server.SearchApp`) binds them.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.api.admin_service import AdminService
from serving.api.search_service import SearchService
from serving.config import EVENT_LOOPS, ServerConfig
from serving.transport.auth import Tokens
from serving.transport.calls import CallRecorder
from serving.transport.servicer import (
    ADMIN_SERVICE,
    SEARCH_SERVICE,
    AdminServicer,
    RpcCall,
    SearchServicer,
    TokenAuthInterceptor,
)


class PortInUse(ValueError):
    """A port the server was told to listen on is taken: a user error, said before anything loads."""

    def __init__(self, what: str, host: str, port: int, flag: str, cause: object = "") -> None:
        detail = f" ({cause})" if cause else ""
        super().__init__(
            f"{what} port {host}:{port} is already in use{detail}: another server is listening there; "
            f"stop it or choose another {flag}"
        )


def claim_port(what: str, host: str, port: int, flag: str) -> None:
    """Fail at once with `PortInUse` when `host:port` cannot be bound, as a listener would bind it
    (SO_REUSEADDR, never SO_REUSEPORT). gRPC turns SO_REUSEPORT on by default, under which a
    second server on the same port binds without a word and the kernel splits connections
    between the two — two indexes answering one address; the server turns it off too, and this
    check gives the refusal one clear line before a model is loaded."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve the address to bind, {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = addresses[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise PortInUse(what, host, port, flag, exc.strerror) from None


def loop_factory(kind: str = "uvloop"):
    """A new event loop of `kind`: uvloop by default, which spends less of the loop's CPU per query."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {kind!r}")
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def new_grpc_server(
    config: ServerConfig,
    tokens: Tokens,
    recorder: CallRecorder,
    service: SearchService,
    admin: AdminService,
    health_servicer: health.aio.HealthServicer,
) -> grpc.aio.Server:
    """The grpc.aio server on the running loop (it belongs to the loop it was made on), its
    servicers, health and reflection added; no port bound yet."""
    server = grpc.aio.server(
        interceptors=[TokenAuthInterceptor(tokens)],
        options=[
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_send_message_length", config.limits.max_message_bytes),
            ("grpc.so_reuseport", 0),  # see claim_port
            *config.transport.connection_options,
        ],
        maximum_concurrent_rpcs=config.batching.max_queue + config.runtime.worker_threads,
    )
    call = RpcCall(recorder)
    pb_grpc.add_SimilaritySearchServicer_to_server(SearchServicer(service, call), server)
    pb_grpc.add_IndexAdminServicer_to_server(AdminServicer(admin, call), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SEARCH_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


def bind_grpc(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Bind `server`'s port (TLS where the transport names a certificate), claimed first: the port,
    or `PortInUse`."""
    transport = config.transport
    claim_port("gRPC", transport.host, transport.port, "--port")
    address = f"{transport.host}:{transport.port}"
    try:
        if transport.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(transport.tls_key).read_bytes(), Path(transport.tls_cert).read_bytes())]
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # taken between the claim and the bind
        raise PortInUse("gRPC", transport.host, transport.port, "--port", exc) from None
    if port == 0:
        raise PortInUse("gRPC", transport.host, transport.port, "--port")
    return port
