"""Where the search server listens: each port claimed before anything loads (`claim_port`,
`PortInUse`), held for a server's worker processes (`hold_port`, `WORKER_ENV`), the event loop it
serves on (`loop_factory`), and its gRPC server with the servicers, health and reflection
(`new_grpc_server`). The app (`serving.server.SearchApp`) binds them.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import tempfile
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


# "I/N": this process is worker I of the N that one server runs (`serving.workers`): its ports
# are held by its supervisor, and it binds them with SO_REUSEPORT beside its siblings.
WORKER_ENV = "SIMSEARCH_WORKER"


# The directory a server's workers share, made by their supervisor (mode 0700): each worker
# also listens there on a Unix socket of its own, by which its siblings reach it
# (`serving.api.siblings`).
WORKERS_DIR_ENV = "SIMSEARCH_WORKERS_DIR"


def worker_socket(index: int) -> str | None:
    """The gRPC address of worker `index` of this process's server, on its own Unix socket; None
    for a server that is one process."""
    directory = workers_folder()
    return f"unix:{directory}/worker-{index}.sock" if directory else None


def workers_folder() -> Path | None:
    """The folder a server's workers share (their sockets, their traffic histories); None for a
    server that is one process."""
    directory = os.environ.get(WORKERS_DIR_ENV)
    return Path(directory) if directory else None


def worker_sockets(slot: tuple[int, int]) -> dict[int, str]:
    """The addresses of the siblings of worker `slot` (its index, the server's workers), by index."""
    own, count = slot
    return {index: worker_socket(index) for index in range(count) if index != own}


def worker_slot() -> tuple[int, int] | None:
    """(this worker's index, the server's workers) when this process is one of a server's
    workers; None for a server that is one process."""
    value = os.environ.get(WORKER_ENV)
    if not value:
        return None
    index, count = value.split("/")
    return int(index), int(count)


def port_lock_path(port: int) -> Path:
    """The lock file a multi-process server holds (flock) for `port` while its workers share it."""
    return Path(tempfile.gettempdir()) / f"simsearch-port-{port}.lock"


_held_ports: dict[int, int] = {}  # port → the lock file's descriptor, held by this process


def hold_port(what: str, host: str, port: int, flag: str) -> None:
    """Hold `port` for this server's workers (an flock on `port_lock_path`, released by the
    kernel however the process ends), then claim it. Its workers bind it with SO_REUSEPORT, which
    a second server asking for it too would share without a word: every simsearch server checks
    the lock first (`claim_port`), so it is refused with one line instead."""
    path = port_lock_path(port)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PortInUse(what, host, port, flag, "held by another simsearch server's workers") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break  # the file at the path now, not one its last holder removed as it let go
        except FileNotFoundError:
            pass
        os.close(fd)
    _held_ports[port] = fd
    try:
        claim_port(what, host, port, flag)
    except PortInUse:
        release_port(port)
        raise


def release_port(port: int) -> None:
    """Let go of a port `hold_port` held, removing its lock file first (a server that took the
    lock on the file meanwhile sees it was removed, and takes the new one: `hold_port`)."""
    fd = _held_ports.pop(port, None)
    if fd is not None:
        port_lock_path(port).unlink(missing_ok=True)
        os.close(fd)


def free_port(host: str) -> int:
    """A port the system has free on `host`, for a server told port 0 whose workers must all
    bind the same one."""
    family, kind, proto, _, address = _address(host, 0)
    with socket.socket(family, kind, proto) as probe:
        probe.bind(address)
        return probe.getsockname()[1]


def _address(host: str, port: int) -> tuple:
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve the address to bind, {host!r}: {exc.strerror}") from None
    return addresses[0]


def _locked_by_another(port: int) -> bool:
    """Whether another simsearch server's workers hold `port` (`hold_port`)."""
    if port in _held_ports:
        return False
    try:
        fd = os.open(port_lock_path(port), os.O_RDONLY)
    except OSError:
        return False  # no lock file: no server with workers ever held it here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken to test
    return False


def claim_port(what: str, host: str, port: int, flag: str) -> None:
    """Fail at once with `PortInUse` when `host:port` cannot be bound, as a listener would bind it
    (SO_REUSEADDR, never SO_REUSEPORT), or when another simsearch server's workers hold it
    (`hold_port`). gRPC turns SO_REUSEPORT on by default, under which a second server on the
    same port binds without a word and the kernel splits connections between the two — two
    indexes answering one address; the server turns it off too (but among its own workers), and
    this check gives the refusal one clear line before a model is loaded."""
    if port == 0:
        return
    if _locked_by_another(port):
        raise PortInUse(what, host, port, flag, "held by another simsearch server's workers")
    family, kind, proto, _, address = _address(host, port)
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
    shared: bool = False,
) -> grpc.aio.Server:
    """The grpc.aio server on the running loop (it belongs to the loop it was made on), its
    servicers, health and reflection added; no port bound yet. `shared`: a worker's, whose port
    its siblings bind too (SO_REUSEPORT, the port held by their supervisor)."""
    server = grpc.aio.server(
        interceptors=[TokenAuthInterceptor(tokens)],
        options=[
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_send_message_length", config.limits.max_message_bytes),
            ("grpc.so_reuseport", 1 if shared else 0),  # see claim_port and hold_port
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


def bind_grpc(server: grpc.aio.Server, config: ServerConfig, shared: bool = False) -> int:
    """Bind `server`'s port (TLS where the transport names a certificate), claimed first — unless
    `shared`, a worker's port its supervisor holds: the port, or `PortInUse`."""
    transport = config.transport
    if not shared:
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
    slot = worker_slot() if shared else None
    own = worker_socket(slot[0]) if slot is not None else None
    if own is not None and not server.add_insecure_port(own):  # its siblings' way in: see WORKERS_DIR_ENV
        raise RuntimeError(f"worker {slot[0]} could not listen on {own}")
    return port
