"""A stream of adds (issue 61): what merges cost when a catalog takes changes one after another.

For each factory and merge policy a version of `--size` unit vectors (`--dim`-d, S = `--shards`;
clustered around shared centres as embeddings are, or i.i.d. with `--data uniform`)
is built with the bench helpers, then `--adds` adds of `--rows` rows each
(`index.changes.add.add_vectors`, what `index add` publishes after embedding), one after another:

- `whole` — today's: a shard past `--max-segments` compacted whole before the add returns;
- `tiered` — `index.versions.merge_policy.TieredMergePolicy`'s merges, in a background process
  after each add publishes (the run waits for the last one before measuring).

Reported: write amplification (bytes written by the adds and the merges they set off ÷ bytes of
the float rows added: the changes' `bytes_written`, the background merges' from merges.jsonl),
add p50/p99 (an add's call, with a whole compaction when it sets one off), the most segments a
shard held after any add, whether Flat answers equal exact search after the stream, and ANN
recall@10 of the streamed version against the same rows compacted into one segment a shard.

    python -m benchmarks.bench_stream                                    # 200k rows, 40 adds of 100
    python -m benchmarks.bench_stream --size 1000000 --adds 200 --factories flat,hnsw32 --shards 1,4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.bench_segments import build, catalog_items, ids_of, recall, searches, unit_vectors
from benchmarks.bench_shards import clustered_part
from benchmarks.harness import markdown_table
from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.retrieval.vectors import exact_search
from index.changes.add import add_vectors
from index.changes.lifecycle import compact_if_due, compact_version
from index.changes.merges import merge_due, merge_lock, merge_records
from index.versions.merge_policy import TieredMergePolicy
from index.versions.units import segment_counts
from index.versions.version import IndexVersion

FACTORIES = {"flat": ("Flat", {}), "hnsw32": ("HNSW32", {"efSearch": 64})}
WHOLE, TIERED = "whole", "tiered"


def _add(root: Path, policy: str, vectors: np.ndarray, first: int, max_segments: int) -> tuple[float, int, int | None]:
    """One add: its seconds (with the whole compaction it sets off), bytes written, merge pid."""
    items = catalog_items(first, len(vectors))
    started = time.perf_counter()
    if policy == TIERED:
        report = add_vectors(root, vectors, items, keep=3, tiers=TieredMergePolicy())
        return time.perf_counter() - started, report.bytes_written, report.merge_pid
    report = add_vectors(root, vectors, items, keep=3, compact=False)
    compacted = compact_if_due(root, 3, max_segments, 0.2)  # what add_vectors runs after its publish
    written = report.bytes_written + (compacted.bytes_written if compacted is not None else 0)
    return time.perf_counter() - started, written, None


def _wait_for_merges(root: Path, pids: list[int]) -> None:
    """Until every background merge has ended and none is due."""
    for pid in pids:
        try:
            psutil.Process(pid).wait(3600)
        except psutil.NoSuchProcess:
            pass
    with merge_lock(root, wait=True):
        pass
    assert not merge_due(IndexVersion.open(root), TieredMergePolicy()), "a merge is still due after the stream"


def _flat_exact(version: IndexVersion, queries: np.ndarray) -> bool:
    """Flat answers after the stream are exact search's (ids, top 10)."""
    _, _, found = searches(version, queries, 2)
    _, exact = exact_search(version.vectors, queries, 10, version.live_mask)
    return ids_of(version, found) == ids_of(version, list(exact))


def vectors_of(args, rng: np.random.Generator, part: int, count: int) -> np.ndarray:
    """`count` unit vectors: i.i.d. (`--data uniform`, where no ANN index finds much), or around
    bench_shards' shared centres (`clustered`, as embeddings are), each part drawn apart."""
    if args.data == "uniform":
        return unit_vectors(rng, count, args.dim)
    return clustered_part(part, count, args.dim, args.seed)


def stream(root: Path, args, factory: str, params: dict, shards: int, policy: str) -> dict:
    rng = np.random.default_rng(args.seed)
    build(root, vectors_of(args, rng, 0, args.size), factory, params, shards)
    seconds, written, pids, most = [], 0, [], 0
    for number in range(args.adds):
        added = vectors_of(args, rng, 1 + number, args.rows)
        took, wrote, pid = _add(root, policy, added, args.size + number * args.rows, args.max_segments)
        seconds.append(took)
        written += wrote
        pids += [pid] if pid is not None else []
        most = max(most, *segment_counts(IndexManifest.read(artifacts.version_dir(root))))
    if policy == TIERED:
        _wait_for_merges(root, pids)
        written += sum(record["bytes_written"] for record in merge_records(root))
    live = IndexVersion.open(root).load()
    queries = vectors_of(args, rng, 1 + args.adds, args.queries)
    row = {"factory": factory, "S": shards, "policy": policy, "rows added": args.adds * args.rows,
           "WA": written / (args.adds * args.rows * args.dim * 4), "MB written": written / 1e6,
           "add p50 s": float(np.percentile(seconds, 50)), "add p99 s": float(np.percentile(seconds, 99)),
           "most segments": most, "merges": len(merge_records(root)) if policy == TIERED else None}  # fmt: skip
    if factory == "Flat":
        row["Flat = exact"] = _flat_exact(live, queries)
    else:
        row["recall@10"] = recall(live, queries, searches(live, queries, 2)[2])
        compact_version(root, keep=3, on_ray=False)
        compacted = IndexVersion.open(root).load()
        row["recall@10 compacted"] = recall(compacted, queries, searches(compacted, queries, 2)[2])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=200_000, help="rows of the version the stream adds to")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--data", choices=("clustered", "uniform"), default="clustered", help="how the rows are drawn")
    parser.add_argument("--adds", type=int, default=40, help="adds, one after another")
    parser.add_argument("--rows", type=int, default=100, help="rows an add")
    parser.add_argument("--factories", default="flat", help=f"comma-separated, of {','.join(FACTORIES)}")
    parser.add_argument("--shards", default="1", help="comma-separated shard counts")
    parser.add_argument("--policies", default=f"{WHOLE},{TIERED}", help="whole (today's), tiered, or both")
    parser.add_argument("--max-segments", type=int, default=16, help="whole: compact a shard past this many")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="where the versions are written (default: a temp dir)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for name in args.factories.split(","):
            factory, params = FACTORIES[name]
            for shards in map(int, args.shards.split(",")):
                for policy in args.policies.split(","):
                    root = Path(work) / f"{name}-{shards}-{policy}"
                    rows.append(stream(root, args, factory, params, shards, policy))
                    print(markdown_table(rows[-1:]), flush=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
