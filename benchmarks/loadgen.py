"""Closed-loop gRPC load generator (its own process, asyncio): C concurrent callers for T seconds.

Prints one JSON line: queries/s, p50/p99 latency in ms, error count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import numpy as np

from core.catalog import read_catalog
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc


async def run(target: str, images: list[bytes], concurrency: int, seconds: float, k: int) -> dict:
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SimilaritySearchStub(channel)
        await stub.Search(pb.SearchRequest(image=images[0], k=k), timeout=30)  # warm-up
        stop_at = time.perf_counter() + seconds

        async def caller(offset: int) -> None:
            nonlocal errors
            i = offset
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    await stub.Search(pb.SearchRequest(image=images[i % len(images)], k=k), timeout=30)
                    latencies.append(time.perf_counter() - started)
                except grpc.aio.AioRpcError:
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
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--images", type=int, default=512)
    args = parser.parse_args()
    catalog = read_catalog(args.catalog)
    images = [p.read_bytes() for p in catalog.paths[: args.images]]
    print(json.dumps(asyncio.run(run(args.target, images, args.concurrency, args.seconds, args.k))))


if __name__ == "__main__":
    main()
