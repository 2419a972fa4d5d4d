"""faiss index choice: build time, queries/s, recall@10 vs exact search, label Recall@1 and
the index's bytes per vector for Flat, IVF-Flat, IVF-PQ (alone and re-ranked exactly from the
memory-mapped stored vectors, as served) and HNSW at two search settings each, on real
embeddings.

Recall only means something on embeddings with real neighbour structure (uniform or synthetic
clustered vectors say nothing about it), so every figure is measured on glyphs embedded by the
demo model: the glyph catalog (116 characters × 170 faces), then the glyph set grown to 100k
and 1M images (`--sizes`): 302 characters (the base set plus accented Latin letters) in every
face that covers them, then the same pairs under random affine jitter — class = character,
so the neighbour structure is the real one. Queries are further jittered glyphs, not in the
database.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from core.data.catalog import read_catalog
from core.retrieval.vectors import exact_search, l2_normalized
from index.build.embed import embed_catalog
from index.embedder import OnnxEmbedder
from index.search.faiss_index import apply_search_params, build_index
from index.search.faiss_search import search, searchable

ROOT = Path(__file__).resolve().parents[1]


def factories(n: int) -> list[tuple[str, list[dict]]]:
    lists = int(max(16, min(4 * np.sqrt(n), 4096)))
    return [
        ("Flat", [{}]),
        (f"IVF{lists},Flat", [{"nprobe": 4}, {"nprobe": 32}]),
        (f"IVF{lists},PQ16np", [{"nprobe": 4, "rerank": 0}, {"nprobe": 32, "rerank": 0}, {"nprobe": 64, "rerank": 20}]),
        (
            f"IVF{lists},PQ32np",
            [{"nprobe": 32, "rerank": 0}, {"nprobe": 32, "rerank": 10}, {"nprobe": 64, "rerank": 20}],
        ),
        (f"IVF{lists},PQ64np", [{"nprobe": 32, "rerank": 10}]),
        ("HNSW32", [{"efSearch": 16}, {"efSearch": 128}]),
    ]


def grown_glyph_embeddings(embedder: OnnxEmbedder, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings and labels of `total` glyph images rendered in memory (never written)."""
    from training.data.glyphs import render_grown_glyphs

    vectors, labels = [], []
    for images, batch_labels in render_grown_glyphs(total):
        vectors.append(embedder.embed(images))
        labels += batch_labels
    return np.concatenate(vectors), np.asarray(labels)


def measure(
    vectors: np.ndarray, queries: np.ndarray, labels: np.ndarray, query_labels: np.ndarray, k: int = 10
) -> list[dict]:
    _, truth = exact_search(vectors, queries, k)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # Re-ranking reads the stored vectors as the server does: memory-mapped embeddings.npy.
        np.save(Path(tmp) / "embeddings.npy", l2_normalized(vectors))
        stored = np.load(Path(tmp) / "embeddings.npy", mmap_mode="r")
        for factory, settings in factories(len(vectors)):
            rows += measure_factory(factory, settings, vectors, stored, queries, truth, labels, query_labels, k)
    return rows


def measure_factory(factory, settings, vectors, stored, queries, truth, labels, query_labels, k) -> list[dict]:
    rows = []
    started = time.perf_counter()
    index = build_index(vectors, factory, train_size=min(len(vectors), 100_000), device="cpu")
    build_s = time.perf_counter() - started
    bytes_per_vector = faiss.serialize_index(index).nbytes / index.ntotal
    for params in settings:
        apply_search_params(index, params)
        searched = searchable(index, params, stored)
        search(searched, queries[:10], k)
        started = time.perf_counter()
        _, found = search(searched, queries, k)
        qps = len(queries) / (time.perf_counter() - started)
        recall = np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)])
        label_r1 = float(np.mean(labels[found[:, 0]] == query_labels))
        rows.append(
            {
                "factory": factory,
                "params": params,
                "build_s": build_s,
                "qps": qps,
                "recall": recall,
                "r1": label_r1,
                "bytes": bytes_per_vector,
            }
        )
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"  {'factory':<18} {'search':<26} {'build s':>8} {'queries/s':>10} {'recall@10':>10} {'label R@1':>10} "
        f"{'vs Flat q/s':>11} {'B/vector':>9}"
    )
    flat = next(r["qps"] for r in rows if r["factory"] == "Flat")
    for r in rows:
        params = ",".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        print(
            f"  {r['factory']:<18} {params:<26} {r['build_s']:8.2f} {r['qps']:10.0f} {r['recall']:10.3f} "
            f"{r['r1']:10.3f} {r['qps'] / flat:10.1f}× {r['bytes']:9.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", default="runs/demo", help="demo run with model/ (for real embeddings)")
    parser.add_argument("--sizes", default="100000,1000000", help="grown glyph set sizes")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="a quarter of the catalog, grown size 20000 only")
    args = parser.parse_args()
    faiss.omp_set_num_threads(2)
    run = ROOT / args.run
    if not (run / "model" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "scripts.demo", "--out", str(run)], check=True, cwd=ROOT)
    embedder = OnnxEmbedder(run / "model", provider="cpu")
    glyphs = ROOT / "data" / "glyphs" / "catalog.csv"
    rng = np.random.default_rng(1)
    if glyphs.is_file():
        catalog = read_catalog(glyphs)
        if args.quick:
            catalog = catalog.subset(range(0, len(catalog), 4))
        vectors, kept, _ = embed_catalog(catalog, embedder, progress=False)
        labels = np.asarray(catalog.subset(kept).labels)
        pick = rng.choice(len(vectors), size=min(args.queries, len(vectors)), replace=False)
        rest = np.setdiff1d(np.arange(len(vectors)), pick)
        show(
            f"Glyph catalog: {len(rest)} × {vectors.shape[1]}, {len(pick)} held-out glyphs as queries",
            measure(vectors[rest], vectors[pick], labels[rest], labels[pick]),
        )
    sizes = [20_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    for n in sizes:
        started = time.perf_counter()
        vectors, labels = grown_glyph_embeddings(embedder, n + args.queries)
        print(f"\n(rendered and embedded {len(vectors):,} glyphs in {time.perf_counter() - started:.0f} s)")
        show(
            f"Grown glyph set: {n:,} × {vectors.shape[1]}, {args.queries} jittered glyphs as queries",
            measure(vectors[:n], vectors[n:], labels[:n], labels[n:]),
        )


if __name__ == "__main__":
    main()
