"""What the serving benchmarks share: the server in its own process (`python -m serving serve`, or
benchmarks/grpc_floor.py's bare gRPC server), the load generators (h2load sending one gRPC-framed
SearchRequest; benchmarks/loadgen.py in its own process), the in-process ceiling (the server's
model and index called directly), the server's Prometheus counters and its CPU time from /proc,
and the medians across rounds; and for sharded serving, a local Ray, a `serve` or `serve --ray`
process read by the ports it prints, and 224-px JPEG images as users send them.

bench_serving.py is the benchmark built on it; bench_http.py, ab_serving.py, bench_scale.py,
bench_shards.py and soak.py start servers and send load through it too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from core.data.preprocess import load_image
from protos.simsearch.v1 import search_pb2 as pb
from serving.config import ServerConfig

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


# -- the in-process ceiling --------------------------------------------------------------------


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


def h2load(port: int, body: Path, concurrency: int, seconds: float, log: Path, connections: int = 1) -> dict:
    """Closed loop: `concurrency` streams on `connections` connections (by default one, as one gRPC
    channel), for `seconds`."""
    duration = f"{max(1, round(seconds))}"  # h2load takes whole seconds (or a unit: 500ms)
    log.unlink(missing_ok=True)  # h2load appends to its log: rows of an earlier run would count
    streams = str(max(1, concurrency // connections))
    command = ["h2load", "-c", str(connections), "-m", streams, "-t", "1", "-D", duration]
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
    port: int,
    catalog: Path,
    concurrency: int,
    seconds: float,
    protocol: str = "grpc",
    query: str = "image",
    texts: Path | None = None,
) -> dict:
    """One closed-loop run of `benchmarks/loadgen.py` in its own process: its JSON figures.
    `texts`: with query "text", the file of phrases it sends."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen", "--target", f"127.0.0.1:{port}", "--protocol", protocol]
        + ["--query", query, "--catalog", str(catalog), "--concurrency", str(concurrency), "--seconds", str(seconds)]
        + (["--texts", str(texts)] if texts else []),
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
    # one process: its CPU is read from its pid, and h2load's one connection reaches one worker
    flags = ["--index-root", str(run / "index"), "--max-batch-size", "32", "--probe-interval-s", "3600"]
    flags += ["--processes", "1"]
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


# -- statistics across rounds ------------------------------------------------------------------


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


# -- sharded serving: a local Ray, a server read by its ports line, images as users send them ----


@contextlib.contextmanager
def local_ray() -> Iterator[dict[str, str]]:
    """A local Ray set up as `serve --ray` sets up its own (`SERVING_CLUSTER_ENV`: workers at
    this process's priority, the GCS's task events bounded): the environment that points
    `serve --ray` (and `index build --shards`) at it."""
    import ray

    from serving.ray_serve.cluster import SERVING_CLUSTER_ENV

    for name, value in SERVING_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=os.cpu_count() or 1, log_to_driver=False, include_dashboard=False)
    try:
        yield {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    finally:
        ray.shutdown()


def serving(
    command: list[str], env: dict[str, str], log: Path | None = None, timeout_s: float = 600.0
) -> tuple[subprocess.Popen, dict]:
    """A `python -m serving serve …` process (`--ray` or not) and the ports it printed, one JSON
    line, once serving; its stderr into `log` (else dropped). A server that exits first, or prints
    nothing within `timeout_s`, is a RuntimeError quoting the end of its log."""
    stderr = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    try:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    finally:
        if log:
            stderr.close()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0]:
        if reader.is_alive():
            proc.kill()
        said = "".join(log.read_text().splitlines(keepends=True)[-20:]) if log else ""
        what = " ".join(command[2:5])
        raise RuntimeError(f"{what} exited with {proc.wait()} before it served\n{said}")
    return proc, json.loads(lines[0])


def photo_like_images(count: int, side: int = 224, classes: int = 50, seed: int = 0) -> tuple[list[bytes], list[int]]:
    """`count` JPEG images of `side` px (about 10 kB each, as a phone's photo scaled down) and
    each one's class: a class is a smooth colour field (a 6×6 grid of random colours scaled up),
    an image a crop of its class's field at a random offset with noise on it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    margin = side // 7
    fields = [
        np.asarray(
            Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
                (side + margin, side + margin), Image.BILINEAR
            ),
            dtype=np.float32,
        )
        for _ in range(classes)
    ]
    images, labels = [], []
    for _ in range(count):
        label = int(rng.integers(classes))
        y, x = rng.integers(0, margin + 1, 2)
        pixels = fields[label][y : y + side, x : x + side] + rng.normal(0.0, 8.0, (side, side, 3))
        out = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=85)
        images.append(out.getvalue())
        labels.append(label)
    return images, labels


def markdown_table(rows: list[dict]) -> str:
    """`rows` as a markdown table, a column for each key any row has (– where a row has none)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
        return "–" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class BenchError(Exception):
    """A run that cannot go on: its message is the one line printed."""


def chosen(flag: str, value: str, allowed: Sequence[str]) -> list[str]:
    """`value`'s comma-separated names, each one of `allowed`, or a BenchError naming `flag`."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise BenchError(f"{flag}: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(allowed)}")
    return names


def at_least_one(args, names: Sequence[str]) -> None:
    """A BenchError for the first of the options `names` (argparse's dests) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
