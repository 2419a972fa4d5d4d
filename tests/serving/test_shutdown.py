"""SIGTERM during a probe round (issue 63): a real `python -m serving serve` stops as asked — no
ERROR line for the round it cut short (shutting down is not an error) — and is gone within its
documented deadline even with work still running that the interpreter's exit would wait for."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from serving.server import SHUTDOWN_DEADLINE_S
from tests.support.index import write_catalog_index
from tests.support.server import wait_for

ROOT = Path(__file__).resolve().parents[2]

# The real command, with two hooks: its batcher paused from the start, so the first probe round's
# queries are queued (mid-round) whenever the signal comes, however fast the machine; and a load
# in the loop's executor that would hold the process ten minutes, as a stuck load or ingest would.
SERVE_MID_ROUND = """
import asyncio, sys, time
from serving import __main__ as cli
from serving.server import SearchApp

start = SearchApp.start

async def start_paused(self):
    self.batcher.pause()
    await start(self)
    asyncio.get_running_loop().run_in_executor(None, time.sleep, 600)

SearchApp.start = start_paused
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(code: str, flags: list[str]) -> subprocess.Popen:
    """`code` (the real command with its hooks) run with `flags`, its log on a pipe."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def queued(metrics_port: int) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    except OSError:
        return 0.0  # not listening yet
    depths = [float(line.split()[1]) for line in text.splitlines() if line.startswith("simsearch_queue_depth ")]
    return depths[0] if depths else 0.0


def test_sigterm_during_a_probe_round_logs_no_error_and_exits_within_the_deadline(tmp_path):
    root = write_catalog_index(tmp_path, items=12)
    metrics_port = free_port()
    flags = ["--index-root", str(root), "--port", "0", "--metrics-port", str(metrics_port)]
    flags += ["--probe-interval-s", "3600", "--probe-size", "200", "--log-format", "text"]
    flags += ["--processes", "1"]  # the hooks patch this process: a worker process would not carry them
    proc = serving(SERVE_MID_ROUND, flags)
    try:
        wait_for(lambda: queued(metrics_port) > 0, timeout=120)  # the round's queries wait in the batcher
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=SHUTDOWN_DEADLINE_S + 30)
        took = time.monotonic() - signalled
        logs = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, logs
    assert took <= SHUTDOWN_DEADLINE_S + 5, (took, logs)  # the interpreter's start-up excluded, its exit not
    assert "ERROR" not in logs and "Traceback" not in logs, logs
    assert "probe round ended unfinished" in logs


# The real command, its start held (a model's load taking its time) until it has been signalled.
SERVE_SLOW_START = """
import sys, time
from serving import __main__ as cli
from serving.server import SearchApp

start = SearchApp.start

async def slow_start(self):
    print("starting", file=sys.stderr, flush=True)
    time.sleep(2)  # the signal comes meanwhile
    await start(self)

SearchApp.start = slow_start
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


def test_sigterm_while_the_server_starts_drains_it_instead_of_killing_it(tmp_path):
    """A supervisor stopping its workers, or a rollout, may signal a server still loading: it
    drains (one line, exit 0) rather than dying of the signal's default action mid-start."""
    root = write_catalog_index(tmp_path, items=12)
    flags = ["--index-root", str(root), "--port", "0", "--metrics-port", "none", "--log-format", "text"]
    proc = serving(SERVE_SLOW_START, [*flags, "--processes", "1"])
    try:
        assert proc.stderr.readline().strip() == "starting"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=SHUTDOWN_DEADLINE_S + 30)
        logs = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, logs  # not -15: the handler was in place before the start
    assert "signal 15: draining and stopping" in logs and "Traceback" not in logs, logs
