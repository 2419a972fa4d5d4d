"""Filtered search: recall@10 against exact filtered search and queries/s at selectivities 50%,
10%, 1%, 0.1% and 0.01% for Flat, IVF-Flat and HNSW, each path of the planner measured
(exact search over the matching rows, and the index's own search with an id selector), the
unfiltered search of the same index in the same run as the baseline.

The vectors are bench_ann.py's grown glyph set (real embeddings from the demo model, queries
are further-jittered glyphs not in the database). The categories are synthetic with known
sizes: every row gets a rank in a random permutation (an int field declared filterable), and
"selectivity s" is the filter `rank < s·n` — exactly s·n rows, spread over the vectors
independently of where they lie (no correlation between filter and neighbourhoods, the case
where a graph walk or a list probe finds matches least often). Masks come from the real
value → rows structure (`index/search/filters.py`), searches from the function the server calls
(`index/search/faiss_search.py: search_within`): all queries of one filter in one call, as the engine
groups a batch's queries that share a filter, and as the unfiltered baseline searches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `serving serve` sets it: idle threads do not spin

import faiss
import numpy as np

from benchmarks.bench_ann import grown_glyph_embeddings
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.embedder import OnnxEmbedder
from index.search import faiss_search
from index.search.faiss_index import apply_search_params, build_index
from index.search.faiss_search import EXACT_BELOW, exact_within, index_family, search_within
from index.search.filters import Condition, Filter, FilterIndex, Range, parse_filterable

ROOT = Path(__file__).resolve().parents[1]

SELECTIVITIES = (0.5, 0.1, 0.01, 0.001, 0.0001)


def factories(n: int) -> list[tuple[str, dict]]:
    lists = int(max(16, min(4 * np.sqrt(n), 4096)))  # bench_ann.py's choice
    return [("Flat", {}), (f"IVF{lists},Flat", {"nprobe": 32}), ("HNSW32", {"efSearch": 64})]


def vectors_of(n: int, queries: int, run: Path, cache: Path | None) -> np.ndarray:
    """n + queries grown glyph embeddings (the last `queries` are the queries), cached as .npy."""
    path = cache / f"grown-{n + queries}.npy" if cache else None
    if path is not None and path.is_file():
        return np.load(path)
    vectors, _ = grown_glyph_embeddings(OnnxEmbedder(run / "model", provider="cpu"), n + queries)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors)
    return vectors


def rank_structure(n: int) -> FilterIndex:
    """One int field, `rank`: row r's place in a fixed random permutation."""
    ranks = np.random.default_rng(7).permutation(n)
    items = ItemTable(
        ids=[str(r) for r in range(n)],
        labels=None,
        paths=[""] * n,
        metadata=({"rank": str(int(v))} for v in ranks),
    )
    return FilterIndex.build(items, parse_filterable(["rank:int"]))


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls, and the last call's answer."""
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Recall@k against exact filtered search (truth's -1 places, fewer matches than k, left out)."""
    values = []
    for f, t in zip(found, truth, strict=True):
        t = set(t[t >= 0].tolist())
        if t:
            values.append(len(t & set(f.tolist())) / len(t))
    return float(np.mean(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", default="runs/demo", help="demo run with model/")
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--cache", type=Path, default=None, help="folder to keep the rendered embeddings in")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widen-power", type=float, default=faiss_search.WIDEN_POWER)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here too")
    parser.add_argument("--selectivities", default=",".join(map(str, SELECTIVITIES)))
    parser.add_argument("--factories", default="Flat,IVF,HNSW", help="which of Flat, IVF, HNSW to measure")
    args = parser.parse_args()
    faiss.omp_set_num_threads(args.threads)
    faiss_search.WIDEN_POWER = args.widen_power
    n, k = args.size, 10
    started = time.perf_counter()
    data = vectors_of(n, args.queries, ROOT / args.run, args.cache)
    stored, queries = l2_normalized(data[:n]), l2_normalized(data[n:])
    print(f"{n:,} × {stored.shape[1]} vectors, {len(queries)} queries ({time.perf_counter() - started:.0f} s)")
    started = time.perf_counter()
    structure = rank_structure(n)
    print(f"value → rows structure of 1 int field over {n:,} rows: {time.perf_counter() - started:.1f} s")
    masks, truths = {}, {}
    selectivities = [float(v) for v in args.selectivities.split(",")]
    for s in selectivities:
        query = Filter(must=(Condition("rank", range=Range(lt=s * n)),))
        mask_s, masks[s] = timed(lambda q=query: structure.mask(q), args.repeats)
        _, (_, truths[s]) = timed(lambda s=s: exact_within(stored, queries, k, np.flatnonzero(masks[s])), 1)
        print(f"  mask {s:.2%}: {int(masks[s].sum()):,} rows, built in {mask_s * 1e3:.1f} ms")
    rows = []
    for factory, params in factories(n):
        if not any(factory.startswith(f) for f in args.factories.split(",")):
            continue
        started = time.perf_counter()
        index = build_index(stored, factory, params, train_size=min(n, 100_000), device="cpu")
        print(f"\n{factory} {params} built in {time.perf_counter() - started:.0f} s")
        apply_search_params(index, params)
        index.search(queries[:10], k)
        plain_s, _ = timed(lambda index=index: index.search(queries, k), args.repeats)
        plain_qps = len(queries) / plain_s
        print(f"  unfiltered: {plain_qps:,.0f} q/s")
        for s in selectivities:
            row = {"factory": factory, "params": params, "selectivity": s, "unfiltered_qps": plain_qps}
            for path, threshold in (("exact", 1.0), ("index", 0.0)):
                if path == "exact" and s > 0.3 and factory != "Flat":
                    continue  # exact over half the rows of a 1M index is Flat's own cost: measured on Flat
                seconds, (_, found, taken) = timed(
                    lambda idx=index, m=masks[s], t=threshold: search_within(idx, stored, queries, k, m, t),
                    args.repeats,
                )
                if taken != path:  # fewer rows than k match: always searched exactly
                    continue
                row[f"{path}_qps"] = len(queries) / seconds
                row[f"{path}_recall"] = recall(found, truths[s])
            chosen = "exact" if s <= EXACT_BELOW[index_family(index)] else "index"
            row["planner"] = chosen
            rows.append(row)
            shown = "  ".join(
                f"{p}: {row[f'{p}_qps']:,.0f} q/s recall {row[f'{p}_recall']:.3f}"
                for p in ("exact", "index")
                if f"{p}_qps" in row
            )
            print(f"  {s:>7.2%}  {shown}  → planner: {chosen}, {row[f'{chosen}_qps'] / plain_qps:.2f}× unfiltered")
        del index
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
