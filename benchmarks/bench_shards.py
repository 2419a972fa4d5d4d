"""Sharded index versions (issue 42): what building S shards in parallel on Ray buys, what one
shard's build holds in memory, and what an exact re-rank costs over a plain PQ search.

    python -m benchmarks.bench_shards --part build     # S shards in parallel vs one after another
    python -m benchmarks.bench_shards --part rerank    # re-ranked IVF-PQ vs plain PQ, before/after
    python -m benchmarks.bench_shards --part merge     # S shards' merged search vs one index: equality, recall
    python -m benchmarks.bench_shards --part query     # serve --ray at S = 1, 2, 4 vs one process:
                                                       # embedding queries, then 224-px images
    python -m benchmarks.bench_shards --part reload    # serve --ray reloaded every 20 s under load
    python -m benchmarks.bench_shards --part all

Each part is a function over the same synthetic clustered vectors (`clustered_part`: shard i's
rows come from their own seed, so a shard's build generates only its rows and the single build
the concatenation of all); `PARTS` maps `--part` to them (the serving side's query-path parts
join it). The build part trains each factory once (as `index build --shards` does), then adds
each shard's rows into a copy of the trained index in a fresh Ray worker process (`max_calls=1`,
one CPU, so faiss runs one thread), all S at once and then one after another, and builds the
whole catalog once the same way; each build's peak memory is measured inside its process as the
rise of its peak resident set (`/proc/self/status` VmHWM, reset at the task's start) over its
resident set then. The ratio of parallel to sequential is at most min(S, cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import faiss
import numpy as np

from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import trained_index
from index.search.faiss_search import ExactRerank

CENTRES = 1000  # clusters in the synthetic data: an IVF's lists have real structure to find
DEFAULT_FACTORIES = ["IVF1024,Flat", "HNSW32", "Flat"]


def clustered_part(part: int, rows: int, dim: int, seed: int = 0) -> np.ndarray:
    """Shard `part`'s `rows` L2-normalised vectors around CENTRES shared centres."""
    centres = np.random.default_rng(seed).standard_normal((CENTRES, dim), dtype=np.float32)
    rng = np.random.default_rng(seed + 1 + part)
    out = np.empty((rows, dim), dtype=np.float32)
    for start in range(0, rows, 8192):  # in blocks: a build's peak memory is its rows, not temporaries
        block = centres[rng.integers(0, CENTRES, min(8192, rows - start))]
        block += 0.5 * rng.standard_normal(block.shape, dtype=np.float32)
        out[start : start + len(block)] = l2_normalized(block)
    return out


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """The peak resident set counted from now (Linux: 5 into clear_refs), where allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def build_part(trained: bytes, parts: list[int], rows: int, dim: int) -> dict[str, float]:
    """In a fresh worker: generate the rows of `parts` (one shard's, or every shard's for the
    single build), add them to a copy of the trained index; seconds and peak memory rise."""
    _reset_peak()
    before = _status_kb("VmRSS")
    started = time.perf_counter()
    vectors = np.concatenate([clustered_part(p, rows, dim) for p in parts])
    generated = time.perf_counter()
    index = faiss.deserialize_index(np.frombuffer(trained, dtype=np.uint8))
    index.add(vectors)
    done = time.perf_counter()
    return {
        "rows": float(index.ntotal),
        "add_s": done - generated,
        "total_s": done - started,
        "peak_mb": (_status_kb("VmHWM") - before) / 1024,
        "threads": float(faiss.omp_get_max_threads()),
    }


def run_build(rows: int, dim: int, shards: int, factories: list[str], train_size: int) -> list[dict]:
    """For each factory: the trained index once; S shard builds in parallel, the same S one
    after another, and the single build; their times and peak memory."""
    import ray

    ray.init(num_cpus=max(shards, os.cpu_count() or 1), log_to_driver=False, include_dashboard=False)
    task = ray.remote(num_cpus=1, max_calls=1)(build_part)
    per_shard = rows // shards
    results = []
    for factory in factories:
        started = time.perf_counter()
        sample = clustered_part(0, min(train_size, per_shard), dim)  # shard 0's rows: a random sample
        trained = faiss.serialize_index(trained_index(sample, factory, None, "cpu")).tobytes()
        train_s = time.perf_counter() - started
        ref = ray.put(trained)
        started = time.perf_counter()
        parallel = ray.get([task.remote(ref, [p], per_shard, dim) for p in range(shards)])
        parallel_s = time.perf_counter() - started
        started = time.perf_counter()
        sequential = [ray.get(task.remote(ref, [p], per_shard, dim)) for p in range(shards)]
        sequential_s = time.perf_counter() - started
        single = ray.get(task.remote(ref, list(range(shards)), per_shard, dim))
        results.append({
            "factory": factory, "train_s": train_s, "parallel_s": parallel_s, "sequential_s": sequential_s,
            "parallel_add_s": max(r["add_s"] for r in parallel),
            "sequential_add_s": sum(r["add_s"] for r in sequential),
            "single_add_s": single["add_s"], "shard_peak_mb": max(r["peak_mb"] for r in parallel + sequential),
            "single_peak_mb": single["peak_mb"], "threads": single["threads"],
        })  # fmt: skip
    ray.shutdown()
    return results


def show_build(results: list[dict], rows: int, dim: int, shards: int) -> None:
    cores = os.cpu_count() or 1
    print(f"\nparallel build: {rows:,} × {dim}-d, S = {shards} shards, {cores} cores "
          f"(parallel/sequential can be at most min(S, cores) = {min(shards, cores)}×); faiss threads a task: "
          f"{int(results[0]['threads']) if results else 1}")  # fmt: skip
    print(
        "| factory | train (once) | S in parallel | S one after another | speed-up | adds: parallel / sequential "
        "| single build's add | peak memory: a shard's build / the single build |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['factory']} | {r['train_s']:.1f} s | {r['parallel_s']:.1f} s | {r['sequential_s']:.1f} s "
            f"| {r['sequential_s'] / r['parallel_s']:.2f}× "
            f"| {r['parallel_add_s']:.1f} s / {r['sequential_add_s']:.1f} s "
            f"| {r['single_add_s']:.1f} s | {r['shard_peak_mb']:.0f} MB / {r['single_peak_mb']:.0f} MB "
            f"({r['shard_peak_mb'] / max(r['single_peak_mb'], 1e-9):.2f}) |"
        )


def gathered_rerank(rerank: ExactRerank, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The re-rank before issue 42: candidates gathered out of the map into a copy, multiplied."""
    _, candidates = rerank.index.search(queries, k * rerank.factor)
    found = candidates >= 0
    scores = np.einsum("qd,qcd->qc", queries, rerank.gather(np.where(found, candidates, 0)))
    scores[~found] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, top, axis=1), np.take_along_axis(candidates, top, axis=1)


def run_rerank(rows: int, dim: int, factory: str, nprobe: int, factor: int, k: int, queries: int) -> list[dict]:
    """Plain PQ search against the re-ranked one (before: gather; now: scored in the map), per
    query and in batches of 32, over vectors memory-mapped from a file as a version keeps them."""
    vectors = np.concatenate([clustered_part(p, rows // 4, dim) for p in range(4)])
    index = trained_index(vectors[: min(len(vectors), 100_000)], factory, None, "cpu")
    index.add(vectors)
    faiss.extract_index_ivf(index).nprobe = nprobe
    with tempfile.TemporaryDirectory() as folder:
        np.save(Path(folder) / "embeddings.npy", vectors)
        del vectors
        stored = np.load(Path(folder) / "embeddings.npy", mmap_mode="r")
        rerank = ExactRerank(index, stored, factor)
        rng = np.random.default_rng(7)
        q = l2_normalized(stored[rng.integers(0, len(stored), queries)] + 0.1 * rng.standard_normal((queries, dim)))
        q = q.astype(np.float32)
        assert (gathered_rerank(rerank, q, k)[1] == rerank.search(q, k)[1]).mean() > 0.999
        results = []
        for batch in (1, 32):
            timings = {}
            for name, search in (
                ("plain", lambda x: index.search(x, k)),
                ("before", lambda x: gathered_rerank(rerank, x, k)),
                ("after", lambda x: rerank.search(x, k)),
            ):
                search(q[:batch])  # warm
                best, calls = float("inf"), []
                for _ in range(3):  # the best of three rounds: a shared machine's noise is one-sided
                    started = time.perf_counter()
                    for i in range(0, len(q) - batch + 1, batch):
                        call = time.perf_counter()
                        search(q[i : i + batch])
                        calls.append(time.perf_counter() - call)
                    best = min(best, (time.perf_counter() - started) / (len(q) // batch * batch))
                timings[name] = best * 1e3
                if name == "after":  # a shard's latency tail, what the slowest of S shards draws from
                    timings.update({f"after_p{p}": float(np.percentile(calls, p)) * 1e3 for p in (50, 99, 99.9)})
            results.append({"batch": batch, **timings})
    return results


def show_rerank(results: list[dict], rows: int, dim: int, factory: str, nprobe: int, factor: int, k: int) -> None:
    print(f"\nexact re-rank: {rows:,} × {dim}-d {factory}, nprobe {nprobe}, k {k}, rerank {factor} "
          f"({factor * k} candidates), vectors memory-mapped; ms a query")  # fmt: skip
    print("| queries a call | plain PQ | re-ranked before (gather) | ratio | re-ranked now (in the map) | ratio "
          "| now, a call's p50 / p99 / p99.9 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['plain']:.3f} | {r['before']:.3f} | {r['before'] / r['plain']:.2f}× "
              f"| {r['after']:.3f} | {r['after'] / r['plain']:.2f}× "
              f"| {r['after_p50']:.3f} / {r['after_p99']:.3f} / {r['after_p99.9']:.3f} ms |")  # fmt: skip


def part_build(args: argparse.Namespace) -> None:
    factories = args.factory or DEFAULT_FACTORIES
    show_build(run_build(args.rows, args.dim, args.shards, factories, args.train_size), args.rows, args.dim,
               args.shards)  # fmt: skip


def part_rerank(args: argparse.Namespace) -> None:
    factory = f"IVF{args.nlist},PQ{args.pq}"
    results = run_rerank(args.rows, args.dim, factory, args.nprobe, args.rerank, 10, args.queries)
    show_rerank(results, args.rows, args.dim, factory, args.nprobe, args.rerank, 10)


# -- the query path (serving side): `serve --ray` at S = 1, 2, 4 against the single-process server


def grpc_load(port: int, requests: list, concurrency: int, seconds: float) -> dict[str, float]:
    """`concurrency` callers each sending one Search of `requests` (embeddings or images, k = 10)
    after another for `seconds` (after a warm-up): q/s, p50 and p99 of the calls, p50 of the
    server's search stage."""
    import grpc

    from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

    async def run() -> tuple[list[float], list[float], float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SimilaritySearchStub(channel)
            for r in requests[:20]:  # warm-up: connections, first batches
                await stub.Search(r, timeout=60)
            latencies: list[float] = []
            search_ms: list[float] = []
            stop = time.perf_counter() + seconds

            async def caller(c: int) -> None:
                i = c
                while time.perf_counter() < stop:
                    started = time.perf_counter()
                    answer = await stub.Search(requests[i % len(requests)], timeout=60)
                    latencies.append(time.perf_counter() - started)
                    search_ms.append(answer.timings.search_ms)
                    i += concurrency

            began = time.perf_counter()
            await asyncio.gather(*(caller(c) for c in range(concurrency)))
            return latencies, search_ms, time.perf_counter() - began

    latencies, search_ms, wall = asyncio.run(run())
    return {
        "qps": len(latencies) / wall,
        "p50_ms": float(np.percentile(latencies, 50)) * 1e3,
        "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
        "search_p50_ms": float(np.percentile(search_ms, 50)),
    }


def _scraped(metrics_port: int, keep: Callable[[str, dict[str, str]], bool]) -> dict[str, float]:
    """The ingress's /metrics samples that `keep(name, labels)` accepts, summed by sample name
    over their labels (prometheus_client's parser)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if keep(sample.name, sample.labels):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


SHARD_HISTOGRAMS = ("simsearch_shard_latency_seconds", "simsearch_shard_search_seconds")


def _histogram_means(metrics_port: int) -> dict[str, float]:
    """Mean seconds so far of the ingress's shard histograms (a search call's round trip, the
    search inside the shard), over every shard."""
    wanted = {f"{name}{part}" for name in SHARD_HISTOGRAMS for part in ("_sum", "_count")}
    sums = _scraped(metrics_port, lambda name, labels: name in wanted and labels.get("method", "search") == "search")
    return {name: sums.get(f"{name}_sum", 0.0) / max(sums.get(f"{name}_count", 0.0), 1.0) for name in SHARD_HISTOGRAMS}


MERGE_FACTORIES = [("IVF256,Flat", {"nprobe": 8}), ("IVF256,PQ16", {"nprobe": 8}), ("HNSW32", {"efSearch": 32})]


def publish_vectors(
    root: Path, vectors: np.ndarray, shards: int, factory: str = "Flat", params: dict | None = None,
    model: Path | None = None, grouped: bool = False, labels: list[str] | None = None,
) -> Path:  # fmt: skip
    """`vectors` published (live) as a version of `shards` shards in `root`, the search effort
    fixed (`params`), for `model` (else no model); with `grouped`, items of three rows (`item`)
    and a `shade` field to filter by, both declared filterable; with `labels`, a labelled
    version (each row's label: what Recall@K, probe and traffic, is scored by)."""
    from core.artifacts.index_manifest import RowCounts
    from core.artifacts.model_manifests import ModelManifest
    from core.data.items import ItemTable
    from index.build.gate import GateThresholds
    from index.build.publish import IndexRecipe, NewVersion, PublishTarget, publish_index_version
    from index.search.filters import parse_filterable

    rows = len(vectors)
    fields = [{"item": f"item{i // 3}", "shade": str(i % 3)} for i in range(rows)] if grouped else [{}] * rows
    items = ItemTable([f"id{i:07d}" for i in range(rows)], labels, [f"/images/{i}.png" for i in range(rows)], fields)
    new = NewVersion(
        model_id=ModelManifest.read(model).model_id if model else "bench-shards-0000", embeddings=vectors,
        items=items, catalog="/catalog.csv", rows=RowCounts(rows, rows), started=time.perf_counter(),
        embed_seconds=0.0,
    )  # fmt: skip
    gate = GateThresholds(
        ks=(1,), quality_sample=100, ann_k=10, min_ann_recall=0, min_probe_recall_at_1=0, max_recall_drop=None,
        force=False,
    )  # fmt: skip
    recipe = IndexRecipe(factory, params or {}, None, "cpu", 0.95, shards)
    specs, item_field = (parse_filterable(["item", "shade"]), "item") if grouped else ([], None)
    target = PublishTarget(root, 5, str(model or root), {})
    return publish_index_version(new, recipe, gate, None, specs, item_field, target)


def _share_equal(first: list, second: list) -> float:
    """The share of queries whose answers are equal, element by element."""
    return float(np.mean([np.array_equal(a, b) for a, b in zip(first, second, strict=True)]))


def flat_equality(pair: list, queries: np.ndarray) -> dict[str, float]:
    """Flat single index against its S shards' merged search: the share of queries answered with
    the same ids in the same order, plain, filtered and grouped by the item."""
    from index.search.faiss_search import search, search_within
    from index.search.grouping import search_groups

    plain, within, grouped = [], [], []
    for version in pair:
        ids = np.asarray(version.items.ids)
        plain.append(ids[search(version.searchable(), queries, 10)[1]])
        mask = np.zeros(len(ids), bool)
        mask[version.filters.fields["shade"].rows_equal("1")] = True
        within.append(ids[search_within(version.searchable(), version.vectors, queries, 10, mask)[1]])
        answers = search_groups(version.searchable(), version.vectors, queries, 5, version.groups("item"), per_group=2)
        grouped.append([[ids[r] for _, rows in a.groups for r, _ in rows] for a in answers])
    return {
        "plain": _share_equal(*plain),
        "filtered (shade = 1)": _share_equal(*within),
        "grouped by item (5 groups, 2 rows each)": _share_equal(*grouped),
    }


def run_merge(rows: int, dim: int, shards: int, count: int) -> dict:
    """The merged search of S shards against the single index on the same rows, `count` queries:
    Flat answers equal (ids and order) plain, filtered and grouped by the item; recall@10 against
    exact search of IVF-Flat, IVF-PQ (re-ranked) and HNSW at the same nprobe / efSearch."""
    from core.retrieval.vectors import exact_search
    from index.search.faiss_search import search
    from index.versions.version import IndexVersion

    vectors = np.concatenate([clustered_part(p, rows // 4, dim) for p in range(4)])
    near = vectors[np.random.default_rng(5).integers(0, len(vectors), count)]
    queries = l2_normalized(near + 0.3 * np.random.default_rng(6).standard_normal(near.shape, dtype=np.float32))
    truth = np.asarray([f"id{i:07d}" for i in range(len(vectors))])[exact_search(vectors, queries, 10)[1]]
    equal, recall = {}, []
    from benchmarks import harness

    with harness.local_ray(), tempfile.TemporaryDirectory() as tmp:
        for factory, params in [("Flat", {}), *MERGE_FACTORIES]:
            pair = []
            for s in (1, shards):
                root = Path(tmp) / f"{factory.replace(',', '_')}-{s}"
                published = publish_vectors(root, vectors, s, factory, params, grouped=True)
                pair.append(IndexVersion(published).load(dim=dim))
            if factory == "Flat":
                equal = flat_equality(pair, queries)
                continue
            score = []
            for version in pair:
                found = np.asarray(version.items.ids)[search(version.searchable(), queries, 10)[1]]
                score.append(float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])))
            recall.append({"factory": factory, "params": params, "single": score[0], "sharded": score[1]})
    return {"rows": len(vectors), "dim": dim, "shards": shards, "queries": count, "equal": equal, "recall": recall}


def show_merge(r: dict) -> None:
    print(f"\nmerged search: {r['rows']:,} × {r['dim']}-d, S = {r['shards']} against one index, "
          f"{r['queries']:,} queries")  # fmt: skip
    print("| Flat answers | equal to the single index's (ids and order) |")
    print("|---|---|")
    for kind, share in r["equal"].items():
        print(f"| {kind} | {share:.1%} |")
    print("\n| index | search effort | recall@10, single | recall@10, S shards | difference |")
    print("|---|---|---|---|---|")
    for row in r["recall"]:
        effort = ", ".join(f"{k} {v}" for k, v in row["params"].items())
        print(f"| {row['factory']} | {effort} | {row['single']:.4f} | {row['sharded']:.4f} "
              f"| {row['sharded'] - row['single']:+.4f} |")  # fmt: skip


def part_merge(args: argparse.Namespace) -> None:
    show_merge(run_merge(args.rows, args.dim, args.shards, args.merge_queries))


IMAGE_SIDE = 224  # the query model's input and the image queries' size: what users send


@contextlib.contextmanager
def query_cluster(dim: int) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A scratch folder, the query model in it, and a local Ray the servers join: the folder,
    the model, and the environment that points `serve --ray` at that Ray. The model takes
    224-px images and is cheap (tests/support/index.py: an average pool to 8×8 and one
    projection), so an image query's cost is what the server does around it — decoding, the
    pixels' trip to the embedder, the search — not a network's."""
    from benchmarks import harness
    from tests.support.index import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp, harness.local_ray() as env:
        folder = Path(tmp)
        yield folder, write_tiny_model(folder / "model", dim=dim, side=IMAGE_SIDE), env


def query_vectors(dim: int) -> np.ndarray:
    """The 512 queries every query-path part sends."""
    return l2_normalized(np.random.default_rng(99).standard_normal((512, dim)).astype(np.float32))


def query_requests(dim: int, kind: str) -> list:
    """The Search requests of one kind of query: the 512 embeddings, or 64 JPEG images of 224 px
    (about 10 kB each, `harness.photo_like_images`), k = 10."""
    from benchmarks import harness
    from protos.simsearch.v1 import search_pb2 as pb

    if kind == "embedding":
        return [pb.SearchRequest(embedding=pb.Embedding(values=q.tolist()), k=10) for q in query_vectors(dim)]
    images, _ = harness.photo_like_images(64, side=IMAGE_SIDE, seed=99)
    return [pb.SearchRequest(image=image, k=10) for image in images]


def run_query(
    rows: int, dim: int, shard_counts: list[int], concurrencies: list[int], seconds: float, ray_flags: list[str] = (),
    image_concurrencies: list[int] = (32,),
) -> list[dict]:  # fmt: skip
    """The single-process server, then `serve --ray` at each S, on the same vectors and model in
    the same run, each loaded with embedding queries at each concurrency, then with 224-px image
    queries at each of `image_concurrencies`; at the largest S and the least concurrency, what
    an embedding query's p50 is made of (from the ingress's shard metrics)."""
    from benchmarks import harness

    vectors = clustered_part(0, rows, dim)
    loads = [("embedding", c) for c in concurrencies] + [("image", c) for c in image_concurrencies]
    requests = {kind: query_requests(dim, kind) for kind in {kind for kind, _ in loads}}
    results = []
    with query_cluster(dim) as (folder, model, env):
        roots = {s: folder / f"s{s}" for s in sorted({1, *shard_counts})}
        for s, root in roots.items():
            publish_vectors(root, vectors, s, model=model)
        base = [sys.executable, "-m", "serving", "serve", "--port", "0", "--probe-interval-s", "0", "--processes", "1"]
        for label, s in [("single process", 1)] + [(f"serve --ray, S = {s}", s) for s in shard_counts]:
            metrics_port = harness.free_port()
            command = [*base, "--index-root", str(roots[s]), "--metrics-port", str(metrics_port)]
            if label != "single process":
                command += ["--ray", *ray_flags]
            proc, ports = harness.serving(command, env)
            try:
                for kind, c in loads:
                    figures = grpc_load(ports["port"], requests[kind], c, seconds)
                    means = _histogram_means(metrics_port) if label != "single process" else {}
                    results.append({"server": label, "shards": s, "query": kind, "concurrency": c, **figures, **means})
            finally:
                proc.terminate()
                proc.wait(120)
    return results


def show_query(results: list[dict], rows: int, dim: int) -> None:
    print(f"\nquery path: {rows:,} × {dim}-d Flat, k = 10, embedding queries and {IMAGE_SIDE}-px JPEG image queries "
          f"(a {IMAGE_SIDE}-px model: an average pool and one projection), {os.cpu_count()} cores "
          "(every process on them)")  # fmt: skip
    print("| server | query | concurrency | q/s | p50 | p99 | vs single process (q/s) |")
    print("|---|---|---|---|---|---|---|")
    single = {(r["query"], r["concurrency"]): r["qps"] for r in results if r["server"] == "single process"}
    for r in sorted(results, key=lambda r: r["query"] != "embedding"):  # the embedding rows first, as before
        query = "embedding" if r["query"] == "embedding" else f"image, {IMAGE_SIDE} px"
        print(
            f"| {r['server']} | {query} | {r['concurrency']} | {r['qps']:.0f} | {r['p50_ms']:.1f} ms "
            f"| {r['p99_ms']:.1f} ms | {r['qps'] / single[r['query'], r['concurrency']]:.2f}× |"
        )
    least = min((c for kind, c in single if kind == "embedding"), default=None)
    sharded = [
        r for r in results if r["server"] != "single process" and (r["query"], r["concurrency"]) == ("embedding", least)
    ]
    if sharded:
        r = max(sharded, key=lambda x: x["shards"])
        trip, search = r["simsearch_shard_latency_seconds"] * 1e3, r["simsearch_shard_search_seconds"] * 1e3
        print(
            f"\nS = {r['shards']}, concurrency {r['concurrency']}: p50 {r['p50_ms']:.1f} ms = the ingress's fan-out "
            f"and merge (search stage p50) {r['search_p50_ms']:.1f} ms — of it a shard call's round trip "
            f"{trip:.1f} ms (mean: hop {trip - search:.1f} ms + shard search {search:.1f} ms), "
            f"merge and the wait for the slowest shard {r['search_p50_ms'] - trip:.1f} ms — "
            f"+ gRPC, checks and batching at the ingress {r['p50_ms'] - r['search_p50_ms']:.1f} ms"
        )


def part_query(args: argparse.Namespace) -> None:
    shard_counts = [int(s) for s in args.query_shards.split(",")]
    concurrencies = [int(c) for c in args.query_concurrency.split(",")]
    images = [int(c) for c in args.image_concurrency.split(",") if c]
    figures = run_query(
        args.rows, args.dim, shard_counts, concurrencies, args.query_seconds, args.ray_flags.split(), images
    )
    show_query(figures, args.rows, args.dim)


def run_reload(rows: int, dim: int, shards: int, minutes: float, every_s: float, concurrency: int) -> dict:
    """`serve --ray` at S shards under `concurrency` gRPC callers for `minutes`, made to serve
    the other of two versions (different vectors, the same ids) every `every_s` seconds: every
    answer is checked against the exact top 10 of the version it names (its scores, so float
    ties do not count as a mix). Statuses, mixed answers, reloads, latency, and the memory of
    the ingress and the shard replicas before and after."""

    from benchmarks import harness

    token = "bench"
    queries = query_vectors(dim)
    requests = query_requests(dim, "embedding")
    with query_cluster(dim) as (folder, model, env):
        root = folder / "root"
        names, exact = [], {}
        for seed in (0, 1):
            vectors = clustered_part(0, rows, dim, seed=seed)
            names.append(publish_vectors(root, vectors, shards, model=model).name)
            exact[names[-1]] = (vectors, -np.sort(-(queries @ vectors.T), axis=1)[:, :10])
        metrics_port = harness.free_port()
        command = [
            sys.executable, "-m", "serving", "serve", "--ray", "--index-root", str(root), "--port", "0",
            "--metrics-port", str(metrics_port), "--probe-interval-s", "0", "--admin-token", token,
        ]  # fmt: skip
        proc, ports = harness.serving(command, env)
        memory = ("process_resident_memory_bytes", "simsearch_shard_memory_bytes")
        try:
            before = _scraped(metrics_port, lambda name, _: name in memory)
            figures = asyncio.run(
                _reload_load(ports["port"], requests, exact, names, minutes, every_s, concurrency, token)
            )
            after = _scraped(metrics_port, lambda name, _: name in memory)
        finally:
            proc.terminate()
            proc.wait(120)
    return {
        **figures, "rows": rows, "dim": dim, "shards": shards, "minutes": minutes, "every_s": every_s,
        "concurrency": concurrency,
        "ingress_mb": (before.get(memory[0], 0) / 2**20, after.get(memory[0], 0) / 2**20),
        "shards_mb": (before.get(memory[1], 0) / 2**20, after.get(memory[1], 0) / 2**20),
    }  # fmt: skip


async def _reload_load(port, requests, exact, names, minutes, every_s, concurrency, token) -> dict:
    import grpc

    from protos.simsearch.v1 import search_pb2 as pb
    from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

    statuses: dict[str, int] = {}
    latencies, after_reload, mixed, versions = [], [], 0, {}
    reloads, reload_failures, reload_s = 0, [], []
    last_reload = [float("-inf")]
    stop = time.perf_counter() + minutes * 60
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub, admin = pb_grpc.SimilaritySearchStub(channel), pb_grpc.IndexAdminStub(channel)

        async def caller(c: int) -> None:
            nonlocal mixed
            i = c
            while time.perf_counter() < stop:
                n = i % len(requests)
                started = time.perf_counter()
                try:
                    answer = await stub.Search(requests[n], timeout=30)
                except grpc.aio.AioRpcError as exc:
                    statuses[exc.code().name] = statuses.get(exc.code().name, 0) + 1
                    i += concurrency
                    continue
                took = time.perf_counter() - started
                latencies.append(took)
                if started - last_reload[0] < 2.0:
                    after_reload.append(took)
                statuses["OK"] = statuses.get("OK", 0) + 1
                versions[answer.index_version] = versions.get(answer.index_version, 0) + 1
                vectors, top = exact[answer.index_version]
                rows = [int(x.id[2:]) for x in answer.neighbors]
                scores = np.sort(vectors[rows] @ np.asarray(requests[n].embedding.values, dtype=np.float32))[::-1]
                if len(rows) != 10 or not np.allclose(scores, top[n], atol=1e-5):
                    mixed += 1
                i += concurrency

        async def reloader() -> None:
            nonlocal reloads
            metadata = [("authorization", f"Bearer {token}")]
            turn = 0
            while time.perf_counter() + every_s < stop:
                await asyncio.sleep(every_s)
                turn += 1
                last_reload[0] = time.perf_counter()
                try:
                    reply = await admin.Reload(
                        pb.ReloadRequest(index_version=names[turn % 2]), metadata=metadata, timeout=120
                    )
                    reloads += reply.index_version == names[turn % 2]
                except grpc.aio.AioRpcError as exc:
                    reload_failures.append(f"{exc.code().name}: {exc.details()}")
                reload_s.append(time.perf_counter() - last_reload[0])

        began = time.perf_counter()
        await asyncio.gather(reloader(), *(caller(c) for c in range(concurrency)))
        wall = time.perf_counter() - began
    return {
        "queries": sum(statuses.values()), "qps": statuses.get("OK", 0) / wall, "statuses": statuses,
        "mixed": mixed, "versions": versions, "reloads": reloads, "reload_failures": reload_failures,
        "reload_s_p50": float(np.median(reload_s)) if reload_s else 0.0,
        "p50_ms": float(np.percentile(latencies, 50)) * 1e3, "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
        "after_reload_p99_ms": float(np.percentile(after_reload, 99)) * 1e3 if after_reload else 0.0,
    }  # fmt: skip


def show_reload(r: dict) -> None:
    unexpected = {k: v for k, v in r["statuses"].items() if k != "OK"}
    print(f"\nreloads under load: serve --ray, S = {r['shards']}, {r['rows']:,} × {r['dim']}-d Flat, two versions "
          f"(different vectors) made live in turn every {r['every_s']:.0f} s for {r['minutes']:.1f} min, "
          f"concurrency {r['concurrency']}, {os.cpu_count()} cores")  # fmt: skip
    print(
        "| queries | q/s | unexpected statuses | answers not from the version they name | reloads (ok / failed) "
        "| a reload's p50 | p50 / p99 | p99 within 2 s of a reload | ingress RSS | shard replicas' RSS (sum) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['queries']:,} | {r['qps']:.0f} | {sum(unexpected.values())} {unexpected or ''} | {r['mixed']} "
        f"| {r['reloads']} / {len(r['reload_failures'])} | {r['reload_s_p50']:.2f} s "
        f"| {r['p50_ms']:.1f} / {r['p99_ms']:.1f} ms | {r['after_reload_p99_ms']:.1f} ms "
        f"| {r['ingress_mb'][0]:.0f} → {r['ingress_mb'][1]:.0f} MB "
        f"| {r['shards_mb'][0]:.0f} → {r['shards_mb'][1]:.0f} MB |"
    )
    print(f"answers by version: {r['versions']}; reload failures: {r['reload_failures'] or 'none'}")


def part_reload(args: argparse.Namespace) -> None:
    show_reload(
        run_reload(args.rows, args.dim, args.shards, args.reload_minutes, args.reload_every, args.reload_concurrency)
    )


# `--part NAME` runs PARTS[NAME]; `all` runs every part in this order.
PARTS: dict[str, Callable[[argparse.Namespace], None]] = {
    "build": part_build, "rerank": part_rerank, "merge": part_merge, "query": part_query, "reload": part_reload,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=[*PARTS, "all"])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--factory", action="append", help=f"repeatable (default: {DEFAULT_FACTORIES})")
    parser.add_argument("--train-size", type=int, default=50_000)
    parser.add_argument("--nlist", type=int, default=1024, help="rerank part: IVF lists")
    parser.add_argument("--pq", type=int, default=32, help="rerank part: PQ bytes a vector")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--rerank", type=int, default=10)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--query-shards", default="1,2,4", help="query part: the S of each `serve --ray`")
    parser.add_argument("--query-concurrency", default="1,32", help="query part: callers at once, each level")
    parser.add_argument(
        "--image-concurrency",
        default="32",
        help="query part: callers at once sending 224-px images, each level ('': none)",
    )
    parser.add_argument("--query-seconds", type=float, default=10.0, help="query part: seconds of load a level")
    parser.add_argument("--merge-queries", type=int, default=1000, help="merge part: queries compared")
    parser.add_argument("--reload-minutes", type=float, default=3.0, help="reload part: minutes of load")
    parser.add_argument("--reload-every", type=float, default=20.0, help="reload part: seconds between reloads")
    parser.add_argument("--reload-concurrency", type=int, default=32, help="reload part: gRPC callers")
    parser.add_argument("--ray-flags", default="", help="query part: more flags for each `serve --ray`, one string")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.rows < args.shards:
        parser.error(f"--shards must be between 1 and --rows, got {args.shards}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name, part in PARTS.items():
        if args.part in (name, "all"):
            part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
