"""`serve --processes 2` (issue 62, every core): a real `python -m serving serve` whose two worker
processes answer on one gRPC port and one HTTP port, counted on one /metrics; a second server on
that port is refused with one line; a version one worker publishes (an ingest) is loaded by both;
SIGTERM stops every worker cleanly; a worker that dies stops the server, with one line and a
non-zero exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.__main__ import server_config
from serving.client import SearchClient
from serving.config import available_cpus
from serving.listen import port_lock_path
from serving.telemetry.metrics import RECALL, SAMPLES
from tests.serving.test_prometheus import needs_prometheus, query, start_prometheus
from tests.serving.test_shutdown import free_port
from tests.support.index import write_catalog_index
from tests.support.server import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "workers-admin"


class Served:
    """A `serve --processes 2` subprocess: its ports line, its workers' pids, its stderr."""

    def __init__(self, root: Path, *flags: str) -> None:
        self.metrics_port = free_port()
        command = [sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", "0"]
        command += ["--metrics-port", str(self.metrics_port), "--processes", "2", "--probe-interval-s", "0"]
        command += ["--log-format", "text", "--admin-token", TOKEN, *flags]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(self.proc.stderr.read()[-3000:])
        self.ports = json.loads(line)
        self.port, self.pids = self.ports["port"], self.ports["pids"]

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=60).read().decode()

    def figure(self, name: str) -> dict[str, float]:
        """Every series of `name` on /metrics: its labels' text → value."""
        pattern = re.compile(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$")
        return {m.group(1) or "": float(m.group(2)) for m in map(pattern.match, self.metrics().splitlines()) if m}

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return code, self.proc.stderr.read()


def fresh_channel(port: int) -> grpc.Channel:
    """A channel on a connection of its own (gRPC shares one between channels by default): the
    kernel spreads connections, not calls, over the workers."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def unit(seed: int, dim: int = 16) -> list[float]:
    vector = np.random.default_rng(seed).standard_normal(dim)
    return (vector / np.linalg.norm(vector)).tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("workers"), items=12)
    server = Served(root, "--http-port", "0", "--watch-interval-s", "0.5")
    yield server, root
    server.stop()


def test_both_workers_answer_on_one_port_and_metrics_sum_them(served):
    server, _ = served
    before = sum(server.figure("simsearch_requests_total").values())
    calls = 0
    for _ in range(60):  # connections land on either worker; 60 all on one would be a 2^-59 chance
        with fresh_channel(server.port) as channel:
            pb_grpc.SimilaritySearchStub(channel).Search(
                pb.SearchRequest(embedding=pb.Embedding(values=unit(calls)), k=3), timeout=60
            )
            calls += 1
        per_worker = server.figure("simsearch_worker_calls_total")
        if len(per_worker) == 2 and all(per_worker.values()):
            break
    assert set(per_worker) == {'{worker="0"}', '{worker="1"}'} and all(per_worker.values()), per_worker
    # one /metrics for the whole server: the counters of both workers, summed
    assert sum(server.figure("simsearch_requests_total").values()) - before == calls
    assert server.figure("simsearch_reloads_total") == {"": 2.0}  # each worker loaded the version once
    # the HTTP port is shared as the gRPC port is: it answers, whichever worker takes it
    http = urllib.request.urlopen(f"http://127.0.0.1:{server.ports['http_port']}/openapi.json", timeout=60)
    assert http.status == 200


def test_recall_at_k_on_metrics_is_the_whole_servers_over_every_workers_answers(served):
    server, _ = served

    def traffic() -> tuple[float, float]:
        figures = {name: server.figure(name).get('{k="1",source="traffic"}') for name in (RECALL, SAMPLES)}
        return figures[RECALL] or 0.0, figures[SAMPLES] or 0.0

    before_recall, before_n = traffic()
    before_calls = server.figure("simsearch_worker_calls_total")
    sent = 0
    while True:  # labelled queries, each on a connection of its own, until both workers answered some
        with fresh_channel(server.port) as channel:
            label = f"item{sent % 12}"
            pb_grpc.SimilaritySearchStub(channel).Search(
                pb.SearchRequest(embedding=pb.Embedding(values=unit(500 + sent)), k=3, label=label), timeout=60
            )
        sent += 1
        calls = server.figure("simsearch_worker_calls_total")
        if sent >= 8 and all(calls[w] > before_calls.get(w, 0.0) for w in calls) and len(calls) == 2:
            break
        assert sent < 200, calls
    recall, n = traffic()
    assert n == before_n + sent  # every worker's answers, not the last writer's alone
    assert 0.0 <= recall <= 1.0
    # GetInfo, whichever worker answers it, is the whole server's too (serving.api.siblings).
    for _ in range(6):
        with fresh_channel(server.port) as channel:
            info = pb_grpc.SimilaritySearchStub(channel).GetInfo(pb.GetInfoRequest(), timeout=60)
        (figure,) = [f for f in info.recall_at_k if f.source == "traffic" and f.k == 1]
        assert figure.samples == n and figure.value == pytest.approx(recall, abs=1e-9)


def test_the_consoles_last_hour_from_either_worker_counts_every_workers_calls(served):
    """The Health page's history (GET /v1/health/history), whichever worker answers it: the
    calls of both workers in each interval (serving.telemetry.history, shared through the
    workers' folder), not the answering worker's alone."""
    server, _ = served
    interval = 10.0  # TrafficHistory's
    time.sleep(interval - time.time() % interval + 0.1)  # just into a fresh interval
    start = time.time() - 0.1
    before = server.figure("simsearch_worker_calls_total")
    sent = 0
    while sent < 40 or not all(server.figure("simsearch_worker_calls_total")[w] > before.get(w, 0) for w in before):
        with fresh_channel(server.port) as channel:
            pb_grpc.SimilaritySearchStub(channel).Search(
                pb.SearchRequest(embedding=pb.Embedding(values=unit(900 + sent)), k=3), timeout=60
            )
        sent += 1
        assert sent < 400
    end = time.time()
    time.sleep(interval - end % interval + 0.15 * interval)  # the last interval ended and is written
    url = f"http://127.0.0.1:{server.ports['http_port']}/v1/health/history"
    for _ in range(6):  # new connections: either worker answers
        history = json.loads(urllib.request.urlopen(url, timeout=60).read())
        counted = sum(p["qps"] * history["intervalS"] for p in history["points"] if start < p["t"] <= end + interval)
        assert round(counted) == sent, (sent, history["points"][-4:])


def test_a_programs_clients_are_connections_of_their_own_spread_over_the_workers(served):
    server, _ = served
    before = server.figure("simsearch_worker_calls_total")
    clients = [SearchClient(f"127.0.0.1:{server.port}", timeout=60) for _ in range(16)]
    try:  # all open at once: 16 connections, each placed by the kernel on either worker
        for n, client in enumerate(clients):
            client.search(pb.SearchRequest(embedding=pb.Embedding(values=unit(n)), k=3))
    finally:
        for client in clients:
            client.close()
    after = server.figure("simsearch_worker_calls_total")
    gained = {worker: after[worker] - before.get(worker, 0.0) for worker in after}
    assert len(gained) == 2 and all(gained.values()), gained  # one shared connection would reach one worker


@needs_prometheus
def test_a_real_prometheus_scrapes_one_target_for_both_workers(served, tmp_path):
    server, _ = served
    for seed in range(20):  # on connections of their own: both workers answer some
        with fresh_channel(server.port) as channel:
            pb_grpc.SimilaritySearchStub(channel).Search(pb.SearchRequest(embedding=pb.Embedding(values=unit(seed))))
    wait_for(lambda: len(server.figure("simsearch_worker_calls_total")) == 2)
    prom_port = free_port()
    prometheus = start_prometheus(tmp_path, prom_port, server.metrics_port)
    try:

        def answered(expr: str) -> float | None:
            result = query(prom_port, expr)["data"]["result"]
            return float(result[0]["value"][1]) if result else None

        # one target, whose calls of either worker sum to the server's own count of its calls
        assert wait_for(lambda: answered("count(simsearch_worker_calls_total > 0)")) == 2
        assert answered("sum(simsearch_worker_calls_total)") == answered("sum(simsearch_requests_total)")
        assert answered('count(up{job="target"} == 1)') == 1
        assert answered("simsearch_index_loaded") == 1
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=60)


def test_a_second_server_on_the_workers_port_is_refused_with_one_line(served):
    server, root = served
    for processes in ("2", "1"):
        proc = subprocess.run(
            [sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", str(server.port),
             "--metrics-port", "none", "--processes", processes],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: gRPC port 127.0.0.1:{server.port} is already in use")
    assert port_lock_path(server.port).exists()
    with fresh_channel(server.port) as channel:  # the first server still answers
        pb_grpc.SimilaritySearchStub(channel).Search(pb.SearchRequest(embedding=pb.Embedding(values=unit(1))))


def versions_answering(port: int, connections: int = 8) -> set[str]:
    """The versions answering over `connections` fresh connections, whichever worker each reaches."""
    versions = set()
    for _ in range(connections):
        with fresh_channel(port) as channel:
            versions.add(pb_grpc.SimilaritySearchStub(channel).GetInfo(pb.GetInfoRequest(), timeout=60).index_version)
    return versions


def test_an_ingest_on_one_worker_is_live_on_every_worker_when_it_answers(served):
    server, root = served
    with SearchClient(f"127.0.0.1:{server.port}", timeout=60, admin_token=TOKEN) as client:
        new = pb.NewItem(id="added-by-one", embedding=pb.Embedding(values=unit(99)), metadata={"item": "added"})
        reply = client.add_items([new])
    # At once, not within --watch-interval-s: the worker that published it relayed the reload to
    # its sibling before answering (serving.api.siblings), so the next call finds the items
    # whichever worker it reaches.
    assert versions_answering(server.port) == {reply.index_version}
    for _ in range(8):
        with fresh_channel(server.port) as channel:
            answer = pb_grpc.SimilaritySearchStub(channel).Search(
                pb.SearchRequest(embedding=pb.Embedding(values=unit(99)), k=1), timeout=60
            )
        assert answer.neighbors[0].id == "added-by-one"
    # The sibling's relayed reload and its CURRENT watcher's find each other's work done: two
    # starts and two loads of the new version, counted a moment after each swap.
    wait_for(lambda: server.figure("simsearch_reloads_total")[""] >= 4)


def test_a_reload_of_a_named_version_reaches_every_worker_before_it_answers(served):
    server, root = served
    current = artifacts.current_version(root)
    first = next(version for version in artifacts.list_versions(root) if version != current)
    # Every worker's CURRENT watcher (--watch-interval-s 0.5) has read CURRENT since the last
    # publish: a watcher that had not would load CURRENT after the named Reload (make test, loaded).
    wait_for(lambda: versions_answering(server.port) == {current})
    time.sleep(2.0)
    with SearchClient(f"127.0.0.1:{server.port}", timeout=120, admin_token=TOKEN) as client:
        # A named version is served without CURRENT moving: no watcher would bring a worker to it.
        named = client.reload(first)
        assert artifacts.current_version(root) == current
        assert versions_answering(server.port) == {named.index_version}
        back = client.reload()  # CURRENT's again, on every worker
    assert back.index_version == current and versions_answering(server.port) == {current}


def test_sigterm_stops_every_worker_cleanly_and_removes_the_metrics_files(tmp_path):
    server = Served(write_catalog_index(tmp_path, items=12))
    environ = Path(f"/proc/{server.pids[0]}/environ").read_bytes().split(b"\0")
    metrics_dir = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    assert Path(metrics_dir).is_dir()
    started = time.monotonic()
    code, logs = server.stop()
    assert code == 0, logs
    assert time.monotonic() - started < 30
    assert not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in server.pids)
    assert " ERROR " not in logs and "Traceback" not in logs, logs
    drained = [line for line in logs.splitlines() if "draining and stopping" in line]
    assert sorted(line.rsplit("worker=", 1)[-1] for line in drained) == ["0", "1"], logs  # each worker drained
    # Each worker searches on its share of the CPUs (serving.search.executors.SearchThreads).
    threads = max(1, (available_cpus() - 2) // 2)
    said = [line for line in logs.splitlines() if "faiss searches on" in line]
    assert len(said) == 2 and all(f"on {threads} thread" in line for line in said), logs
    assert not Path(metrics_dir).exists()
    assert not port_lock_path(server.port).exists()  # the port's lock file goes with the server


def test_a_worker_that_dies_stops_the_server_with_one_line(tmp_path):
    server = Served(write_catalog_index(tmp_path, items=12))
    os.kill(server.pids[1], signal.SIGKILL)
    code, logs = _wait(server)
    assert code == 1, logs
    errors = [line for line in logs.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"worker 1 (pid {server.pids[1]}) exited with status -9" in errors[0], logs
    assert not _alive(server.pids[0])  # the other worker was stopped, not left serving alone


def test_processes_is_a_serve_option_in_flags_and_config_files(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("runtime:\n  processes: 3\n")
    assert server_config(["--config", str(config)]).runtime.processes == 3
    assert server_config(["--config", str(config), "--processes", "1"]).runtime.server_processes == 1
    assert server_config([]).runtime.server_processes == available_cpus() <= len(os.sched_getaffinity(0))


def _wait(server: Served) -> tuple[int, str]:
    code = server.proc.wait(timeout=60)
    return code, server.proc.stderr.read()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
