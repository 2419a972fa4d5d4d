"""Serving benchmark: queries/s and p50/p99 at concurrency 1/8/32/64 for both server modes —
dynamic batching on (`on`) and off (`off`: each query alone on one of `--workers` inference
threads, on every ONNX Runtime thread when it is the only one in flight and single-threaded
beside others) — against two baselines measured in the same run:

- the in-process ceiling: the same ONNX Runtime session and faiss index called directly, at
  batch 1/8/32/64 and at the mean batch size the server actually formed, each batch in one ORT
  run and split into runs as the server splits them (`--run-rows`), measured again in
  every round right after its servers; each ratio is one round's server figure over the same
  round's ceiling, and the median of those ratios is reported. Each mode is also compared with
  the same work done directly (batches of the size it formed; or single queries, one at a time
  at concurrency 1 and otherwise by as many threads at once, each on the session the server
  gives a query beside others) and with the best of all these ceilings. The ceiling's pair is
  loaded as the server loads it, from the server's own parsed flags (`--server-flag` included);
- the gRPC floor: a bare grpc.aio server answering with a canned response (no decode, model or
  index) under the same load — what Python gRPC alone allows on this machine.

The server runs as `python -m serving serve` in its own process. Load comes from h2load (C,
nghttp2's HTTP/2 benchmark, ~35 µs of CPU a query) sending one gRPC-framed SearchRequest, so the
load generator takes little of the cores it shares with the server; `--loadgen python` uses
benchmarks/loadgen.py (grpc.aio, a different image per query, ~0.3 ms of CPU a query) instead.
Errors are read from the server's own `simsearch_requests_total` (h2load sees HTTP, not gRPC
status). Each figure is the median of `--repeats` rounds, the modes interleaved, because the
figures of a shared virtual machine drift by 2× from minute to minute; server CPU ms/query (from
/proc) is reported beside them as the steadier measure of cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from core import artifacts
from core.catalog import read_catalog
from core.preprocess import load_image
from protos.simsearch.v1 import search_pb2 as pb
from serving.__main__ import server_config
from serving.server import ServerConfig

ROOT = Path(__file__).resolve().parents[1]

LEVELS = [1, 8, 32, 64]
# Server modes and their `serve` flags.
MODES = {"on": ("--batching",), "off": ("--no-batching",)}
Load = Callable[[int, int, float], dict]  # (port, concurrency, seconds) → one closed-loop run's figures
SEARCH_PATH = "/simsearch.v1.SimilaritySearch/Search"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_artifacts(run: Path, quick: bool) -> None:
    if (run / "model" / "manifest.json").is_file() and artifacts.current_version(run / "index"):
        return
    slice_args = ["--max-classes", "40", "--max-per-class", "40", "--epochs", "2", "--classes-per-batch", "10"]
    subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--out", str(run), *(slice_args if quick else [])],
        check=True,
        cwd=ROOT,
    )


def ensure_backbone_artifacts(run: Path, backbone: str, pretrained: str | None, image_size: int) -> None:
    """A production-size model for the same benchmark: `backbone` at `image_size`, briefly
    fine-tuned on the glyph slice (its quality is beside the point here), exported and indexed."""
    if (run / "model" / "manifest.json").is_file() and artifacts.current_version(run / "index"):
        return
    train = ["--backbone", backbone, "--image-size", str(image_size), "--embedding-dim", "128"]
    train += ["--pretrained", pretrained] if pretrained else []
    train += ["--max-classes", "40", "--max-per-class", "20", "--classes-per-batch", "8", "--samples-per-class", "4"]
    train += ["--epochs", "1", "--batches-per-epoch", "2", "--no-plots", "--out", str(run / "train")]
    for args in (
        ["-m", "training", "train", *train],
        ["-m", "training", "export", "--run", str(run / "train"), "--out", str(run / "model"), "--parity-images", "16"],
        ["-m", "index", "build", "--model", str(run / "model"), "--index-root", str(run / "index")],
    ):
        subprocess.run([sys.executable, *args], check=True, cwd=ROOT)


# -- the in-process ceiling ------------------------------------------------------------------


class Ceiling:
    """Queries/s of embed+search called directly, per batch size (median of `repeats` calls).

    Measured afresh in every round, right after that round's servers, so each ratio compares
    figures taken minutes apart at most: this machine's speed drifts more than that between
    the start and the end of a run."""

    def __init__(self, batched: ServerConfig, unbatched: ServerConfig, catalog: Path, repeats: int) -> None:
        # Loaded as each server mode loads its pair, from the same configuration: with the
        # session for runs beside others (a share of the threads each) where that mode has one.
        self.embedder, self.index = self._load(batched)
        self.streams = batched.batching.batch_streams
        # The modes differ in --batching only: the same runs at once make the same sessions.
        same = unbatched.runs_at_once == batched.runs_at_once
        self.unbatched_embedder = self.embedder if same else self._load(unbatched)[0]
        self.blobs = [p.read_bytes() for p in read_catalog(catalog).paths[:512]]
        self.arrays = np.stack([load_image(b, self.embedder.contract) for b in self.blobs])
        self.repeats = repeats

    @staticmethod
    def _load(config: ServerConfig) -> tuple:
        pair = config.load()
        return pair.embedder, pair.index

    def measure(self, batches: set[int]) -> dict[int, dict]:
        return {b: self._measure(b) for b in sorted(batches)}

    def measure_concurrent(self, callers: int, seconds: float = 1.5) -> dict:
        """Single queries (embed + search) run by `callers` threads at once on one model and
        index, each on the session the unbatched server gives a query run beside others."""
        return self._side_by_side(self.unbatched_embedder, callers, 1, seconds)

    def measure_streams(self, batch: int, seconds: float = 1.5) -> dict:
        """Batches of `batch` run by as many threads at once as the batching server has streams,
        each on the session it gives a batch run beside another."""
        return self._side_by_side(self.embedder, self.streams, batch, seconds)

    def _side_by_side(self, embedder, threads: int, batch: int, seconds: float) -> dict:
        done = [0] * threads
        stop = time.perf_counter() + seconds

        def call(i: int) -> None:
            queries = np.take(self.arrays, range(i * batch, (i + 1) * batch), axis=0, mode="wrap")
            while time.perf_counter() < stop:
                self.index.search(embedder.embed(queries, side_by_side=threads > 1), 10)
                done[i] += len(queries)

        workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
        t, cpu = time.perf_counter(), time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        return {
            "threads": threads,
            "batch": batch,
            "qps": sum(done) / elapsed,
            "cpu_ms_per_query": cpu * 1e3 / max(sum(done), 1),
        }

    def _measure(self, b: int) -> dict:
        """Embed+search of a batch of `b`: in one ORT run (`qps`: the ceiling the issue names) and
        split into runs as the server's loader measured fastest (`qps_as_served`)."""
        batch = self.arrays[:b]
        served_rows = self.embedder.run_rows
        # A batch no larger than the server's run size is one run either way: timed once.
        split = served_rows if served_rows and served_rows < b else None

        def timed(run_rows: int | None) -> tuple[float, float]:
            self.embedder.run_rows = run_rows
            t, cpu = time.perf_counter(), time.process_time()  # process CPU: ORT's threads too
            self.index.search(self.embedder.embed(batch), 10)
            return time.perf_counter() - t, time.process_time() - cpu

        times, served_times, decode_times, cpu_times = [], [], [], []
        try:
            for _ in range(3):
                timed(None)
                if split:
                    timed(split)
            for _ in range(self.repeats):
                elapsed, cpu = timed(None)
                times.append(elapsed)
                cpu_times.append(cpu)
                served_times.append(timed(split)[0] if split else elapsed)
                t = time.perf_counter()
                for blob in self.blobs[:b]:
                    load_image(blob, self.embedder.contract)
                decode_times.append(time.perf_counter() - t)
        finally:
            self.embedder.run_rows = served_rows
        med, dec = statistics.median(times), statistics.median(decode_times)
        return {
            "batch": b,
            "qps": b / med,
            "qps_with_decode": b / (med + dec),
            "qps_as_served": b / statistics.median(served_times),
            "latency_ms": med * 1e3,
            "latency_with_decode_ms": (med + dec) * 1e3,
            "cpu_ms_per_query": statistics.median(cpu_times) * 1e3 / b,
        }


# -- load generators ---------------------------------------------------------------------------


def grpc_body(image: bytes, k: int = 10) -> bytes:
    """One gRPC length-prefixed message: what h2load sends as the request body."""
    message = pb.SearchRequest(image=image, k=k).SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message


def h2load(port: int, body: Path, concurrency: int, seconds: float, log: Path) -> dict:
    """Closed loop: `concurrency` streams on one connection (as one gRPC channel), for `seconds`."""
    duration = f"{max(1, round(seconds))}"  # h2load takes whole seconds (or a unit: 500ms)
    log.unlink(missing_ok=True)  # h2load appends to its log: rows of an earlier run would count
    command = ["h2load", "-c", "1", "-m", str(concurrency), "-t", "1", "-D", duration]
    command += ["-d", str(body), "--log-file", str(log)]
    command += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
    out = subprocess.run(
        [*command, f"http://127.0.0.1:{port}{SEARCH_PATH}"], capture_output=True, text=True, check=True
    ).stdout
    done = int(re.search(r"(\d+) succeeded", out).group(1))
    rows = np.loadtxt(log, ndmin=2, dtype=np.float64)  # start µs since epoch, HTTP status, duration µs
    lat_ms = rows[:, 2] / 1e3
    return {
        "concurrency": concurrency,
        "queries": int(len(rows)),
        "qps": float(re.search(r"([\d.]+) req/s", out).group(1)),
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
        "http_ok": done,
    }


def h2load_sending(image: bytes, workdir: Path) -> Load:
    """The h2load `Load` whose every query is a SearchRequest for `image` (body and logs in `workdir`)."""
    body = workdir / "search.grpc"
    body.write_bytes(grpc_body(image))

    def load(port: int, concurrency: int, seconds: float) -> dict:
        return h2load(port, body, concurrency, seconds, workdir / f"h2load-{port}-{concurrency}.log")

    return load


def formed_batch(level: dict) -> int:
    """The batch size a server formed at one concurrency level (its mean, rounded)."""
    return max(1, round(level["mean_batch"]))


def python_loadgen(
    port: int, catalog: Path, concurrency: int, seconds: float, protocol: str = "grpc", query: str = "image"
) -> dict:
    """One closed-loop run of `benchmarks/loadgen.py` in its own process: its JSON figures."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen", "--target", f"127.0.0.1:{port}", "--protocol", protocol]
        + ["--query", query, "--catalog", str(catalog), "--concurrency", str(concurrency), "--seconds", str(seconds)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- a server under load -----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's non-OK answers (CANCELLED aside: the load generator hangs up at the end) and
    its batch-size totals."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {"errors": 0.0, "batch_sum": 0.0, "batch_count": 0.0}
    for line in text.splitlines():
        if line.startswith("simsearch_requests_total{") and 'code="OK"' not in line and "CANCELLED" not in line:
            out["errors"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("simsearch_batch_size_sum "):
            out["batch_sum"] = float(line.split()[1])
        elif line.startswith("simsearch_batch_size_count "):
            out["batch_count"] = float(line.split()[1])
    return out


def start(command: list[str], ready: Callable[[], bool]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[2]} exited with {proc.returncode} before it was ready")
        if ready():
            return proc
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{command} not ready within 180 s")


def healthy(metrics_port: int) -> bool:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
    except OSError:
        return False
    return "simsearch_index_loaded 1.0" in text


def measure(
    proc: subprocess.Popen, port: int, load: Load, levels: list[int], seconds: float, metrics_port: int | None
) -> list[dict]:
    results = []
    for c in levels:
        load(port, c, 1.0)  # warm-up, not counted: connections, pools and caches at this level
        before = scrape(metrics_port) if metrics_port else None
        cpu0 = cpu_seconds(proc.pid)
        result = load(port, c, seconds)
        cpu = cpu_seconds(proc.pid) - cpu0
        result["server_cpu_ms_per_query"] = 1e3 * cpu / max(result["queries"], 1)
        if before is not None:
            after = scrape(metrics_port)
            result["errors"] = int(after["errors"] - before["errors"])
            batches = after["batch_count"] - before["batch_count"]
            result["mean_batch"] = (after["batch_sum"] - before["batch_sum"]) / batches if batches else 0.0
        results.append(result)
    return results


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def serve_flags(run: Path, mode: str | None, server_flags: tuple[str, ...]) -> list[str]:
    """The `serve` flags of the benchmark's server in `mode` (None: as `server_flags` say), bar its ports."""
    flags = ["--index-root", str(run / "index"), "--max-batch-size", "32", "--probe-interval-s", "3600"]
    flags += ["--probe-size", "1", "--ann-sample-rate", "0", "--log-format", "text"]
    return [*flags, *server_flags, *(MODES[mode] if mode else ())]


def serve_and_load(
    run: Path,
    mode: str | None,
    load: Load,
    seconds: float,
    server_flags: tuple[str, ...],
    levels: list[int] = LEVELS,
) -> list[dict]:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "serving", "serve", "--port", str(port), "--metrics-port", str(metrics_port)]
    proc = start([*command, *serve_flags(run, mode, server_flags)], lambda: healthy(metrics_port))
    try:
        return measure(proc, port, load, levels, seconds, metrics_port)
    finally:
        stop(proc)


def floor_and_load(load: Load, levels: list[int], seconds: float) -> list[dict]:
    port = free_port()
    proc = start(
        [sys.executable, "-m", "benchmarks.grpc_floor", "--port", str(port)],
        lambda: _accepts(port),
    )
    try:
        return measure(proc, port, load, levels, seconds, None)
    finally:
        stop(proc)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def median_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per concurrency level, the median of every numeric figure across rounds."""
    out = []
    for per_level in zip(*rounds, strict=True):
        merged = {"concurrency": per_level[0]["concurrency"], "rounds": len(per_level)}
        for key in per_level[0]:
            if key != "concurrency" and isinstance(per_level[0][key], (int, float)):
                merged[key] = statistics.median(r[key] for r in per_level)
        merged["qps_rounds"] = [round(r["qps"]) for r in per_level]
        out.append(merged)
    return out


def paired_ratios(rounds: dict[str, list[list[dict]]], ceiling_rounds: list[dict]) -> dict:
    """Per mode and concurrency, each round's server figures over the ceilings of the same round:
    against batch 32 in one ORT run; against the same work the server did (batching on: batches
    of the size it formed, split into runs as the server splits them, the better of one at a
    time on every thread and its streams' worth at once; off:
    single queries, one at a time at concurrency 1, else run by as many threads at once, each on
    the session the server gives a query beside others); against the best of them all; and the
    p50 the server adds to the ceiling's batch-1 latency with decoding."""
    out: dict[str, dict[int, dict[str, list[float]]]] = {}
    for mode in MODES:
        per_level: dict[int, dict[str, list[float]]] = {}
        for server_round, ceiling_round in zip(rounds[mode], ceiling_rounds, strict=True):
            batches, streams = ceiling_round["batches"], ceiling_round.get("streams", {})
            served = {b: {**c, "qps": c.get("qps_as_served", c["qps"])} for b, c in batches.items()}
            ceilings = [batches[32], served[32], ceiling_round["concurrent"], *streams.values()]
            best = max(c["qps"] for c in ceilings)
            for r in server_round:
                if mode == "on":
                    formed = formed_batch(r)
                    same = max((served[formed], streams.get(formed, served[formed])), key=lambda c: c["qps"])
                else:
                    same = batches[1] if r["concurrency"] == 1 else ceiling_round["concurrent"]
                figures = {
                    "vs_b32": r["qps"] / batches[32]["qps"],
                    "vs_b32_with_decode": r["qps"] / batches[32]["qps_with_decode"],
                    "vs_same_batch": r["qps"] / same["qps"],
                    "vs_best": r["qps"] / best,
                    "added_p50_ms": r["p50_ms"] - batches[1]["latency_with_decode_ms"],
                }
                level = per_level.setdefault(r["concurrency"], {key: [] for key in figures})
                for key, value in figures.items():
                    level[key].append(value)
        out[mode] = per_level
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--run", default="runs/demo", help="directory with model/ and index/ (built by the demo if missing)"
    )
    parser.add_argument("--quick", action="store_true", help="one short round; a glyph slice if artifacts are built")
    parser.add_argument("--seconds", type=float, help="load duration per concurrency level (default 5, quick 2)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds per mode; medians reported (default 3)")
    parser.add_argument("--loadgen", choices=["h2load", "python"], default="h2load", help="load generator")
    parser.add_argument(
        "--backbone", help="benchmark a production-size model instead of the demo's (e.g. mobilenet_v2)"
    )
    parser.add_argument("--pretrained", help="its weights (local file or pkg:<package>/<file>)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--server-flag", action="append", default=[], help="extra `serve` flag (repeatable)")
    args = parser.parse_args()
    if args.loadgen == "h2load" and shutil.which("h2load") is None:
        parser.error("h2load not found: install Debian's nghttp2-client (setup.sh does), or use --loadgen python")
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    if repeats < 1 or seconds <= 0:
        parser.error("--repeats must be ≥ 1 and --seconds > 0")
    if args.backbone and args.run == "runs/demo":
        args.run = f"runs/bench-{args.backbone}-{args.image_size}"
    run = (ROOT / args.run).resolve() if not Path(args.run).is_absolute() else Path(args.run)
    if args.backbone:
        ensure_backbone_artifacts(run, args.backbone, args.pretrained, args.image_size)
    else:
        ensure_artifacts(run, args.quick)
    catalog = run / "train" / "splits" / "test.csv"
    server_flags = tuple(f for flag in args.server_flag for f in flag.split())

    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    h2load_load = h2load_sending(read_catalog(catalog).paths[0].read_bytes(), workdir)

    def load(port: int, c: int, duration: float) -> dict:
        if args.loadgen == "python":
            return python_loadgen(port, catalog, c, duration)
        return h2load_load(port, c, duration)

    batched = server_config(serve_flags(run, "on", server_flags))
    unbatched = server_config(serve_flags(run, "off", server_flags))
    ceiling = Ceiling(batched, unbatched, catalog, repeats=5 if args.quick or args.backbone else 30)
    rounds: dict[str, list[list[dict]]] = {mode: [] for mode in [*MODES, "floor"]}
    # {"batches": {b: figures}, "concurrent": figures, "streams": {b: figures}}
    ceiling_rounds: list[dict] = []
    callers = unbatched.runtime.worker_threads
    for i in range(repeats):
        print(f"round {i + 1}/{repeats}", file=sys.stderr, flush=True)
        for mode in MODES:
            rounds[mode].append(serve_and_load(run, mode, load, seconds, server_flags))
        rounds["floor"].append(floor_and_load(load, LEVELS, seconds))
        formed = {formed_batch(r) for r in rounds["on"][-1]}
        ceiling_rounds.append(
            {
                "batches": ceiling.measure(set(LEVELS) | formed),
                "concurrent": ceiling.measure_concurrent(callers),
                "streams": {b: ceiling.measure_streams(b) for b in formed} if ceiling.streams > 1 else {},
            }
        )
    server = {mode: median_rounds(rounds[mode]) for mode in MODES}
    floor = {r["concurrency"]: r for r in median_rounds(rounds["floor"])}
    ratios = paired_ratios(rounds, ceiling_rounds)
    keys = ceiling_rounds[0]["batches"][1].keys()
    ceiling_median = {
        b: {key: statistics.median(c["batches"][b][key] for c in ceiling_rounds) for key in keys} for b in LEVELS
    }
    concurrent = {
        key: statistics.median(c["concurrent"][key] for c in ceiling_rounds) for key in ("qps", "cpu_ms_per_query")
    }

    print(
        f"\nServing benchmark on {os.cpu_count()} CPUs, index {artifacts.current_version(run / 'index')}, "
        f"{args.loadgen}, {seconds:g} s per level, median of {repeats} round(s)\n"
    )
    print("In-process ceiling (same ORT session + faiss index, called directly; median of the rounds):")
    print(f"{'batch':>6} {'q/s':>9} {'q/s +decode':>12} {'ms/batch':>9} {'CPU ms/q':>9} {'q/s as served':>14}")
    for b, c in ceiling_median.items():
        print(
            f"{b:>6} {c['qps']:9.0f} {c['qps_with_decode']:12.0f} {c['latency_ms']:9.2f} "
            f"{c['cpu_ms_per_query']:9.3f} {c['qps_as_served']:14.0f}"
        )
    embedder = ceiling.embedder
    print(
        f"(q/s: each batch in one ORT run; as served: in runs of at most {embedder.run_rows or 'the batch'} "
        f"images, and {embedder.side_by_side_run_rows or 'the batch'} beside another batch — the split the "
        "server's loader measured fastest in this process)"
    )

    def side_session(embedder) -> str:
        session = embedder.side_by_side_session
        return f"{session.get_session_options().intra_op_num_threads}-thread session" if session else "one session"

    print(
        f"single queries, {callers} threads at once, {side_session(ceiling.unbatched_embedder)}: "
        f"{concurrent['qps']:.0f} q/s, {concurrent['cpu_ms_per_query']:.3f} ms CPU/q"
    )
    if ceiling.streams > 1:  # at the batch size the server formed at concurrency 32, round by round
        at_c32 = [
            c["streams"][formed_batch(r)]
            for c, server_round in zip(ceiling_rounds, rounds["on"], strict=True)
            for r in server_round
            if r["concurrency"] == 32
        ]
        print(
            f"batches of the size formed at concurrency 32 ({statistics.median(s['batch'] for s in at_c32):.0f}), "
            f"{ceiling.streams} at once, {side_session(ceiling.embedder)}: "
            f"{statistics.median(s['qps'] for s in at_c32):.0f} q/s, "
            f"{statistics.median(s['cpu_ms_per_query'] for s in at_c32):.3f} ms CPU/q"
        )
    print("\ngRPC floor (bare grpc.aio server, canned response, same load):")
    for c, r in floor.items():
        cpu = r["server_cpu_ms_per_query"]
        print(f"  concurrency {c:>3}: {r['qps']:7.0f} q/s, p50 {r['p50_ms']:.2f} ms, {cpu:.3f} ms CPU/q")
    print("\nServer over gRPC (closed loop; ratios: median of each round over that round's ceiling):")
    header = f"{'mode':>8} {'conc':>5} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/q':>9} {'batch':>6}"
    print(header + f" {'errors':>6} {'vs b=32':>8} {'vs same':>8} {'vs best':>8} {'vs floor':>9}  rounds q/s")
    for mode, levels in server.items():
        for r in levels:
            c = r["concurrency"]
            paired = ratios[mode][c]
            print(
                f"{mode:>8} {c:>5} {r['qps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                f"{r['server_cpu_ms_per_query']:9.3f} {r.get('mean_batch', 0):6.1f} {r.get('errors', 0):>6.0f} "
                f"{statistics.median(paired['vs_b32']):8.0%} {statistics.median(paired['vs_same_batch']):8.0%} "
                f"{statistics.median(paired['vs_best']):8.0%} "
                f"{r['qps'] / floor[c]['qps']:9.0%}  {r['qps_rounds']}"
            )
    on = {r["concurrency"]: r for r in server["on"]}
    off = {r["concurrency"]: r for r in server["off"]}
    paired_summary = {
        "throughput_ratio_c32_vs_ceiling_b32": ratios["on"][32]["vs_b32"],
        "throughput_ratio_c32_vs_ceiling_b32_with_decode": ratios["on"][32]["vs_b32_with_decode"],
        "throughput_ratio_c32_vs_ceiling_same_batch": ratios["on"][32]["vs_same_batch"],
        "throughput_ratio_c32_unbatched_vs_ceiling_b32": ratios["off"][32]["vs_b32"],
        **{f"throughput_ratio_c32_{mode}_vs_best_ceiling": ratios[mode][32]["vs_best"] for mode in MODES},
        "added_p50_ms_c1": ratios["on"][1]["added_p50_ms"],
        "added_p50_ms_c1_unbatched": ratios["off"][1]["added_p50_ms"],
    }
    summary = {key: statistics.median(values) for key, values in paired_summary.items()}
    summary |= {
        "throughput_ratio_c32_vs_grpc_floor": on[32]["qps"] / floor[32]["qps"],
        "batching_speedup_c32": on[32]["qps"] / off[32]["qps"],
        "ceiling_cpu_ms_per_query_b32": ceiling_median[32]["cpu_ms_per_query"],
        "server_cpu_ms_per_query_c32": on[32]["server_cpu_ms_per_query"],
    }
    print("\nGoals: ≥ 90% of the ceiling at concurrency 32; ≤ 2 ms added to p50 at concurrency 1")
    for key, value in summary.items():
        rounds_note = f"  rounds {[round(v, 3) for v in paired_summary[key]]}" if key in paired_summary else ""
        print(f"  {key}: {value:.3f}{rounds_note}")
    out = run / "bench_serving.json"
    out.write_text(
        json.dumps(
            {
                "loadgen": args.loadgen,
                "seconds": seconds,
                "repeats": repeats,
                "ceiling_rounds": ceiling_rounds,
                "paired_ratios": ratios,
                "grpc_floor": rounds["floor"],
                "server_rounds": {m: rounds[m] for m in MODES},
                "server": server,
                "summary": summary,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
