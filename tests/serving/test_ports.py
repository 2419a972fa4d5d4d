"""A server told to listen on a port another process holds refuses at once — one `error:` line
naming the port, exit 2, no model loaded — instead of sharing it (gRPC's SO_REUSEPORT) and
splitting the traffic between two indexes, or failing with a traceback after the load."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.client import SearchClient
from serving.config import ServerConfig
from serving.listen import PortInUse, claim_port
from tests.support.server import SearchServer

ROOT = Path(__file__).resolve().parents[2]


def serve(index_root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving", "serve", "--index-root", str(index_root), "--probe-interval-s", "0", *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(proc: subprocess.CompletedProcess, what: str, port: int) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {what} port 127.0.0.1:{port} is already in use"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "unexpected failure" not in proc.stderr
    assert "serving index" not in proc.stderr  # refused before any model was loaded


def test_a_second_server_on_a_grpc_port_in_use_exits_before_loading(demo_run, tmp_path):
    (tmp_path / "empty").mkdir()
    first = SearchServer(
        ServerConfig.flat(index_root=str(tmp_path / "empty"), port=0, metrics_port=None, watch_current=True)
    )  # waiting for a first index, as only --watch-current may
    first.start()
    try:
        started = time.monotonic()
        proc = serve(demo_run / "index", "--port", str(first.port), "--metrics-port", "none")
        assert_refused(proc, "gRPC", first.port)
        assert time.monotonic() - started < 60
        # The first server still owns the port alone: every call reaches it (it has no index).
        with SearchClient(f"127.0.0.1:{first.port}", timeout=30) as client:
            for _ in range(6):
                assert not client.healthy()
    finally:
        first.stop(grace=0)


def test_a_metrics_port_in_use_exits_before_loading(demo_run):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = serve(demo_run / "index", "--port", "0", "--metrics-port", str(port))
    assert_refused(proc, "metrics", port)


def test_a_port_shared_with_so_reuseport_is_refused():
    """What a default gRPC server holds: a listener with SO_REUSEPORT, which another socket
    asking for it too would silently share."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse, match=f"gRPC port 127.0.0.1:{port} is already in use.*--port"):
            claim_port("gRPC", "127.0.0.1", port, "--port")
    claim_port("gRPC", "127.0.0.1", port, "--port")  # free again: no error
    claim_port("gRPC", "127.0.0.1", 0, "--port")  # 0: the system picks a free one
