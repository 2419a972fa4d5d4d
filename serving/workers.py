"""`serve --processes N`: one server of N worker processes on one port.

One Python process answers about a core's worth of calls however many threads it runs (the
GIL holds gRPC, decoding and the loop), so a server on a machine of many cores runs one worker
process per core, each a whole `python -m serving serve` (`serving.server`) that maps the same
index segments (faiss's mmap: their pages are in the page cache once, whatever the workers).

The supervisor — this module, the process the operator started — holds the ports before any
worker starts (`serving.listen.hold_port`: an flock per port that every simsearch server checks,
then a bind without SO_REUSEPORT that fails where anyone listens), so a second server on the
same port is refused with one line. Only then do the workers bind the ports, with SO_REUSEPORT,
among themselves; the kernel spreads connections over them. What makes them one server:

- reloads: each worker follows the index root's CURRENT (`--watch-current`), so a version one
  worker publishes (an ingest, a takedown) or `index rollback` makes live reaches them all;
  writes take the root's writer lock (`core.artifacts.layout.writer_lock`) as any writer does.
- metrics: the supervisor serves the one /metrics, summing what the workers count
  (`serving.telemetry.metrics.serve_multiprocess`), from a directory of its own per run,
  removed when it exits.
- the monitor: worker 0 alone runs probe rounds, so a round is run once per interval, not N times.
- shutdown: SIGTERM or SIGINT is passed to every worker, each drains as one server does
  (`serving.server.serve`), and the supervisor exits 0 once they are gone — killing any still
  there past the deadline.
- a worker that dies while serving is not restarted: the supervisor logs one line, stops the
  others and exits 1, so whatever restarts the server (systemd, Kubernetes) sees it fail.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from serving.config import ServerConfig
from serving.listen import WORKER_ENV, WORKERS_DIR_ENV, claim_port, free_port, hold_port, release_port
from serving.server import SHUTDOWN_DEADLINE_S
from serving.telemetry.metrics import MULTIPROC_ENV, serve_multiprocess

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the supervisor looks at its workers
KILL_AFTER_S = SHUTDOWN_DEADLINE_S + 5.0  # a worker past its own deadline by this is killed


@dataclass
class Ports:
    """The ports one server's workers share (port 0 resolved to a free one)."""

    grpc: int
    http: int | None
    metrics: int | None


def hold_ports(config: ServerConfig) -> Ports:
    """Hold the gRPC and HTTP ports for the workers and claim the metrics port, which the
    supervisor serves itself: `PortInUse` before any worker starts."""
    transport = config.transport
    host = transport.host
    port = transport.port or free_port(host)
    hold_port("gRPC", host, port, "--port")
    http = None
    if transport.http_port is not None:
        http = transport.http_port or free_port(host)
        try:
            hold_port("HTTP", host, http, "--http-port")
        except Exception:
            release_port(port)
            raise
    if transport.metrics_port is not None:
        claim_port("metrics", host, transport.metrics_port, "--metrics-port")
    return Ports(port, http, transport.metrics_port)


def worker_command(argv: list[str], index: int, ports: Ports) -> list[str]:
    """The command line of worker `index`: the supervisor's own `serve` flags, then those that
    make it one of the workers (later flags win over earlier ones and over a config file)."""
    flags = ["--processes", "1", "--port", str(ports.grpc), "--metrics-port", "none", "--watch-current"]
    if ports.http is not None:
        flags += ["--http-port", str(ports.http)]
    if index > 0:
        flags += ["--probe-interval-s", "0"]  # worker 0 runs the probe rounds for the server
    return [sys.executable, "-m", "serving", *argv, *flags]


def follow_supervisor() -> None:
    """In a worker: be sent SIGTERM when the supervisor dies, however it dies (kill -9 too),
    rather than serve on alone with no one to stop it."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop still ends it
        return
    if os.getppid() == 1:  # it died before the prctl took
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Starts the workers, tells the operator where they listen, and stops them together."""

    def __init__(self, config: ServerConfig, argv: list[str]) -> None:
        self.config = config
        self.argv = argv
        self.count = config.runtime.server_processes
        self.workers: list[subprocess.Popen] = []
        self.stop_asked: float | None = None  # when the stop began (monotonic)

    def _stop(self, signum: int, _frame: object = None) -> None:
        if self.stop_asked is None:
            log.info("signal %d: stopping %d workers", signum, len(self.workers))
            self.stop_asked = time.monotonic()
        for worker in self.workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Serve until a signal (exit 0) or a worker's death (exit 1, or the failed worker's
        own status while starting: its error line said why)."""
        self.config.check_inputs()  # once, here: a bad root is one error line, not N
        ports = hold_ports(self.config)
        metrics_dir = tempfile.mkdtemp(prefix="simsearch-metrics-")
        workers_dir = tempfile.mkdtemp(prefix="simsearch-workers-")  # their sockets: serving.listen.worker_socket
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if ports.metrics is not None:
                serve_multiprocess(metrics_dir, ports.metrics, self.config.transport.host)
            env = {**os.environ, MULTIPROC_ENV: metrics_dir, WORKERS_DIR_ENV: workers_dir}
            for index in range(self.count):
                self.workers.append(
                    subprocess.Popen(
                        worker_command(self.argv, index, ports),
                        env={**env, WORKER_ENV: f"{index}/{self.count}"},
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            started = self._wait_listening()
            if started is not None:
                return started
            log.info(
                "serving with %d worker processes on port %d (pids %s)",
                self.count,
                ports.grpc,
                " ".join(str(w.pid) for w in self.workers),
            )
            ready = {"port": ports.grpc, "metrics_port": ports.metrics, "http_port": ports.http}
            print(json.dumps({**ready, "pids": [w.pid for w in self.workers]}), flush=True)
            return self._watch()
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(workers_dir, ignore_errors=True)
            release_port(ports.grpc)
            if ports.http is not None:
                release_port(ports.http)

    def _wait_listening(self) -> int | None:
        """Wait for every worker's line saying it listens; a worker's status if one ended first."""
        for index, worker in enumerate(self.workers):
            line = worker.stdout.readline()  # the worker's JSON line, once it listens
            if not line:
                code = worker.wait()
                if self.stop_asked is None:
                    log.error("worker %d (pid %d) exited with status %s while starting", index, worker.pid, code)
                    self._stop(signal.SIGTERM)
                    return code or 1
                return 0
        return None

    def _watch(self) -> int:
        """Until every worker is gone: a stop asked for is 0, a worker that died on its own 1."""
        failed = False
        while any(w.poll() is None for w in self.workers):
            if self.stop_asked is None:
                for index, worker in enumerate(self.workers):
                    if worker.poll() is not None:
                        log.error(
                            "worker %d (pid %d) exited with status %s: stopping the server (workers are not restarted)",
                            index,
                            worker.pid,
                            worker.returncode,
                        )
                        failed = True
                        self._stop(signal.SIGTERM)
                        break
            elif time.monotonic() - self.stop_asked > KILL_AFTER_S:
                self._stop_all()
            time.sleep(POLL_S)
        if self.stop_asked is None:  # all gone at once, between two looks
            failed = True
            log.error("every worker exited: stopping the server")
        return 1 if failed else 0

    def _stop_all(self) -> None:
        """Kill what is still running (past the deadline, or the supervisor leaving on an error)."""
        for worker in self.workers:
            if worker.poll() is None:
                if self.stop_asked is None or time.monotonic() - self.stop_asked > KILL_AFTER_S:
                    worker.kill()
                    continue
        for worker in self.workers:
            try:
                worker.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def supervise(config: ServerConfig, argv: list[str]) -> int:
    """`serve` with `config.runtime.processes` > 1: the supervisor's exit status."""
    return Supervisor(config, argv).run()
