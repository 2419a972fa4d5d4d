"""`serve --processes N` against one process: q/s by embedding and by image at one concurrency,
and the whole server's memory — the proportional set size (PSS, /proc/PID/smaps_rollup) summed
over the supervisor and its workers, so the index pages the workers share through the page
cache count once — over a synthetic Flat index (100k × 128 by default).

Load is h2load (C) over several connections: the kernel spreads connections, not calls, over a
server's workers (SO_REUSEPORT), so one connection would reach one worker alone.

    python -m benchmarks.bench_workers --processes 1 2 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.harness import ROOT, free_port, h2load, healthy, photo_like_images
from protos.simsearch.v1 import search_pb2 as pb

SIDE = 224  # the images a user sends; the model pools them to 8×8 (tests/support/index.py)


def build(root: Path, rows: int, dim: int) -> Path:
    """A live Flat version of `rows` × `dim` synthetic vectors in `root/index`, built once."""
    from tests.support import shards as support

    index_root = root / "index"
    if (index_root / "CURRENT").is_file():
        return index_root
    model = support.model(root / "model", dim, side=SIDE)
    support.publish(index_root, support.catalog(rows, dim, max(8, rows // 4)), model, 1)
    return index_root


def body(request: pb.SearchRequest, path: Path) -> Path:
    message = request.SerializeToString()
    path.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    return path


def pss_mb(pid: int, field: str = "Pss") -> float:
    """The server's PSS in MB (`field`: Pss_Anon, Pss_File for a part): the process and its
    children (a supervisor's workers)."""
    total = 0
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(f"{field}:"):
                total += int(line.split()[1])
    return total / 1024


def run(index_root: Path, processes: int, bodies: dict[str, Path], args: argparse.Namespace, work: Path) -> dict:
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "serving", "serve", "--index-root", str(index_root), "--port", str(port)]
    command += ["--metrics-port", str(metrics_port), "--processes", str(processes), "--probe-interval-s", "0"]
    command += ["--ann-sample-rate", "0", "--log-format", "text"]
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        json.loads(proc.stdout.readline())  # listening (and, with workers, every worker loaded)
        deadline = time.monotonic() + 300
        while not healthy(metrics_port):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not load")
            time.sleep(0.3)
        out = {"processes": processes, "pss_idle_mb": pss_mb(proc.pid)}
        for name, path in bodies.items():
            log = work / f"h2load-{processes}-{name}.log"
            h2load(port, path, args.concurrency, 1.0, log, connections=args.connections)  # warm-up
            result = h2load(port, path, args.concurrency, args.seconds, log, connections=args.connections)
            out[name] = {k: result[k] for k in ("qps", "p50_ms", "p99_ms")}
        out["pss_loaded_mb"] = pss_mb(proc.pid)
        out["pss_anon_mb"] = pss_mb(proc.pid, "Pss_Anon")  # each process's own heap
        out["pss_file_mb"] = pss_mb(proc.pid, "Pss_File")  # mapped files: the index, libraries
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="server processes to compare")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    parser.add_argument("--connections", type=int, default=8, help="connections they are spread over")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--run", default="runs/bench-workers", help="where the index is built once")
    args = parser.parse_args()
    if min(args.processes) < 1 or args.concurrency < args.connections:
        parser.error("--processes must be ≥ 1 and --concurrency ≥ --connections")
    root = build(ROOT / args.run / f"{args.rows}x{args.dim}", args.rows, args.dim)
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    vector = np.random.default_rng(1).standard_normal(args.dim).astype(np.float32)
    bodies = {
        "embedding": body(pb.SearchRequest(embedding=pb.Embedding(values=vector.tolist()), k=10), work / "e.grpc"),
        "image": body(pb.SearchRequest(image=photo_like_images(1, side=SIDE)[0][0], k=10), work / "i.grpc"),
    }
    results = [run(root, n, bodies, args, work) for n in args.processes]
    print(
        f"\n{args.rows:,} × {args.dim} Flat, {os.cpu_count()} CPUs, concurrency {args.concurrency} over "
        f"{args.connections} connections, {args.seconds:g} s"
    )
    print(
        f"{'processes':>9} {'q/s emb':>8} {'p99 ms':>7} {'q/s img':>8} {'p99 ms':>7} {'PSS MB':>7} {'× one':>6} "
        f"{'anon MB':>8} {'file MB':>8}"
    )
    one = results[0]["pss_loaded_mb"]
    for r in results:
        e, i = r["embedding"], r["image"]
        print(
            f"{r['processes']:>9} {e['qps']:8.0f} {e['p99_ms']:7.1f} {i['qps']:8.0f} {i['p99_ms']:7.1f} "
            f"{r['pss_loaded_mb']:7.0f} {r['pss_loaded_mb'] / one:6.2f} {r['pss_anon_mb']:8.0f} {r['pss_file_mb']:8.0f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
