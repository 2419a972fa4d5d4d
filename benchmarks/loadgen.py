"""Closed-loop load generator (its own process, asyncio): C concurrent callers for T seconds,
over gRPC or HTTP/JSON, searching by image, by item id or by text.

    python -m benchmarks.loadgen --target 127.0.0.1:50051 --catalog test.csv --concurrency 8
    python -m benchmarks.loadgen --protocol http --target 127.0.0.1:8080 --catalog test.csv --query item
    python -m benchmarks.loadgen --target 127.0.0.1:50051 --catalog test.csv --query text --texts phrases.txt

Prints one JSON line: queries/s, p50/p99 latency in ms, error count. HTTP image queries send the
raw image as the body of `POST /v1/search/image`; item and text queries `POST /v1/search` with
`{"itemId": …, "k": …}` or `{"text": …, "k": …}` — what a client of each transport sends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np

from core.data.catalog import read_catalog
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

Call = Callable[[int], Awaitable[None]]  # one query, the i-th: raises on any answer but OK


async def _closed_loop(call: Call, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    await call(0)  # warm-up: the connection, the server's first answer
    stop_at = time.perf_counter() + seconds

    async def caller(offset: int) -> None:
        nonlocal errors
        i = offset
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                await call(i)
                latencies.append(time.perf_counter() - started)
            except Exception:  # noqa: BLE001 — any failed query counts as an error
                errors += 1
            i += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - started
    lat = np.array(latencies) * 1e3
    return {
        "concurrency": concurrency,
        "queries": len(latencies),
        "qps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "errors": errors,
    }


async def run(
    target: str,
    images: list[bytes],
    concurrency: int,
    seconds: float,
    k: int,
    protocol: str = "grpc",
    ids: list[str] | None = None,
    texts: list[str] | None = None,
) -> dict:
    """`ids`, `texts`: search by these item ids or phrases instead of `images`."""
    if protocol == "grpc":
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.SimilaritySearchStub(channel)
            if ids:
                requests = [pb.SearchRequest(item_id=i, k=k) for i in ids]
            elif texts:
                requests = [pb.SearchRequest(text=t, k=k) for t in texts]
            else:
                requests = [pb.SearchRequest(image=image, k=k) for image in images]

            async def call(i: int) -> None:
                await stub.Search(requests[i % len(requests)], timeout=30)

            return await _closed_loop(call, concurrency, seconds)

    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(f"http://{target}", connector=connector) as session:
        timeout = aiohttp.ClientTimeout(total=30)

        async def call(i: int) -> None:
            if ids:
                answer = session.post("/v1/search", json={"itemId": ids[i % len(ids)], "k": k}, timeout=timeout)
            elif texts:
                answer = session.post("/v1/search", json={"text": texts[i % len(texts)], "k": k}, timeout=timeout)
            else:
                answer = session.post(
                    f"/v1/search/image?k={k}",
                    data=images[i % len(images)],
                    headers={"Content-Type": "application/octet-stream"},
                    timeout=timeout,
                )
            async with answer as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")

        return await _closed_loop(call, concurrency, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="HOST:PORT of the gRPC or HTTP port")
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument(
        "--query", choices=("image", "item", "text"), default="image", help="search by image, item id or text"
    )
    parser.add_argument("--texts", help="--query text: a file of phrases, one a line")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--images", type=int, default=512)
    args = parser.parse_args()
    catalog = read_catalog(args.catalog)
    images = [p.read_bytes() for p in catalog.paths[: args.images]] if args.query == "image" else []
    ids = list(catalog.ids[: args.images]) if args.query == "item" else None
    texts = None
    if args.query == "text":
        if not args.texts:
            parser.error("--query text needs --texts FILE")
        texts = [line.strip() for line in open(args.texts, encoding="utf-8") if line.strip()]
    result = asyncio.run(run(args.target, images, args.concurrency, args.seconds, args.k, args.protocol, ids, texts))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
