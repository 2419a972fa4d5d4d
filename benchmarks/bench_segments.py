"""Segments at catalog scale: what a change costs, and what searching several segments costs.

For each factory (Flat; IVF-PQ32 re-ranked) and shard count (S = 1, 4) a version of `--size`
unit vectors is built, then, each against its own baseline measured in the same run:

- an add of `--add` rows (`index.changes.add.add_vectors`, as `index add` publishes after embedding):
  seconds and bytes written, against the version's bytes (what an add cost before segments:
  every byte of it rewritten);
- a removal of `--remove` ids (`index.changes.lifecycle.remove_items`): seconds and bytes written;
- search over the base segment plus `--segments` small ones (adds of `--segment-rows` rows)
  against the same rows compacted into one segment: q/s at `--concurrency` callers, one query a
  call (`search_within` with the version's tombstones masked, as the server's engine calls it),
  Flat answers compared to the id and ANN recall@10 against exact search;
- the compaction itself (`index.changes.lifecycle.compact_version`, on Ray, one task a shard): seconds,
  and the p99 of a paced search load (one caller, BESIDE_QPS) beside it against the same load's
  p99 for `--beside-s` seconds before;
- a reload after an add of `--reload-rows` rows: seconds to open and load the new version in a
  process holding the old one, and its RSS growth against the new rows' bytes.

    python -m benchmarks.bench_segments                     # 1M × 128-d
    python -m benchmarks.bench_segments --size 100000 --factories flat --shards 1
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import numpy as np
import psutil

from core.artifacts.index_manifest import RowCounts
from core.data.items import ItemTable
from core.retrieval.vectors import exact_search, l2_normalized
from index.build.gate import GateThresholds
from index.build.publish import IndexRecipe, NewVersion, PublishTarget, publish_index_version
from index.changes.add import add_vectors
from index.changes.lifecycle import compact_version, remove_items
from index.search.ann_recall import recall_with_ties, scores_of_rows
from index.search.faiss_search import search_live
from index.versions.version import IndexVersion

FACTORIES = {"flat": ("Flat", {}), "ivf-pq": ("IVF{lists},PQ32", {"rerank": 10})}  # name → factory, parameters
BESIDE_QPS = 5.0  # the paced search load beside the compaction (one caller)
GATE = GateThresholds(
    ks=(1,), quality_sample=200, ann_k=10, min_ann_recall=0.0, min_probe_recall_at_1=0.0, max_recall_drop=None
)


def catalog_items(first: int, count: int) -> ItemTable:
    return ItemTable(
        ids=(f"item-{i}" for i in range(first, first + count)),
        labels=None,
        paths=(f"/catalog/{i}.jpg" for i in range(first, first + count)),
        metadata=({} for _ in range(count)),
    )


def unit_vectors(rng: np.random.Generator, count: int, dim: int) -> np.ndarray:
    return l2_normalized(rng.standard_normal((count, dim), dtype=np.float32))


def build(root: Path, vectors: np.ndarray, factory: str, params: dict, shards: int) -> float:
    started = time.perf_counter()
    new = NewVersion("bench-model", vectors, catalog_items(0, len(vectors)), "/catalog.csv",
                     RowCounts(len(vectors), len(vectors)), started, 0.0)  # fmt: skip
    (root / "model").mkdir(parents=True, exist_ok=True)
    recipe = IndexRecipe(factory, params, min(len(vectors), 100_000), "cpu", 0.9, shards)
    publish_index_version(new, recipe, GATE, None, [], None, PublishTarget(root, 50, str(root / "model"), {}))
    return time.perf_counter() - started


def version_bytes(version: IndexVersion) -> int:
    return sum(p.stat().st_size for p in version.directory.rglob("*") if p.is_file())


def searches(version: IndexVersion, queries: np.ndarray, concurrency: int, k: int = 10) -> tuple[float, list, list]:
    """q/s of one-query calls from `concurrency` threads, each call's seconds, and the answers:
    searched as the server's engine searches a plain query (`SearchEngine.search`: `search_live`,
    the index asked deeper by the version's few tombstones)."""
    searched, stored, live, deleted = version.searchable(), version.vectors, version.live_mask, len(version.deleted)

    def one(query: np.ndarray) -> tuple[float, np.ndarray]:
        started = time.perf_counter()
        found = search_live(searched, stored, query[None], k, live, deleted)[1]
        return time.perf_counter() - started, found[0]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, queries))
    seconds = time.perf_counter() - started
    return len(queries) / seconds, [d[0] for d in done], [d[1] for d in done]


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) * 1e3


def recall(version: IndexVersion, queries: np.ndarray, found: list[np.ndarray], k: int = 10) -> float:
    """ANN recall@k of `found` against exact search over the version's live rows."""
    stored = version.vectors
    # Segment by segment where the maps lie: a joined product of 2,000 queries with 1M rows and
    # its argsort were 24 GB (the VM's memory) before the first row was ranked.
    exact_scores, exact = exact_search(stored, queries, k, version.live_mask)
    found_rows = np.stack(found)
    found_scores = scores_of_rows(stored, queries, found_rows)
    lines = zip(found_rows, found_scores, exact, exact_scores, strict=True)
    return float(np.mean([recall_with_ties(f, fs, e, es, k) for f, fs, e, es in lines]))


def ids_of(version: IndexVersion, found: list[np.ndarray]) -> list[list[str]]:
    return [[version.items.ids[int(r)] for r in line if r >= 0] for line in found]


def measure(root: Path, args, factory: str, params: dict, shards: int, rng: np.random.Generator) -> dict:
    dim = args.dim
    row: dict = {"factory": factory, "shards": shards}
    base = unit_vectors(rng, args.size, dim)
    row["build_s"] = build(root, base, factory, params, shards)
    live = IndexVersion.open(root).load()
    row["version_mb"] = version_bytes(live) / 1e6
    next_id = args.size

    # An add, then a removal: what each writes.
    added = add_vectors(root, unit_vectors(rng, args.add, dim), catalog_items(next_id, args.add), gate=GATE, keep=50,
                        max_segments=10_000)  # fmt: skip
    next_id += args.add
    row["add_s"], row["add_written_mb"] = added.seconds, added.bytes_written / 1e6
    victims = [f"item-{i}" for i in rng.choice(args.size, args.remove, replace=False)]
    removed = remove_items(root, victims, "bench", "bench_segments", keep=50, max_deleted_fraction=1.0)
    row["remove_s"], row["remove_written_mb"] = removed.seconds, removed.bytes_written / 1e6

    # More small segments; search them against the same rows compacted.
    for _ in range(args.segments - 1):
        add_vectors(root, unit_vectors(rng, args.segment_rows, dim), catalog_items(next_id, args.segment_rows), keep=50,
                    max_segments=10_000)  # fmt: skip
        next_id += args.segment_rows
    segmented = IndexVersion.open(root).load()
    queries = unit_vectors(rng, args.queries, dim)
    qps_seg, _, found_seg = searches(segmented, queries, args.concurrency)
    qps_seg, _, found_seg = searches(segmented, queries, args.concurrency)  # warm, then measured

    # Compaction, with a steady search load beside it: its p99 before and during.
    def steady(seconds: float | None, stop: threading.Event | None = None) -> list[float]:
        """One caller at BESIDE_QPS: a paced load whose latency the compaction may move (a
        saturating one starves the compaction's task on a small machine and measures that)."""
        calls: list[float] = []
        started = time.perf_counter()
        for n in range(10**9):
            stopped = stop is not None and stop.is_set()
            if stopped or (seconds is not None and time.perf_counter() - started > seconds):
                break
            calls.extend(searches(segmented, queries[n % len(queries)][None], 1)[1])
            time.sleep(max(0.0, started + (n + 1) / BESIDE_QPS - time.perf_counter()))
        return calls

    before = steady(args.beside_s)
    stop, beside = threading.Event(), []
    thread = threading.Thread(target=lambda: beside.extend(steady(None, stop)))
    thread.start()
    started = time.perf_counter()
    compacted_report = compact_version(root, keep=50)
    row["compact_s"] = time.perf_counter() - started
    stop.set()
    thread.join()
    row["compact_peak_task_mb"] = compacted_report.peak_task_rss / 1e6 if compacted_report else float("nan")
    row["p99_before_ms"], row["p99_during_ms"] = p99(before), p99(beside)

    compacted = IndexVersion.open(root).load()
    searches(compacted, queries, args.concurrency)
    qps_one, _, found_one = searches(compacted, queries, args.concurrency)
    row["segments"] = sum(len(e.segments or [None]) for e in segmented.manifest.shards) if shards > 1 else len(
        segmented.manifest.segments)  # fmt: skip
    row["qps_segmented"], row["qps_compacted"] = qps_seg, qps_one
    if factory == "Flat":
        pairs = zip(ids_of(segmented, found_seg), ids_of(compacted, found_one), strict=True)
        row["same_ids"] = float(np.mean([a == b for a, b in pairs]))
    else:
        row["recall_segmented"] = recall(segmented, queries, found_seg)
        row["recall_compacted"] = recall(compacted, queries, found_one)

    # A reload after an add of --reload-rows rows, in this process that holds the compacted version.
    compacted.searchable()
    add_vectors(root, unit_vectors(rng, args.reload_rows, dim), catalog_items(next_id, args.reload_rows), keep=50,
                max_segments=10_000)  # fmt: skip
    rss = psutil.Process().memory_info().rss
    started = time.perf_counter()
    reloaded = IndexVersion.open(root).load()
    reloaded.searchable()
    row["reload_s"] = time.perf_counter() - started
    row["reload_rss_mb"] = (psutil.Process().memory_info().rss - rss) / 1e6
    row["reload_new_rows_mb"] = args.reload_rows * dim * 4 / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--add", type=int, default=10, help="rows of the measured add")
    parser.add_argument("--remove", type=int, default=10, help="ids of the measured removal")
    parser.add_argument("--segments", type=int, default=10, help="small segments beside the base one")
    parser.add_argument("--segment-rows", type=int, default=100, help="rows of each small segment")
    parser.add_argument("--reload-rows", type=int, default=1000, help="rows of the add before the reload")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--beside-s", type=float, default=20.0, help="seconds of search load before compaction")
    parser.add_argument("--factories", default="flat,ivf-pq", help="comma-separated: flat (Flat), ivf-pq (IVF,PQ32)")
    parser.add_argument("--shards", default="1,4", help="comma-separated shard counts")
    parser.add_argument("--work-dir", default=None, help="where the versions are written (default: a temp dir)")
    args = parser.parse_args()
    wanted = args.factories.split(",")
    unknown = [f for f in wanted if f not in FACTORIES]
    if unknown:
        parser.error(f"unknown factory(ies) {', '.join(unknown)}; measured: {', '.join(FACTORIES)}")
    shard_counts = [int(s) for s in args.shards.split(",")]
    if args.size < 1000 or args.remove >= args.size or min(shard_counts) < 1:
        parser.error("--size must be at least 1000, --remove below it, --shards at least 1")
    faiss.omp_set_num_threads(2)
    lists = int(max(16, min(4 * np.sqrt(args.size), 4096)))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for name in wanted:
            template, params = FACTORIES[name]
            factory = template.format(lists=lists)
            for shards in shard_counts:
                rng = np.random.default_rng(0)
                root = Path(work) / f"{name}-{shards}"
                row = measure(root, args, factory, params, shards, rng)
                rows.append(row)
                print(row, flush=True)
    print(f"\nSegments at {args.size:,} × {args.dim}-d: an add of {args.add} rows, a removal of {args.remove} ids, "
          f"search over 1 + {args.segments - 1} small segments ({args.segment_rows} rows) against the compacted "
          f"version at c = {args.concurrency}")  # fmt: skip
    print("| factory | S | version MB | add s | add wrote MB | remove s | remove wrote MB | segments | q/s segmented | "
          "q/s compacted | ratio | answers | compaction s | peak MB a task | p99 before / during ms | reload s | "
          "reload RSS MB (new rows MB) |")  # fmt: skip
    print("|" + "---|" * 17)
    for r in rows:
        answers = (f"{r['same_ids']:.1%} same ids" if "same_ids" in r
                   else f"R@10 {r['recall_segmented']:.4f} vs {r['recall_compacted']:.4f}")  # fmt: skip
        print(
            f"| {r['factory']} | {r['shards']} | {r['version_mb']:,.0f} | {r['add_s']:.2f} | "
            f"{r['add_written_mb']:.3f} | "
            f"{r['remove_s']:.2f} | {r['remove_written_mb']:.3f} | {r['segments']} | {r['qps_segmented']:,.0f} | "
            f"{r['qps_compacted']:,.0f} | {r['qps_segmented'] / r['qps_compacted']:.2f}× | {answers} | "
            f"{r['compact_s']:.1f} | {r['compact_peak_task_mb']:,.0f} | {r['p99_before_ms']:.1f} / "
            f"{r['p99_during_ms']:.1f} | {r['reload_s']:.2f} | {r['reload_rss_mb']:.1f} "
            f"({r['reload_new_rows_mb']:.1f}) |"
        )


if __name__ == "__main__":
    main()
