"""faiss index choice: build time, queries/s and recall@10 vs exact search for Flat, IVF-Flat,
IVF-PQ and HNSW at two search settings each.

Speed is measured on synthetic clustered vectors at 100k and 1M (`--sizes`); recall only means
something on embeddings with real neighbour structure, so it is also measured on the glyph
catalog embedded by the demo model (every glyph image: 116 characters × 170 faces).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index.build import embed_catalog  # noqa: E402
from index.catalog import read_catalog  # noqa: E402
from index.embedder import OnnxEmbedder  # noqa: E402
from index.faiss_index import build_index, exact_search, search  # noqa: E402


def factories(n: int) -> list[tuple[str, list[dict]]]:
    lists = int(max(16, min(4 * np.sqrt(n), 4096)))
    return [
        ("Flat", [{}]),
        (f"IVF{lists},Flat", [{"nprobe": 4}, {"nprobe": 32}]),
        (f"IVF{lists},PQ16np", [{"nprobe": 4}, {"nprobe": 32}]),
        ("HNSW32", [{"efSearch": 16}, {"efSearch": 128}]),
    ]


def clustered(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(n // 100, 10), d)).astype(np.float32)
    return (centers[rng.integers(0, len(centers), n)] + 0.3 * rng.standard_normal((n, d))).astype(np.float32)


def measure(vectors: np.ndarray, queries: np.ndarray, k: int = 10) -> list[dict]:
    _, truth = exact_search(vectors, queries, k)
    rows = []
    for factory, settings in factories(len(vectors)):
        started = time.perf_counter()
        index = build_index(vectors, factory, train_size=min(len(vectors), 100_000), device="cpu")
        build_s = time.perf_counter() - started
        for params in settings:
            space = faiss.ParameterSpace()
            for name, value in params.items():
                space.set_index_parameter(index, name, value)
            search(index, queries[:10], k)
            started = time.perf_counter()
            _, found = search(index, queries, k)
            qps = len(queries) / (time.perf_counter() - started)
            recall = np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)])
            rows.append({"factory": factory, "params": params, "build_s": build_s, "qps": qps, "recall": recall})
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'factory':<18} {'search':<16} {'build s':>8} {'queries/s':>10} {'recall@10':>10} {'vs Flat q/s':>11}")
    flat = next(r["qps"] for r in rows if r["factory"] == "Flat")
    for r in rows:
        params = ",".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        print(
            f"  {r['factory']:<18} {params:<16} {r['build_s']:8.2f} {r['qps']:10.0f} {r['recall']:10.3f} "
            f"{r['qps'] / flat:10.1f}×"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", default="runs/demo", help="demo run with model/ (for real embeddings)")
    parser.add_argument("--sizes", default="100000,1000000", help="synthetic database sizes")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="sizes 20000 only")
    args = parser.parse_args()
    faiss.omp_set_num_threads(2)
    run = ROOT / args.run
    if not (run / "model" / "manifest.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(run)], check=True, cwd=ROOT)
    glyphs = ROOT / "data" / "glyphs" / "catalog.csv"
    if glyphs.is_file():
        catalog = read_catalog(glyphs)
        if args.quick:
            catalog = catalog.subset(range(0, len(catalog), 4))
        vectors, _, _ = embed_catalog(catalog, OnnxEmbedder(run / "model", provider="cpu"), progress=False)
        rng = np.random.default_rng(1)
        queries = vectors[rng.choice(len(vectors), size=min(args.queries, len(vectors)), replace=False)]
        show(
            f"Real embeddings: glyph catalog, {len(vectors)} × {vectors.shape[1]} (recall is meaningful here)",
            measure(vectors, queries),
        )
    sizes = [20_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    for n in sizes:
        data = clustered(n + args.queries, 128)
        show(f"Synthetic clustered vectors: {n} × 128 (speed only)", measure(data[:n], data[n:]))


if __name__ == "__main__":
    main()
