"""A soak's traffic (`benchmarks.soak`): the requests its callers draw from, by weight; the callers,
over gRPC and over HTTP/JSON; the reloader; and the tally of what each was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import grpc
import numpy as np

from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

TOKEN = "soak-admin-token"
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_KINDS = ("garbage", "truncated", "wrong_dim", "nan", "k_too_large", "unknown_id", "empty")
GOOD_WEIGHTS = {"image": 0.6, "embedding": 0.1}


@dataclass
class Traffic:
    """The requests a caller draws from, by kind, with the status each must get."""

    requests: dict[str, list[pb.SearchRequest]]
    weights: dict[str, float]

    @classmethod
    def build(cls, version: IndexVersion, dim: int, max_k: int, seed: int = 0) -> Traffic:
        rng = np.random.default_rng(seed)
        items = version.items
        rows = rng.permutation(len(items))[:64]
        images = [Path(items.paths[r]).read_bytes() for r in rows]
        vectors = rng.standard_normal((64, dim)).astype(np.float32)
        requests = {
            "image": [
                pb.SearchRequest(image=b, k=10, exclude_ids=[items.ids[r]]) for b, r in zip(images, rows, strict=True)
            ],
            "embedding": [pb.SearchRequest(embedding=pb.Embedding(values=v.tolist()), k=10) for v in vectors],
            "garbage": [pb.SearchRequest(image=rng.bytes(200 + 50 * i), k=5) for i in range(8)],
            "truncated": [pb.SearchRequest(image=b[: len(b) // 2], k=5) for b in images[:8]],
            "wrong_dim": [pb.SearchRequest(embedding=pb.Embedding(values=[0.1] * (dim + 1)), k=5)],
            "nan": [pb.SearchRequest(embedding=pb.Embedding(values=[float("nan")] + [0.1] * (dim - 1)), k=5)],
            "k_too_large": [pb.SearchRequest(image=images[0], k=max_k + 1)],
            "unknown_id": [pb.SearchRequest(item_id=f"no-such-item-{i}", k=5) for i in range(8)],
            "empty": [pb.SearchRequest(k=5)],
        }
        bad_share = (1.0 - sum(GOOD_WEIGHTS.values())) / len(BAD_KINDS)
        return cls(requests, {**GOOD_WEIGHTS, **dict.fromkeys(BAD_KINDS, bad_share)})

    @staticmethod
    def expected(kind: str) -> grpc.StatusCode:
        return OK if kind in GOOD_WEIGHTS else INVALID


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # (kind, code name) → answers
    unexpected: Counter = field(default_factory=Counter)
    messages: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # the first few, unexpected
    latencies: dict[str, list[float]] = field(default_factory=dict)  # good kind → seconds of its OK answers
    reloads_ok: int = 0
    reloads_failed: list[str] = field(default_factory=list)
    bad_reloads_refused: int = 0
    bad_reloads_wrong: list[str] = field(default_factory=list)

    @property
    def queries(self) -> int:
        return sum(self.statuses.values())

    def count(self, kind: str, transport: str, code: str, expected: str, seconds: float, message: str) -> None:
        """One answer: `kind` (image, embedding, garbage, …) over `transport` ("" for gRPC,
        "/http"), its status code name, and the seconds it took."""
        key = (f"{kind}{transport}", code)
        self.statuses[key] += 1
        if code != expected:
            self.unexpected[key] += 1
            said = self.messages.setdefault(key, [])
            if len(said) < 3 and message not in said:
                said.append(message)
        elif code == "OK":
            self.latencies.setdefault(kind, []).append(seconds)


async def callers(
    target: str, traffic: Traffic, concurrency: int, stop_at: float, tally: Tally, connections: int = 1
) -> None:
    """`concurrency` callers over `connections` connections, caller c on connection c mod
    `connections`: the kernel spreads connections, not calls, over the workers of `serve
    --processes N` (gRPC shares one connection between channels unless each has a pool of its own)."""
    kinds = list(traffic.weights)
    weights = [traffic.weights[k] for k in kinds]
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(grpc.aio.insecure_channel(target, options=options))
            for _ in range(connections)
        ]
        stubs = [pb_grpc.SimilaritySearchStub(channel) for channel in channels]

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            stub = stubs[seed % connections]
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                request = rng.choice(traffic.requests[kind])
                started, message = time.perf_counter(), ""
                try:
                    await stub.Search(request, timeout=60)
                    code = OK
                except grpc.aio.AioRpcError as exc:
                    code, message = exc.code(), exc.details() or ""
                took = time.perf_counter() - started
                tally.count(kind, "", code.name, traffic.expected(kind).name, took, message)

        await asyncio.gather(*(caller(c) for c in range(concurrency)))


async def http_callers(target: str, traffic: Traffic, concurrency: int, stop_at: float, tally: Tally) -> None:
    """The same traffic over HTTP/JSON: good image queries as the raw body of /v1/search/image
    (half of them) or as proto3 JSON to /v1/search, everything else as JSON; the status is the
    error body's gRPC code name, counted under `<kind>/http`."""
    import aiohttp
    from google.protobuf.json_format import MessageToJson

    kinds = list(traffic.weights)
    weights = [traffic.weights[k] for k in kinds]
    bodies = {kind: [MessageToJson(r) for r in requests] for kind, requests in traffic.requests.items()}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(f"http://{target}", connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                i = rng.randrange(len(traffic.requests[kind]))
                request = traffic.requests[kind][i]
                if kind == "image" and rng.random() < 0.5:
                    call = session.post(
                        f"/v1/search/image?k={request.k}&excludeIds={quote(request.exclude_ids[0], safe='')}",
                        data=request.image,
                        headers={"Content-Type": "application/octet-stream"},
                        timeout=timeout,
                    )
                else:
                    call = session.post(
                        "/v1/search",
                        data=bodies[kind][i],
                        headers={"Content-Type": "application/json"},
                        timeout=timeout,
                    )
                started, message = time.perf_counter(), ""
                try:
                    async with call as response:
                        body = await response.json(content_type=None)
                        code = "OK" if response.status == 200 else body["error"]["code"]
                        if code != "OK":
                            message = f"HTTP {response.status}: {body['error'].get('message', '')}"
                except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
                    code, message = f"client:{type(exc).__name__}", str(exc)
                took = time.perf_counter() - started
                tally.count(kind, "/http", code, traffic.expected(kind).name, took, message)

        await asyncio.gather(*(caller(c) for c in range(concurrency)))


async def reloader(
    target: str,
    every_s: float,
    bad_every: int,
    bad_versions: list[str],
    stop_at: float,
    tally: Tally,
) -> None:
    """Every `every_s` seconds a Reload of CURRENT, every `bad_every`-th after a Reload of each bad
    version (a server of several workers relays each to every worker before it answers)."""
    metadata = [("authorization", f"Bearer {TOKEN}")]
    async with grpc.aio.insecure_channel(target) as channel:
        admin = pb_grpc.IndexAdminStub(channel)
        n = 0
        while time.monotonic() + every_s < stop_at:
            await asyncio.sleep(every_s)
            n += 1
            if bad_every and n % bad_every == 0:
                for version in bad_versions:
                    try:
                        await admin.Reload(pb.ReloadRequest(index_version=version), metadata=metadata, timeout=120)
                        tally.bad_reloads_wrong.append(f"{version}: OK")
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                            tally.bad_reloads_refused += 1
                        else:
                            tally.bad_reloads_wrong.append(f"{version}: {exc.code().name} {exc.details()}")
            try:
                await admin.Reload(pb.ReloadRequest(), metadata=metadata, timeout=120)
                tally.reloads_ok += 1
            except grpc.aio.AioRpcError as exc:
                tally.reloads_failed.append(f"{exc.code().name}: {exc.details()}")
