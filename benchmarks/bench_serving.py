"""Serving benchmark: queries/s and p50/p99 at concurrency 1/8/32/64, dynamic batching on and off,
against the in-process ceiling (the same ONNX Runtime session and faiss index called directly
with the same batch sizes), measured in the same run.

The server runs as `python -m serving serve` in its own process and the load comes from
benchmarks/loadgen.py (grpc.aio) in another; on a 2-core machine the three share the cores, so
the ratios are the figures to compare across machines, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index import artifacts  # noqa: E402
from index.catalog import read_catalog  # noqa: E402
from index.embedder import OnnxEmbedder  # noqa: E402
from index.faiss_index import load_index  # noqa: E402
from index.preprocess import load_image  # noqa: E402
from serving.client import SearchClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_artifacts(run: Path, quick: bool) -> None:
    if (run / "model" / "manifest.json").is_file() and artifacts.current_version(run / "index"):
        return
    slice_args = ["--max-classes", "40", "--max-per-class", "40", "--epochs", "2", "--classes-per-batch", "10"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(run), *(slice_args if quick else [])],
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


def ceiling(run: Path, catalog_path: Path, batch_sizes: list[int], repeats: int) -> dict[int, dict]:
    """Queries/s of embed+search called directly, per batch size (median of repeats)."""
    embedder = OnnxEmbedder(run / "model", provider="cpu")
    index = load_index(artifacts.version_dir(run / "index") / artifacts.INDEX_FILE)
    catalog = read_catalog(catalog_path)
    blobs = [p.read_bytes() for p in catalog.paths[:512]]
    arrays = np.stack([load_image(b, embedder.contract) for b in blobs])
    out = {}
    for b in batch_sizes:
        batch = arrays[:b]
        for _ in range(3):
            index.search(embedder.embed(batch), 10)
        times, decode_times = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            index.search(embedder.embed(batch), 10)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            for blob in blobs[:b]:
                load_image(blob, embedder.contract)
            decode_times.append(time.perf_counter() - t)
        med, dec = statistics.median(times), statistics.median(decode_times)
        out[b] = {
            "qps": b / med,
            "qps_with_decode": b / (med + dec),
            "latency_ms": med * 1e3,
            "latency_with_decode_ms": (med + dec) * 1e3,
        }
    return out


def serve_and_load(
    run: Path,
    catalog: Path,
    batching: bool,
    concurrencies: list[int],
    seconds: float,
    max_wait_ms: float = 0.0,
    server_flags: tuple[str, ...] = (),
) -> list[dict]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving",
            "serve",
            "--index-root",
            str(run / "index"),
            "--port",
            str(port),
            "--metrics-port",
            str(free_port()),
            "--batching",
            str(batching).lower(),
            "--max-batch-size",
            "32",
            "--max-wait-ms",
            str(max_wait_ms),
            "--probe-interval-s",
            "3600",
            "--ann-sample-rate",
            "0",
            "--log-format",
            "text",
            *server_flags,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with SearchClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(120)
            deadline = time.time() + 120
            while not client.healthy() and time.time() < deadline:
                time.sleep(0.2)
        results = []
        for c in concurrencies:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "loadgen.py"),
                    "--target",
                    f"127.0.0.1:{port}",
                    "--catalog",
                    str(catalog),
                    "--concurrency",
                    str(c),
                    "--seconds",
                    str(seconds),
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        return results
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--run", default="runs/demo", help="directory with model/ and index/ (built by the demo if missing)"
    )
    parser.add_argument("--quick", action="store_true", help="short runs, a glyph slice if artifacts must be built")
    parser.add_argument("--seconds", type=float, help="load duration per concurrency level")
    parser.add_argument(
        "--backbone", help="benchmark a production-size model instead of the demo's (e.g. mobilenet_v2)"
    )
    parser.add_argument("--pretrained", help="its weights (local file or pkg:<package>/<file>)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--ort-spinning", action=argparse.BooleanOptionalAction, default=None, help="the server's setting (default off)"
    )
    args = parser.parse_args()
    if args.backbone and args.run == "runs/demo":
        args.run = f"runs/bench-{args.backbone}-{args.image_size}"
    run = (ROOT / args.run).resolve() if not Path(args.run).is_absolute() else Path(args.run)
    if args.backbone:
        ensure_backbone_artifacts(run, args.backbone, args.pretrained, args.image_size)
    else:
        ensure_artifacts(run, args.quick)
    catalog = run / "train" / "splits" / "test.csv"
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    concurrencies = [1, 8, 32, 64]

    ceil = ceiling(run, catalog, [1, 8, 32, 64], repeats=5 if args.quick or args.backbone else 30)
    flags = () if args.ort_spinning is None else ("--ort-spinning" if args.ort_spinning else "--no-ort-spinning",)
    runs = {
        mode: serve_and_load(run, catalog, mode == "on", concurrencies, seconds, server_flags=flags)
        for mode in ("on", "off")
    }

    print(
        f"\nServing benchmark on {os.cpu_count()} CPUs, index {artifacts.current_version(run / 'index')}, "
        f"{seconds:.0f} s per level\n"
    )
    print("In-process ceiling (same ORT session + faiss index, called directly):")
    print(f"{'batch':>6} {'q/s':>9} {'q/s +decode':>12} {'ms/batch':>9}")
    for b, c in ceil.items():
        print(f"{b:>6} {c['qps']:9.0f} {c['qps_with_decode']:12.0f} {c['latency_ms']:9.2f}")
    print("\nServer over gRPC (closed loop, grpc.aio load generator in its own process):")
    print(f"{'batching':>8} {'conc':>5} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'vs ceiling':>11}")
    for mode, levels in runs.items():
        for r in levels:
            ref = ceil[r["concurrency"]]["qps"]
            print(
                f"{mode:>8} {r['concurrency']:>5} {r['qps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                f"{r['errors']:>6} {r['qps'] / ref:10.0%}"
            )
    on = {r["concurrency"]: r for r in runs["on"]}
    added_p50 = on[1]["p50_ms"] - ceil[1]["latency_with_decode_ms"]
    summary = {
        "throughput_ratio_c32_vs_ceiling_b32": on[32]["qps"] / ceil[32]["qps"],
        "throughput_ratio_c32_vs_ceiling_b32_with_decode": on[32]["qps"] / ceil[32]["qps_with_decode"],
        "added_p50_ms_c1": added_p50,
        "batching_speedup_c32": on[32]["qps"] / {r["concurrency"]: r for r in runs["off"]}[32]["qps"],
    }
    print("\nGoals: ≥ 90% of the ceiling at concurrency 32; ≤ 2 ms added to p50 at concurrency 1")
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}")
    out = run / "bench_serving.json"
    out.write_text(json.dumps({"ceiling": ceil, "server": runs, "summary": summary}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
