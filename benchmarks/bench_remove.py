"""Takedowns at catalog scale: the time from a RemoveItems call to the server answering from the
new version, for each index type, at 1M items.

For each factory an index version of `--size` unit vectors is published (random vectors: the
cost of a removal depends on the index's size and type, not on its neighbour structure), then
`--remove` random ids are taken down as `RemoveItems` does it — `index.lifecycle.remove_items`
publishes the new version, then the server's swap loads it (`IndexVersion.load` + `searchable`;
the model's sessions are kept across a swap for the same model, so they cost nothing here). For
HNSW it also measures the alternative to masking: rebuilding the graph without the removed rows
(`--compact`), which is what a takedown would cost if HNSW had no tombstones.

    python benchmarks/bench_remove.py                       # 1M × 128-d, 1,000 ids removed
    python benchmarks/bench_remove.py --size 100000 --factories Flat,HNSW32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from core.items import ItemTable
from core.manifests import RowCounts
from index.config import BuildConfig
from index.lifecycle import how_rows_leave, remove_items
from index.publish import NewVersion, publish_index_version
from index.version import IndexVersion

ROOT = Path(__file__).resolve().parents[1]


def factories(n: int) -> dict[str, dict]:
    lists = int(max(16, min(4 * np.sqrt(n), 4096)))
    return {
        "Flat": {},
        f"IVF{lists},Flat": {"nprobe": 32},
        f"IVF{lists},PQ32np": {"nprobe": 64, "rerank": 20},
        "HNSW32": {"efSearch": 64},
    }


def publish(root: Path, vectors: np.ndarray, factory: str, params: dict) -> float:
    n = len(vectors)
    items = ItemTable(
        ids=(f"item-{i}" for i in range(n)),
        labels=None,
        paths=(f"/catalog/{i}.jpg" for i in range(n)),
        metadata=({} for _ in range(n)),
    )
    cfg = BuildConfig(
        model=str(root / "model"),
        index_root=str(root),
        factory=factory,
        search_params=params,
        train_size=min(n, 100_000),
        device="cpu",
        quality_sample=200,
        min_ann_recall=0.0,  # a takedown's cost is measured, not the index's recall on these vectors
    )
    started = time.perf_counter()
    new = NewVersion("bench-model", vectors, items, root / "catalog.csv", RowCounts(n, n), started, 0.0)
    publish_index_version(
        new, cfg.index_recipe, cfg.gate_thresholds, cfg.probe, cfg.filterable_fields, cfg.item_field, cfg.publish_target
    )
    return time.perf_counter() - started


def written_bytes(directory: Path) -> int:
    """Bytes the version wrote itself (hard links to its parent's files cost nothing)."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file() and p.stat().st_nlink == 1)


def takedown(root: Path, ids: list[str], **options) -> dict:
    started = time.perf_counter()
    report = remove_items(root, ids, who="bench", reason="bench_remove", **options)
    published = time.perf_counter()
    version = IndexVersion.open(root, report.version).load()
    version.searchable()
    swapped = time.perf_counter()
    return {
        "publish_s": published - started,
        "load_s": swapped - published,
        "total_s": swapped - started,
        "written_mb": written_bytes(version.directory) / 2**20,
        "deleted": len(version.deleted),
        "size": version.size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--remove", type=int, default=1000, help="ids taken down at once")
    parser.add_argument("--repeats", type=int, default=3, help="takedowns per factory (the median is shown)")
    parser.add_argument("--factories", default=None, help="comma-separated subset of the factories measured")
    parser.add_argument("--work-dir", default=None, help="where the versions are written (default: a temp dir)")
    args = parser.parse_args()
    chosen = factories(args.size)
    if args.factories:
        wanted = args.factories.split(",")
        unknown = [f for f in wanted if f not in chosen]
        if unknown:
            parser.error(f"unknown factory(ies) {','.join(unknown)}; measured: {','.join(chosen)}")
        chosen = {f: chosen[f] for f in wanted}
    if not 0 < args.remove < args.size:
        parser.error("--remove must be between 1 and --size")
    faiss.omp_set_num_threads(2)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.size, args.dim), dtype=np.float32)
    faiss.normalize_L2(vectors)
    # Disjoint id sets: one per takedown (and one more for HNSW's rebuild).
    picked = rng.permutation(args.size)[: args.remove * (args.repeats + 1)]
    id_sets = [[f"item-{i}" for i in np.sort(part)] for part in np.split(picked, args.repeats + 1)]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for factory, params in chosen.items():
            root = Path(work) / factory.replace(",", "_")
            build_s = publish(root, vectors, factory, params)
            runs = [takedown(root, ids) for ids in id_sets[: args.repeats]]
            measured = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
            how = how_rows_leave(IndexVersion.open(root).manifest)
            rows.append({"factory": factory, "how": how, "build_s": build_s, **measured})
            print(f"{factory}: built in {build_s:.1f} s; takedowns {runs}", flush=True)
            if how == "tombstone":
                compacted = takedown(root, id_sets[-1], compact=True)
                rows.append({"factory": f"{factory} (rebuilt)", "how": "rebuild", "build_s": build_s, **compacted})
                print(f"{factory}: takedown by rebuilding {compacted}", flush=True)
    print(f"\nTakedown of {args.remove:,} ids from {args.size:,} × {args.dim}-d, RemoveItems → swap")
    print(f"(median of {args.repeats} takedowns each; the rebuild: one)")
    head = f"{'publish s':>9} {'load s':>7} {'total s':>8} {'written MB':>10} {'vs Flat':>8}"
    print(f"  {'factory':<22} {'rows leave by':<13} {head}")
    flat = next((r["total_s"] for r in rows if r["factory"] == "Flat"), None)
    for r in rows:
        ratio = f"{r['total_s'] / flat:7.2f}×" if flat else "-"
        print(
            f"  {r['factory']:<22} {r['how']:<13} {r['publish_s']:9.2f} {r['load_s']:7.2f} {r['total_s']:8.2f} "
            f"{r['written_mb']:10.0f} {ratio:>8}"
        )


if __name__ == "__main__":
    main()
