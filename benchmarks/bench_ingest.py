"""Ingest to visible: from an `AddItems` call to the first search that finds the item, at one
ingest a second, under a search load of 224-px image queries at concurrency 32 — and that
load's q/s and p99 with the ingests and, in the same run, without them (the baseline).

The server is `python -m serving serve` over the soak's synthetic catalog (`--synthetic N` 224-px
JPEGs, its 224-px model; `benchmarks/soak.py`), an index root built once and copied. Each
ingest adds one item — a random unit embedding under a new id — and, the moment the call
answers, searches that embedding: the item must be its own best answer. Compaction runs as it
would (`--max-segments`, default 16): the p99 holds the ingests that compact.

    python -m benchmarks.bench_ingest                   # 20,000 images, 60 s each phase
    python -m benchmarks.bench_ingest --seconds 20 --synthetic 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.soak_served import synthetic_run
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-ingest-token"


def ingests(client: SearchClient, dim: int, seconds: float) -> list[dict]:
    """One ingest a second for `seconds`: each one's call and visibility times."""
    rng = np.random.default_rng(0)
    done = []
    started = time.perf_counter()
    for n in range(10**9):
        due = started + n
        if due - started >= seconds:
            break
        time.sleep(max(0.0, due - time.perf_counter()))
        vector = rng.standard_normal(dim).astype(np.float32)
        vector /= np.linalg.norm(vector)
        item_id = f"ingested-{n:05d}"
        sent = time.perf_counter()
        client.add_items([pb.NewItem(id=item_id, embedding=pb.Embedding(values=vector.tolist()), label="ingested")])
        answered = time.perf_counter()
        found = client.search(pb.SearchRequest(embedding=pb.Embedding(values=vector.tolist()), k=1))
        visible = time.perf_counter()
        done.append({"call_s": answered - sent, "visible_s": visible - sent, "found": found.neighbors[0].id == item_id})
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", type=int, default=20_000, help="224-px images in the served catalog")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-segments", type=int, default=16)
    args = parser.parse_args()
    if args.synthetic < 64 or args.seconds < 5 or args.concurrency < 1:
        parser.error("--synthetic at least 64, --seconds at least 5, --concurrency at least 1")
    served = synthetic_run(ROOT / "runs" / f"soak-224px-{args.synthetic}", args.synthetic)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SIMSEARCH_ADMIN_TOKEN": TOKEN}
    built = served.index_root(1, env)
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "index"
        shutil.copytree(built, root)
        port, metrics_port = harness.free_port(), harness.free_port()
        command = [sys.executable, "-m", "serving", "serve", "--port", str(port), "--metrics-port",
                   str(metrics_port), "--index-root", str(root), "--max-segments", str(args.max_segments),
                   "--processes", "1"]  # fmt: skip
        os.environ["SIMSEARCH_ADMIN_TOKEN"] = TOKEN
        proc = harness.start(command, lambda: harness.healthy(metrics_port))
        try:
            catalog = served.catalog
            harness.python_loadgen(port, catalog, args.concurrency, 3.0)  # warm-up
            baseline = harness.python_loadgen(port, catalog, args.concurrency, args.seconds)
            loaded: dict = {}
            load = threading.Thread(
                target=lambda: loaded.update(harness.python_loadgen(port, catalog, args.concurrency, args.seconds))
            )
            load.start()
            client = SearchClient(f"127.0.0.1:{port}", admin_token=TOKEN)
            dim = client.get_info().embedding_dim
            done = ingests(client, dim, args.seconds - 2)
            load.join()
        finally:
            harness.stop(proc)
    visible = np.array([d["visible_s"] for d in done]) * 1e3
    calls = np.array([d["call_s"] for d in done]) * 1e3
    figures = {
        "ingests": len(done),
        "found_at_once": sum(d["found"] for d in done),
        "visible_p50_ms": float(np.percentile(visible, 50)),
        "visible_p99_ms": float(np.percentile(visible, 99)),
        "call_p50_ms": float(np.percentile(calls, 50)),
        "call_p99_ms": float(np.percentile(calls, 99)),
        "baseline": baseline,
        "with_ingest": loaded,
    }
    print(json.dumps(figures))
    print(f"\nIngest to visible, one a second under {args.concurrency} image callers ({args.synthetic:,} images, "
          f"{args.seconds:.0f} s a phase)")  # fmt: skip
    print("| ingests | found at once | to visible p50 / p99 | the call p50 / p99 | search q/s: alone / with ingest | "
          "search p99: alone / with ingest |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    f = figures
    print(f"| {len(done)} | {f['found_at_once']} | {f['visible_p50_ms']:.0f} / {f['visible_p99_ms']:.0f} ms | "
          f"{f['call_p50_ms']:.0f} / {f['call_p99_ms']:.0f} ms | {baseline.get('qps', 0):.0f} / "
          f"{loaded.get('qps', 0):.0f} | {baseline.get('p99_ms', 0):.0f} / "
          f"{loaded.get('p99_ms', 0):.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
