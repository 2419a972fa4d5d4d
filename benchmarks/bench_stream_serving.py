"""Ingest at rate while serving (issue 61): `--ingest-callers` callers each sending `AddItems` of
`--items-per-call` embeddings back to back beside `--search-callers` search callers, against the
same search load without ingest — for `serve` and `serve --ray` over `--rows` vectors.

Each mode starts its server once over a fresh labelled version (`benchmarks.bench_shards.publish_vectors`,
`--factory`, one shard) and runs two phases of `--minutes` each:

1. the search callers alone: threads in this process, each with its own `SearchClient`, one
   blocking search by embedding (k = 10) after another (bench_peers' client shape), every query
   carrying its `label` so the server's traffic Recall@K counts it;
2. the same search callers plus the ingest callers: each `AddItems` of new unit vectors (labelled,
   as the version's rows must be), and the moment it answers a search by one of its embeddings
   (k = 1) that must find that item — ingest-to-visible is the call's answer time; a miss is counted.

Every `--sample-s` seconds: the probe's and the traffic's Recall@K and their sample sizes (the
server's `simsearch_recall_at_k` and `simsearch_recall_samples` gauges, source "probe",
"traffic", and ANN fidelity's `simsearch_ann_recall_at_k`), the resident memory of every serving
process, and the versions published so far (distinct `index_version`s the AddItems answers named).

The data: `CLASSES` labels; each label's centre is the tiny ONNX model's embedding
(`tests.support.index.write_tiny_model`) of a random 8-px image of its own, the rows and the
queries that centre plus noise. The probe needs labelled rows and images it can send: a
vectors-only version (no labels, no image files) gives it nothing to score (`ProbeRunner.probe_set`
returns an empty set: `IndexVersion.labelled` is false, and the rows' paths are not files), and
no probe figure is ever published. So the version is labelled and the server takes
`--probe-catalog`: noisy copies of the labels' images (`--probe-size` of them), scored against
the labels of the rows they find.

Serving processes: `serve` — the server's process and its children (worker processes);
`serve --ray` — the server's process and its children, and the Ray processes of this run's local
Ray (`harness.local_ray`, started by this process: its descendants) whose command line is a Ray
actor's, `ray::<Class>` (ServeReplica:…, ServeController, ProxyActor); idle workers (`ray::IDLE`)
and Ray's own daemons (raylet, gcs_server …) are left out.

The clients share this process (and its GIL) with the ingest callers: the figures are the whole
system's on this machine, compared phase against phase.

    python -m benchmarks.bench_stream_serving                     # 1M rows, 10 minutes a phase
    python -m benchmarks.bench_stream_serving --rows 20000 --minutes 0.5 --sample-s 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.harness import BenchError
from benchmarks.server_readings import K, memory, scrape
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-stream-serving-token"
MODES = ("serve", "ray")
CLASSES = 1000
NOISE = 0.5  # a row's noise against its centre, in norm (bench_shards' clustered rows: the same share)
GOALS = {"qps_ratio": 0.8, "p99_ratio": 1.5}  # with ingest ÷ without: at least, at most


def check_args(args: argparse.Namespace) -> list[str]:
    """The modes asked for, or a BenchError naming the first bad option."""
    modes = harness.chosen("--modes", args.modes, MODES)
    harness.at_least_one(args, ("rows", "dim", "items_per_call", "search_callers", "probe_size"))
    if args.ingest_callers < 0:
        raise BenchError(f"--ingest-callers must be 0 or more, got {args.ingest_callers}")
    if args.rows < K:
        raise BenchError(f"--rows must be at least k = {K}, got {args.rows}")
    if not args.minutes > 0 or not args.sample_s > 0 or not args.probe_interval_s > 0:
        raise BenchError("--minutes, --sample-s and --probe-interval-s must be positive")
    if args.sample_s > args.minutes * 60:
        raise BenchError(f"--sample-s {args.sample_s} is longer than a phase ({args.minutes * 60:g} s)")
    return modes


# -- data: labelled clusters around the tiny model's embeddings of one image a label -------------


class Data:
    """The model, each label's image and centre, and where new vectors of a label come from."""

    def __init__(self, folder: Path, dim: int, seed: int = 0) -> None:
        from PIL import Image

        from tests.support.index import SIDE, write_tiny_model

        self.model = write_tiny_model(folder / "model", dim=dim)
        self.dim = dim
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (CLASSES, SIDE, SIDE, 3), dtype=np.uint8)
        bases = folder / "bases"
        bases.mkdir(parents=True, exist_ok=True)
        paths = []
        for c, pixels in enumerate(self.images):
            paths.append(bases / f"{c:04d}.png")
            Image.fromarray(pixels).save(paths[-1])
        self.centres = self.embed(paths)

    def embed(self, paths: list[Path]) -> np.ndarray:
        """Unit embeddings of images, as the server computes them (its decode, the model)."""
        import onnxruntime

        from core.artifacts.model_manifests import ModelManifest
        from core.data.preprocess import load_batch

        contract = ModelManifest.read(self.model).input
        session = onnxruntime.InferenceSession(str(self.model / "model.onnx"), providers=["CPUExecutionProvider"])
        out = session.run(None, {"images": load_batch([str(p) for p in paths], contract)})[0]
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def vectors(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A unit vector near each label's centre."""
        v = self.centres[labels] + (NOISE / np.sqrt(self.dim)) * rng.standard_normal((len(labels), self.dim))
        return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)

    def rows(self, count: int, seed: int) -> tuple[np.ndarray, list[str]]:
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, CLASSES, count)
        out = np.empty((count, self.dim), dtype=np.float32)
        for start in range(0, count, 65536):  # in blocks: the temporaries stay small at 1M rows
            out[start : start + 65536] = self.vectors(labels[start : start + 65536], rng)
        return out, [str(c) for c in labels]

    def probe_catalog(self, folder: Path, size: int, seed: int = 1) -> Path:
        """`size` noisy copies of the labels' images and a catalog of them (`catalog.csv`: id,
        path, label), the server's `--probe-catalog`."""
        import csv

        from PIL import Image

        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        catalog = folder / "catalog.csv"
        with catalog.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "path", "label"])
            for n in range(size):
                c = n % CLASSES
                pixels = self.images[c].astype(np.int16) + rng.integers(-8, 9, self.images[c].shape)
                path = folder / f"probe-{n:05d}.png"
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
                writer.writerow([f"probe-{n:05d}", str(path), str(c)])
        return catalog


# -- the callers -----------------------------------------------------------------------------------


class Run:
    """One phase's callers and their figures, stopped by `stop`."""

    def __init__(self, target: str, data: Data, args: argparse.Namespace, seed: int) -> None:
        self.target, self.data, self.args, self.seed = target, data, args, seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.search_ms: list[float] = []
        self.search_errors = 0
        self.ingests: list[dict] = []
        self.ingest_errors: list[str] = []
        self.versions: set[str] = set()
        self.threads: list[threading.Thread] = []

    def start(self, ingest: bool) -> None:
        for i in range(self.args.search_callers):
            self.threads.append(threading.Thread(target=self._search, args=(i,), daemon=True))
        for i in range(self.args.ingest_callers if ingest else 0):
            self.threads.append(threading.Thread(target=self._ingest, args=(i,), daemon=True))
        self.started = time.perf_counter()
        for t in self.threads:
            t.start()

    def finish(self) -> float:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        return time.perf_counter() - self.started

    def _search(self, caller: int) -> None:
        rng = np.random.default_rng(self.seed * 1000 + caller)
        labels = rng.integers(0, CLASSES, 512)
        queries = self.data.vectors(labels, rng).tolist()
        done, errors = [], 0
        with SearchClient(self.target, timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                request = pb.SearchRequest(embedding=pb.Embedding(values=queries[n % 512]), k=K,
                                           label=str(labels[n % 512]))  # fmt: skip
                sent = time.perf_counter()
                try:
                    client.search(request)
                    done.append((time.perf_counter() - sent) * 1e3)
                except Exception:
                    errors += 1
                n += 1
        with self.lock:
            self.search_ms += done
            self.search_errors += errors

    def _ingest(self, caller: int) -> None:
        rng = np.random.default_rng(10**6 + self.seed * 1000 + caller)
        per = self.args.items_per_call
        with SearchClient(self.target, timeout=120, admin_token=TOKEN) as client:
            n = 0
            while not self.stop.is_set():
                labels = rng.integers(0, CLASSES, per)
                vectors = self.data.vectors(labels, rng)
                ids = [f"s{self.seed}-c{caller:02d}-{n:06d}-{j:03d}" for j in range(per)]
                items = [pb.NewItem(id=i, embedding=pb.Embedding(values=v.tolist()), label=str(c))
                         for i, v, c in zip(ids, vectors, labels, strict=True)]  # fmt: skip
                sent = time.perf_counter()
                try:
                    answer = client.add_items(items)
                    answered = time.perf_counter()
                    pick = int(rng.integers(per))
                    found = client.search(pb.SearchRequest(embedding=pb.Embedding(values=vectors[pick].tolist()), k=1))
                except Exception as exc:
                    with self.lock:
                        self.ingest_errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    n += 1
                    continue
                hit = bool(found.neighbors) and found.neighbors[0].id == ids[pick]
                with self.lock:
                    self.versions.add(answer.index_version)
                    self.ingests.append({"at": answered - self.started, "visible_ms": (answered - sent) * 1e3,
                                         "items": answer.added + answer.replaced, "found": hit})  # fmt: skip
                n += 1


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def phase(name: str, target: str, pid: int, metrics_port: int, data: Data, args, ingest: bool, seed: int) -> dict:
    """One phase: callers for `--minutes`, sampled every `--sample-s`."""
    run = Run(target, data, args, seed)
    run.start(ingest)
    length = args.minutes * 60
    samples = []
    for n in range(1, int(length // args.sample_s) + 1):
        time.sleep(max(0.0, run.started + n * args.sample_s - time.perf_counter()))
        with run.lock:
            versions = len(run.versions)
        try:
            figures = scrape(metrics_port)
        except OSError as exc:
            figures = {"scrape_error": str(exc)}
        samples.append({"phase": name, "at_s": round(n * args.sample_s, 1), **figures,
                        "versions": versions, "memory_mib": memory(pid, args.mode == "ray")})  # fmt: skip
        said = {k: v for k, v in samples[-1].items() if k != "memory_mib"}
        print(f"  {name} {samples[-1]['at_s']:.0f} s: {json.dumps(said)}", flush=True)
    time.sleep(max(0.0, run.started + length - time.perf_counter()))
    seconds = run.finish()
    visible = [i["visible_ms"] for i in run.ingests]
    return {
        "seconds": seconds,
        "searches": len(run.search_ms),
        "search_errors": run.search_errors,
        "qps": len(run.search_ms) / seconds,
        "p50_ms": percentile(run.search_ms, 50),
        "p99_ms": percentile(run.search_ms, 99),
        "ingest_calls": len(run.ingests),
        "ingest_errors": len(run.ingest_errors),
        "ingest_error_examples": sorted(set(run.ingest_errors))[:3],
        "items_per_s": sum(i["items"] for i in run.ingests) / seconds,
        "versions": len(run.versions),
        "versions_per_s": len(run.versions) / seconds,
        "visible_p50_ms": percentile(visible, 50),
        "visible_p99_ms": percentile(visible, 99),
        "found": sum(i["found"] for i in run.ingests),
        "found_ratio": sum(i["found"] for i in run.ingests) / len(run.ingests) if run.ingests else None,
        "samples": samples,
    }


# -- a mode: its server, its two phases ------------------------------------------------------------


def run_mode(mode: str, folder: Path, data: Data, probe: Path, args: argparse.Namespace) -> dict:
    from benchmarks.bench_shards import publish_vectors

    args.mode = mode
    root = folder / f"index-{mode}"
    started = time.perf_counter()
    vectors, labels = data.rows(args.rows, seed=2)
    publish_vectors(root, vectors, 1, factory=args.factory, model=data.model, labels=labels)
    del vectors
    build_s = time.perf_counter() - started
    metrics_port = harness.free_port()
    command = [sys.executable, "-m", "serving", "serve", *(["--ray"] if mode == "ray" else []),
               "--index-root", str(root), "--port", "0", "--metrics-port", str(metrics_port),
               "--admin-token", TOKEN, "--probe-catalog", str(probe), "--probe-size", str(args.probe_size),
               "--probe-interval-s", str(args.probe_interval_s),
               "--log-format", "text", *(["--processes", str(args.processes)] if args.processes else [])]  # fmt: skip
    with contextlib.ExitStack() as stack:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if mode == "ray":
            env = stack.enter_context(harness.local_ray())
            env["PYTHONPATH"] = str(ROOT)
        proc, ports = harness.serving(command, env, log=folder / f"serve-{mode}.log")
        try:
            target = f"127.0.0.1:{ports['port']}"
            with SearchClient(target, timeout=60) as client:
                client.wait_ready(120)
                for _ in range(20):  # warm-up: connections, the first batches
                    client.search(pb.SearchRequest(embedding=pb.Embedding(values=data.centres[0].tolist()), k=K))
            alone = phase("alone", target, proc.pid, metrics_port, data, args, ingest=False, seed=1)
            ingesting = phase("ingest", target, proc.pid, metrics_port, data, args, ingest=True, seed=2)
        finally:
            harness.stop(proc)
    return {"mode": mode, "build_s": build_s, "alone": alone, "ingest": ingesting}


# -- report ----------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def met(value: float | None, goal: float, above: bool) -> str | None:
    """Whether a ratio meets its goal (at least it, `above`; else at most it)."""
    if value is None:
        return None
    return "yes" if (value >= goal if above else value <= goal) else "NO"


def probe_rounds(samples: list[dict], probe_size: int) -> list[float | None]:
    """Probe rounds (queries ÷ `probe_size`) answered between each sample and the one before."""
    out, before = [], 0.0
    for s in samples:
        count = s.get("embed_count")
        out.append(None if count is None else (count - before) / probe_size)
        before = count if count is not None else before
    return out


def summary_rows(results: list[dict], probe_size: int) -> list[dict]:
    rows = []
    for r in results:
        a, i = r["alone"], r["ingest"]
        rounds = probe_rounds(a["samples"] + i["samples"], probe_size)
        qps, p99 = ratio(i["qps"], a["qps"]), ratio(i["p99_ms"], a["p99_ms"])
        rows.append({
            "mode": r["mode"], "items/s": i["items_per_s"], "versions/s": i["versions_per_s"],
            "visible p50 ms": i["visible_p50_ms"], "visible p99 ms": i["visible_p99_ms"],
            "found": f"{i['found']}/{i['ingest_calls']}", "ingest errors": i["ingest_errors"],
            "q/s alone": a["qps"], "q/s ingest": i["qps"],
            "q/s ratio": qps, f"≥ {GOALS['qps_ratio']}": met(qps, GOALS["qps_ratio"], above=True),
            "p99 alone ms": a["p99_ms"], "p99 ingest ms": i["p99_ms"],
            "p99 ratio": p99, f"≤ {GOALS['p99_ratio']}": met(p99, GOALS["p99_ratio"], above=False),
            "search errors": a["search_errors"] + i["search_errors"],
            # a probe gauge keeps its last round's value: samples after no whole round are stale
            "samples without a probe round": f"{sum(1 for n in rounds if n is not None and n < 1)}/{len(rounds)}",
        })  # fmt: skip
    return rows


def sample_rows(result: dict, probe_size: int) -> list[dict]:
    samples = result["alone"]["samples"] + result["ingest"]["samples"]
    rows = []
    for s, rounds in zip(samples, probe_rounds(samples, probe_size), strict=True):

        def n(key: str, s: dict = s) -> int | None:
            return None if s.get(key) is None else int(s[key])

        rows.append({
            "phase": s["phase"], "at s": s["at_s"], f"probe R@{K}": s.get("probe"), "probe n": n("probe_n"),
            f"traffic R@{K}": s.get("traffic"), "traffic n": n("traffic_n"), f"ANN R@{K}": s.get("ann"),
            "ann n": n("ann_n"), "probe rounds since": rounds, "rows": n("index_size"), "versions": s["versions"],
            "serving MiB": sum(s["memory_mib"].values()),
        })  # fmt: skip
    return rows


def memory_rows(result: dict) -> list[dict]:
    samples = result["alone"]["samples"] + result["ingest"]["samples"]
    names = list(dict.fromkeys(name for s in samples for name in s["memory_mib"]))
    return [
        {"process": name, **{f"{s['phase'][0]}{s['at_s']:.0f}s": s["memory_mib"].get(name) for s in samples}}
        for name in names
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the version served at the start")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples of recall and memory")
    parser.add_argument("--modes", default="serve,ray", help="serve (one server), ray (serve --ray)")
    parser.add_argument("--ingest-callers", type=int, default=10)
    parser.add_argument("--items-per-call", type=int, default=100)
    parser.add_argument("--search-callers", type=int, default=32)
    parser.add_argument("--factory", default="Flat", help="the version's faiss factory")
    parser.add_argument("--probe-size", type=int, default=200, help="probe images a round (the server's --probe-size)")
    parser.add_argument("--probe-interval-s", type=float, default=30.0, help="the server's --probe-interval-s")
    parser.add_argument("--processes", type=int, default=0, help="serve's --processes (0: its default)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where versions and logs go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON of every figure")
    args = parser.parse_args()
    try:
        modes = check_args(args)
    except BenchError as exc:
        parser.error(str(exc))
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-stream-serving-")))
        else:
            folder = args.work_dir
            folder.mkdir(parents=True, exist_ok=True)
        data = Data(folder, args.dim)
        probe = data.probe_catalog(folder / "probe", args.probe_size)
        results = []
        for mode in modes:
            print(f"{mode}: {args.rows:,} rows, {args.minutes:g} min a phase", flush=True)
            results.append(run_mode(mode, folder, data, probe, args))
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"\nIngest at rate while serving: {args.rows:,} rows ({args.factory}, {args.dim}-d), "
          f"{args.search_callers} search callers, {args.ingest_callers} ingest callers × {args.items_per_call} "
          f"items a call, {args.minutes:g} min a phase\n")  # fmt: skip
    print(harness.markdown_table(summary_rows(results, args.probe_size)))
    for r in results:
        print(f"\n{r['mode']}: Recall@{K} and memory every {args.sample_s:g} s\n")
        print(harness.markdown_table(sample_rows(r, args.probe_size)))
        print(f"\n{r['mode']}: resident MiB of each serving process\n")
        print(harness.markdown_table(memory_rows(r)))


if __name__ == "__main__":
    main()
