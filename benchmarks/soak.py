"""Soak: a real server under mixed good and bad traffic for minutes, reloaded every R seconds, its
resident memory sampled — does it hold up for weeks?

    python benchmarks/soak.py --run runs/demo --minutes 30 --reload-every 20 --no-baseline

The server is `python -m serving serve` in its own process over a copy of the run's index, with
gRPC and HTTP ports. C asyncio callers (32; `--http-share` of them, half by default, over
HTTP/JSON: image queries as a raw body or proto3 JSON, the rest as JSON) send, by weight: image
queries 60%, embedding queries 10%, and the rest bad input of seven kinds (garbage bytes, a
truncated image, an embedding of the wrong dimension, a NaN, k above the limit, an unknown item id,
a request with no query), each of which must answer INVALID_ARGUMENT; every good query must answer
OK. Every R seconds an authenticated `Reload` of CURRENT loads a fresh model+index pair and swaps
it in; every `--bad-reload-every`-th time a reload of a damaged version and one of a missing
version go first, and must fail with FAILED_PRECONDITION while the live pair keeps serving.

The server's RSS and open file descriptors are sampled every few seconds. Printed: a table row per
run — queries, unexpected statuses, reloads, RSS first → last (max), and the RSS slope (least
squares, MB/min) after the warm-up, over the second half and over the minute medians — then each
run's minute medians (the median of each minute's samples, minute 0 first), their slope after the
warm-up, and their spread (largest − smallest) from `--settle-min` (5) on: a server that holds up
keeps that spread within a few MB. The run without reloads (`--baseline`, on by default) is the
same traffic on a server that is never reloaded: the memory a reload leaves behind is the
difference between the two slopes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import grpc
import numpy as np
import psutil

from benchmarks import harness
from core import artifacts
from core.items import ItemTable
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
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
    def build(cls, index_dir: Path, dim: int, max_k: int, seed: int = 0) -> Traffic:
        rng = np.random.default_rng(seed)
        items = ItemTable.read(index_dir / artifacts.ITEMS_FILE)
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
    reloads_ok: int = 0
    reloads_failed: list[str] = field(default_factory=list)
    bad_reloads_refused: int = 0
    bad_reloads_wrong: list[str] = field(default_factory=list)

    @property
    def queries(self) -> int:
        return sum(self.statuses.values())


async def callers(target: str, traffic: Traffic, concurrency: int, stop_at: float, tally: Tally) -> None:
    kinds = list(traffic.weights)
    weights = [traffic.weights[k] for k in kinds]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SimilaritySearchStub(channel)

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                request = rng.choice(traffic.requests[kind])
                try:
                    await stub.Search(request, timeout=60)
                    code = OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                tally.statuses[(kind, code.name)] += 1
                if code != traffic.expected(kind):
                    tally.unexpected[(kind, code.name)] += 1

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
                try:
                    async with call as response:
                        body = await response.json(content_type=None)
                        code = "OK" if response.status == 200 else body["error"]["code"]
                except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
                    code = f"client:{type(exc).__name__}"
                tally.statuses[(f"{kind}/http", code)] += 1
                if code != traffic.expected(kind).name:
                    tally.unexpected[(f"{kind}/http", code)] += 1

        await asyncio.gather(*(caller(c) for c in range(concurrency)))


async def reloader(
    target: str, every_s: float, bad_every: int, bad_versions: list[str], stop_at: float, tally: Tally
) -> None:
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


class Sampler(threading.Thread):
    """The server's RSS (MB) and open file descriptors every `every_s` seconds."""

    def __init__(self, pid: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[tuple[float, float, int]] = []  # (minutes since start, RSS MB, fds)
        self.stopped = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.is_set():
            rss = self.process.memory_info().rss / 2**20
            self.samples.append(((time.monotonic() - started) / 60, rss, self.process.num_fds()))
            self.stopped.wait(self.every_s)


def slope_mb_per_min(samples: list[tuple[float, float, int]], from_min: float) -> float | None:
    """Least-squares slope of RSS over the samples taken at or after `from_min` minutes."""
    tail = [(t, rss) for t, rss, _ in samples if t >= from_min]
    if len(tail) < 3:
        return None
    t, rss = np.array(tail).T
    return float(np.polyfit(t, rss, 1)[0])


def minute_medians(samples: list[tuple[float, float, int]]) -> list[float]:
    """The median RSS (MB) of each whole minute's samples, minute 0 first (a last minute cut
    short is left out): a reload holds two pairs for a moment, a sawtooth of a few MB that sways
    a fit over raw samples (and more so over a short window); the median of a minute does not
    see it."""
    minutes: dict[int, list[float]] = {}
    for t, rss, _ in samples:
        minutes.setdefault(int(t), []).append(rss)
    whole = int(samples[-1][0]) if samples else 0
    return [float(np.median(minutes[m])) for m in range(whole) if m in minutes]


def minute_medians_slope(medians: list[float], from_min: float) -> float | None:
    """Least-squares slope (MB/min) of the minute medians from minute `from_min` on."""
    keys = [m for m in range(len(medians)) if m >= from_min]
    if len(keys) < 3:
        return None
    return float(np.polyfit(keys, [medians[m] for m in keys], 1)[0])


def minute_medians_spread(medians: list[float], from_min: float) -> float | None:
    """Largest minus smallest minute median (MB) from minute `from_min` on: the acceptance
    figure (a server that holds up stays within a few MB once warm, whatever the fit says)."""
    tail = medians[int(np.ceil(from_min)) :]
    return float(max(tail) - min(tail)) if tail else None


def damaged_and_missing_versions(root: Path) -> list[str]:
    """A version whose index file is cut short, and a name no version has."""
    live = artifacts.version_dir(root)
    staging = artifacts.index_staging_dir(root)
    for path in live.iterdir():
        shutil.copy2(path, staging / path.name)
    index_file = staging / artifacts.INDEX_FILE
    index_file.write_bytes(index_file.read_bytes()[: index_file.stat().st_size // 3])
    damaged = artifacts.new_version_name("damaged00000000")
    artifacts.publish_version(root, staging, damaged, make_current=False)
    return [damaged, "v-no-such-version"]


def soak(
    run: Path,
    minutes: float,
    reload_every: float,
    concurrency: int,
    sample_every: float,
    warmup_min: float,
    bad_reload_every: int,
    server_flags: list[str],
    settle_min: float = 5.0,
    http_share: float = 0.0,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp) / "index"
        shutil.copytree(run / "index", root)
        bad_versions = damaged_and_missing_versions(root) if reload_every else []
        port, metrics_port, http_port = harness.free_port(), harness.free_port(), harness.free_port()
        command = [
            sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", str(port),
            "--metrics-port", str(metrics_port), "--http-port", str(http_port), "--admin-token", TOKEN, *server_flags,
        ]  # fmt: skip
        proc = harness.start(command, lambda: harness.healthy(metrics_port))
        target = f"127.0.0.1:{port}"
        try:
            with grpc.insecure_channel(target) as channel:
                info = pb_grpc.SimilaritySearchStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
            traffic = Traffic.build(artifacts.version_dir(root), info.embedding_dim, info.limits.max_k)
            tally = Tally()
            sampler = Sampler(proc.pid, sample_every)
            sampler.start()

            async def main() -> None:
                stop_at = time.monotonic() + minutes * 60
                over_http = round(concurrency * http_share)
                jobs = [callers(target, traffic, concurrency - over_http, stop_at, tally)]
                if over_http:
                    jobs.append(http_callers(f"127.0.0.1:{http_port}", traffic, over_http, stop_at, tally))
                if reload_every:
                    jobs.append(reloader(target, reload_every, bad_reload_every, bad_versions, stop_at, tally))
                await asyncio.gather(*jobs)

            asyncio.run(main())
            sampler.stopped.set()
            sampler.join()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    samples = sampler.samples
    rss = [s[1] for s in samples]
    medians = minute_medians(samples)
    return {
        "minutes": minutes,
        "reload_every_s": reload_every,
        "http_share": http_share,
        "queries": tally.queries,
        "unexpected": sum(tally.unexpected.values()),
        "unexpected_by_kind": {f"{k}:{c}": n for (k, c), n in tally.unexpected.items()},
        "statuses": {f"{k}:{c}": n for (k, c), n in sorted(tally.statuses.items())},
        "reloads_ok": tally.reloads_ok,
        "reloads_failed": tally.reloads_failed,
        "bad_reloads_refused": tally.bad_reloads_refused,
        "bad_reloads_wrong": tally.bad_reloads_wrong,
        "rss_first_mb": rss[0],
        "rss_last_mb": rss[-1],
        "rss_max_mb": max(rss),
        "fds_first": samples[0][2],
        "fds_last": samples[-1][2],
        "slope_after_warmup": slope_mb_per_min(samples, warmup_min),
        "slope_second_half": slope_mb_per_min(samples, samples[-1][0] / 2),
        "slope_minute_medians": minute_medians_slope(medians, warmup_min),
        "minute_medians_mb": [round(m, 1) for m in medians],
        "settle_min": settle_min,
        "spread_after_settle_mb": minute_medians_spread(medians, settle_min),
        "warmup_min": warmup_min,
        "samples": [[round(t, 3), round(r, 2), f] for t, r, f in samples],
    }


def fmt_slope(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} MB/min"


def row(name: str, r: dict) -> str:
    reloads = f"{r['reloads_ok']} ok, {len(r['reloads_failed'])} failed"
    if r["reload_every_s"]:
        reloads += f"; {r['bad_reloads_refused']} bad refused, {len(r['bad_reloads_wrong'])} wrong"
    return (
        f"| {name} | {r['queries']:,} | {r['unexpected']} | {reloads} "
        f"| {r['rss_first_mb']:.0f} → {r['rss_last_mb']:.0f} MB ({r['rss_max_mb']:.0f}) "
        f"| {fmt_slope(r['slope_after_warmup'])} | {fmt_slope(r['slope_second_half'])} "
        f"| {fmt_slope(r.get('slope_minute_medians'))} "
        f"| {r['fds_first']} → {r['fds_last']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo", help="a demo run (index/), made if absent")
    parser.add_argument("--minutes", type=float, default=15.0, help="length of each run")
    parser.add_argument("--reload-every", type=float, default=20.0, help="seconds between reloads")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-min", type=float, default=2.0, help="minutes left out of the slope")
    parser.add_argument(
        "--settle-min", type=float, default=5.0, help="minutes left out of the minute medians' spread (the acceptance)"
    )
    parser.add_argument(
        "--bad-reload-every", type=int, default=5, help="every Nth reload is preceded by a damaged and a missing one"
    )
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run without reloads (default on)")  # fmt: skip
    parser.add_argument(
        "--http-share", type=float, default=0.5, help="fraction of the callers that use HTTP/JSON instead of gRPC"
    )
    parser.add_argument("--server-flag", action="append", default=[], help="a `serve` flag, repeatable")
    parser.add_argument("--json", type=Path, help="write every figure and RSS sample here")
    args = parser.parse_args()
    if args.minutes <= 0 or args.reload_every <= 0 or args.concurrency < 1 or args.sample_every <= 0:
        parser.error("--minutes, --reload-every and --sample-every must be > 0, --concurrency ≥ 1")
    if not 0 <= args.http_share <= 1:
        parser.error(f"--http-share must be within [0, 1], got {args.http_share}")
    if args.warmup_min >= args.minutes:
        parser.error(f"--warmup-min ({args.warmup_min}) must be shorter than --minutes ({args.minutes})")
    harness.ensure_artifacts(args.run.resolve(), quick=False)
    runs = {f"{args.minutes:g} min, reload every {args.reload_every:g} s": args.reload_every}
    if args.baseline:
        runs[f"{args.minutes:g} min, no reload"] = 0.0
    results = {}
    for name, every in runs.items():
        print(f"== {name}", flush=True)
        results[name] = soak(
            args.run.resolve(), args.minutes, every, args.concurrency, args.sample_every, args.warmup_min,
            args.bad_reload_every, args.server_flag, args.settle_min, args.http_share,
        )  # fmt: skip
        print(json.dumps({k: v for k, v in results[name].items() if k not in ("samples", "statuses")}), flush=True)
    print(
        f"\n| run | queries | unexpected statuses | reloads | server RSS first → last (max) "
        f"| slope after {args.warmup_min:g} min | slope, second half | slope of minute medians | open fds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, result in results.items():
        print(row(name, result))
    for name, result in results.items():
        print(f"\n{name}: RSS minute medians (MB), minute 0 on:")
        print(" ".join(f"{m:.0f}" for m in result["minute_medians_mb"]))
        print(f"slope of minute medians after {args.warmup_min:g} min: {fmt_slope(result['slope_minute_medians'])}")
        spread = result["spread_after_settle_mb"]
        spread_text = "n/a" if spread is None else f"{spread:.1f} MB"
        print(f"spread of minute medians from minute {args.settle_min:g}: {spread_text}")
    if len(results) == 2:
        reload_run, still_run = results.values()
        if reload_run["reloads_ok"] and None not in (reload_run["slope_after_warmup"], still_run["slope_after_warmup"]):
            per_reload = (
                (reload_run["slope_after_warmup"] - still_run["slope_after_warmup"]) * args.reload_every / 60 * 1024
            )
            print(f"\nleft behind per reload (slope difference × reload interval): {per_reload:+.0f} KB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
