"""Looking up ids in a segmented version (issue 61): what an add checks before it embeds.

A version of `--size` unit vectors is built, then grown by `--segments` adds into as many
segments, and a catalog of every id it holds plus `--absent` new ones is looked up, as
`index add` of a catalog re-sent whole asks (`--upsert`, or the rows it skips):

- `one id a call`: `IndexVersion.row_of` for each id (each a search of every segment's lookup);
- `batched`: `IndexVersion.live_rows` over the whole catalog (one numpy pass a segment), where
  this commit has it.

Reported: µs an id and seconds for the whole catalog (one id a call is timed on a random sample
of `--sample` ids and scaled), the ratio, and µs of one `row_of` (what an item query or an
exclusion by id costs a search). Both answers agree on the sample.

    python -m benchmarks.bench_id_lookup                      # 200k rows, 20 segments
    python -m benchmarks.bench_id_lookup --size 1000000 --segments 40
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_segments import build, catalog_items, unit_vectors
from benchmarks.harness import markdown_table
from index.changes.add import add_vectors
from index.versions.version import IndexVersion


def grown(root: Path, size: int, segments: int, dim: int) -> IndexVersion:
    """A Flat version of `size` rows: half built at once, the rest in `segments` adds."""
    rng = np.random.default_rng(0)
    first = size // 2
    build(root, unit_vectors(rng, first, dim), "Flat", {}, 1)
    per_add = (size - first) // segments
    for number in range(segments):
        start = first + number * per_add
        add_vectors(root, unit_vectors(rng, per_add, dim), catalog_items(start, per_add), keep=2, compact=False)
    return IndexVersion.open(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=200_000)
    parser.add_argument("--segments", type=int, default=20)
    parser.add_argument("--absent", type=int, default=1_000, help="ids of the catalog the version does not hold")
    parser.add_argument("--sample", type=int, default=2_000, help="ids timed one a call")
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        version = grown(Path(folder), args.size, args.segments, args.dim)
        held = len(version.items)
        ids = [f"item-{i}" for i in range(held + args.absent)]
        sample = [ids[i] for i in np.random.default_rng(1).choice(len(ids), args.sample, replace=False)]
        version.row_of(ids[0])  # the lookups mapped and the first segment's items read, outside the timing
        started = time.perf_counter()
        one_by_one = [version.row_of(item_id) for item_id in sample]
        per_call = (time.perf_counter() - started) / len(sample)
        rows = [{"lookup": "one id a call", "µs an id": per_call * 1e6, "whole catalog s": per_call * len(ids)}]
        if hasattr(version, "live_rows"):
            started = time.perf_counter()
            batched = version.live_rows(ids)
            seconds = time.perf_counter() - started
            by_id = dict(zip(ids, batched.tolist(), strict=True))
            assert [None if by_id[i] < 0 else by_id[i] for i in sample] == one_by_one, "the two lookups disagree"
            rows.append({"lookup": "batched", "µs an id": seconds / len(ids) * 1e6, "whole catalog s": seconds})
            rows[-1]["vs one id a call"] = per_call * len(ids) / seconds
        print(f"{held:,} rows in {len(version.segment_entries)} segments; a catalog of {len(ids):,} ids")
        print(markdown_table(rows))


if __name__ == "__main__":
    main()
