"""Soak: a real server under mixed good and bad traffic for minutes, reloaded every R seconds, the
resident memory of each of its processes sampled — does it hold up for weeks?

    python -m benchmarks.soak --run runs/demo --minutes 30 --reload-every 20 --no-baseline
    python -m benchmarks.soak --ray --shards 4 --synthetic 20000 --minutes 15 --no-baseline   # make soak

The server is `python -m serving serve` in its own process, or with `--ray` `serve --ray` on a
local Ray this process starts (the ingress, the embedder and a deployment per shard, each its
own Ray worker process), over a copy of an index of `--shards` S shards, with gRPC and HTTP
ports. What it serves: a demo run's model and index (`--run`, made if absent), or with
`--synthetic N` a catalog of N 224-px JPEG images (what users send) and a 224-px model whose
graph is an average pool and one projection (tests/support/index.py), written once into
`--run` (runs/soak-224px-N by default). The S-shard index is built once from the run's model
and catalog (`index build --shards S`) and copied for each run.

C asyncio callers (32; `--http-share` of them, half by default, over HTTP/JSON: image queries as
a raw body or proto3 JSON, the rest as JSON) send, by weight: image queries 60%, embedding
queries 10%, and the rest bad input of seven kinds (garbage bytes, a truncated image, an
embedding of the wrong dimension, a NaN, k above the limit, an unknown item id, a request with no
query), each of which must answer INVALID_ARGUMENT; every good query must answer OK. Every R
seconds an authenticated `Reload` of CURRENT loads a fresh model+index pair and swaps it in;
every `--bad-reload-every`-th time a reload of a damaged version (its index files cut short)
and one of a missing version go first, and must fail with FAILED_PRECONDITION while the live
pair keeps serving.

Every few seconds the RSS and open file descriptors of each process are sampled: the server's;
with `--ray` also every Ray process under this one — each replica by its deployment (ingress,
embedder, shard-000, …), the Serve controller, the log queue, idle workers, the raylet, the GCS,
Ray's dashboard and runtime-env agents and its log monitor. Printed: a
table row per run — queries, unexpected statuses, reloads, the server's (with `--ray` the
ingress's) RSS first → last (max), and its RSS slope (least squares, MB/min) after the warm-up,
over the second half and over the minute medians — then q/s and the good queries' p50/p99, each
process's RSS at the start (the median of its samples in the first third of what follows
`--warmup-min`) and at the end (the median of the last third's), its growth and the slope of its
minute medians after the warm-up, then the minute
medians of the server (the ingress) with their slope and spread from `--settle-min` (5) on.

The soak fails (exit status 1, each reason on a `FAILED:` line) on any unexpected status, a
reload of CURRENT that failed, a bad reload that did not fail as it must, an error in the
server's log (with `--ray` every replica's records reach it) other than what the bad input
causes, a serving process (the server; with `--ray` the command, the ingress, the embedder, each
shard replica) that exited or was replaced, or one — or one of Ray's long-lived processes (the
GCS, the raylet, the dashboard, its agents, the log and autoscaler monitors, the Serve controller, the
log queue) — whose RSS grew from the start to the end by
more than `--max-growth-mb` (8), or than twice the growth's standard error where the process's
own swing under load makes that larger — judged when at least 3 minutes follow the warm-up
(shorter windows are within the sawtooth of the reloads). Printed with it: the unexpected statuses'
first messages, and the server's log records at WARNING and above, by kind.

The run without reloads (`--baseline`, on by default) is the same traffic on a server that is
never reloaded: the memory a reload leaves behind is the difference between the two slopes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import re
import shutil
import subprocess
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
from core.artifacts import layout as artifacts
from index.versions.version import IndexVersion
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


SERVING = ("serve", "serve --ray", "ingress", "embedder")  # and shard-NNN: the processes judged
# Ray's own processes that live as long as the cluster: judged on their growth like the serving
# ones (a cluster that serves for weeks must not grow in them either), not on being replaced.
RAY_SYSTEM = (
    "gcs_server", "raylet", "dashboard", "dashboard agent", "runtime env agent", "log monitor", "autoscaler monitor",
    "ServeController", "log queue",
)  # fmt: skip
# Ray's processes that are Python scripts, by the script's path under the ray package.
RAY_SCRIPTS = {
    "dashboard/agent.py": "dashboard agent",
    "runtime_env/agent/main.py": "runtime env agent",
    "_private/log_monitor.py": "log monitor",
    "autoscaler/_private/monitor.py": "autoscaler monitor",
    "_private/ray_process_reaper.py": "reaper",
    "dashboard/dashboard.py": "dashboard",
}
# Ray's actor classes named apart from the label of the script that runs them.
RAY_ACTORS = {"DashboardAgent": "dashboard agent", "RuntimeEnvAgent": "runtime env agent", "_QueueActor": "log queue"}


def serving_process(label: str) -> bool:
    return label in SERVING or label.startswith("shard-")


def judged_kind(label: str) -> str:
    """ "serving" (judged on growth and on living through the run), "ray" (Ray's long-lived
    processes, judged on growth) or "other" (workers that come and go, the reaper: reported)."""
    if serving_process(label):
        return "serving"
    return "ray" if label in RAY_SYSTEM else "other"


def process_label(process: psutil.Process, server_pid: int, ray: bool) -> str | None:
    """What a process under this one is: the server (`serve`, or the `serve --ray` command), a
    Serve replica by its deployment (its title `ray::ServeReplica:simsearch:shard-000`, a
    method's name after a dot while it runs one), another Ray actor by its class (the Serve
    controller, the log queue), an idle Ray worker, the raylet, the GCS, Ray's agents and
    monitors by their script; None for what is not Ray's or the server's (a compiler a package
    spawns)."""
    if process.pid == server_pid:
        return "serve --ray" if ray else "serve"
    title = process.cmdline()
    if not title:
        return None
    if title[0].startswith("ray::"):
        name = title[0][len("ray::") :].split(".", 1)[0].split(" ", 1)[0]
        if name.startswith("ServeReplica:"):
            return name.rsplit(":", 1)[-1]
        return "idle worker" if name in ("", "IDLE") else RAY_ACTORS.get(name, name)
    name = os.path.basename(title[0])
    if name in ("raylet", "gcs_server"):
        return name
    for arg in title[1:4]:
        for script, label in RAY_SCRIPTS.items():
            if arg.endswith("ray/" + script):
                return label
    return None


class Sampler(threading.Thread):
    """Every `every_s` seconds, the RSS (MB) and open file descriptors of the server and, with
    `ray`, of every Ray process under this one that `process_label` names: a series for each
    (label, pid), so a replica replaced by another process is two series."""

    def __init__(self, server_pid: int, every_s: float, ray: bool = False) -> None:
        super().__init__(daemon=True)
        self.server_pid = server_pid
        self.ray = ray
        self.every_s = every_s
        self.series: dict[tuple[str, int], list[tuple[float, float, int]]] = {}  # (minutes, RSS MB, fds)
        self.ticks: list[float] = []  # the minutes of each round of samples
        self.stopped = threading.Event()
        self._labels: dict[int, str | None] = {}

    def processes(self) -> list[tuple[str, psutil.Process]]:
        found = [psutil.Process(self.server_pid)]
        if self.ray:
            found += psutil.Process().children(recursive=True)
        out = []
        for process in found:
            try:
                if process.pid not in self._labels:
                    self._labels[process.pid] = process_label(process, self.server_pid, self.ray)
                label = self._labels[process.pid]
            except psutil.Error:
                continue
            if label is not None:
                out.append((label, process))
        return out

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.is_set():
            now = (time.monotonic() - started) / 60
            for label, process in self.processes():
                try:
                    rss, fds = process.memory_info().rss / 2**20, process.num_fds()
                except psutil.Error:
                    continue
                self.series.setdefault((label, process.pid), []).append((now, rss, fds))
            self.ticks.append(now)
            self.stopped.wait(self.every_s)

    def of(self, label: str) -> list[tuple[float, float, int]]:
        """The samples of the first process that had `label`."""
        return next((rows for (name, _), rows in self.series.items() if name == label), [])


def memory_by_process(sampler: Sampler, warmup_min: float, max_growth_mb: float = 8.0) -> list[dict]:
    """Each sampled process's RSS at the start — the median of its samples in the first third of
    what follows `warmup_min` — and at the end — the median of the last third's — and the growth
    between; the growth it is allowed: `max_growth_mb`, or twice the growth's standard error where
    the process's own swing makes that larger (1.25 s/√n a median, s the samples' spread in each
    third: a process whose RSS swings by tens of MB under load moves its medians by more than a
    few MB with no leak); judged when at least 3 minutes follow the warm-up; whether the process
    lived through the whole run."""
    last = sampler.ticks[-1] if sampler.ticks else 0.0
    span = last - warmup_min
    third = max(span / 3, 1e-9)
    out = []
    for (label, pid), rows in sorted(sampler.series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        start = np.array([rss for t, rss, _ in rows if warmup_min <= t < warmup_min + third])
        end = np.array([rss for t, rss, _ in rows if t >= last - third])
        out.append({
            "process": label, "pid": pid, "serving": serving_process(label), "kind": judged_kind(label),
            "first_min": rows[0][0], "last_min": rows[-1][0],
            "whole_run": rows[0][0] == sampler.ticks[0] and rows[-1][0] == last,
            "start_mb": float(np.median(start)) if len(start) else None,
            "end_mb": float(np.median(end)) if len(end) else None,
            "max_mb": max(rss for _, rss, _ in rows),
            "fds": (rows[0][2], rows[-1][2]),
            "judged": span >= 3 and len(start) > 1 and len(end) > 1,
        })  # fmt: skip
        out[-1]["slope_mb_per_min"] = minute_medians_slope(minute_medians(rows, rows[0][0]), warmup_min - rows[0][0])
        if len(start) and len(end):
            out[-1]["growth_mb"] = out[-1]["end_mb"] - out[-1]["start_mb"]
            error = 1.25 * float(np.sqrt(start.var() / len(start) + end.var() / len(end)))
            out[-1]["allowed_mb"] = max(max_growth_mb, 2 * error)
    return out


def slope_mb_per_min(samples: list[tuple[float, float, int]], from_min: float) -> float | None:
    """Least-squares slope of RSS over the samples taken at or after `from_min` minutes."""
    tail = [(t, rss) for t, rss, _ in samples if t >= from_min]
    if len(tail) < 3:
        return None
    t, rss = np.array(tail).T
    return float(np.polyfit(t, rss, 1)[0])


def minute_medians(samples: list[tuple[float, float, int]], since: float = 0.0) -> list[float]:
    """The median RSS (MB) of each whole minute's samples from minute `since` of the run (0: the
    first sample's), minute 0 first (a last minute cut short is left out): a reload holds two
    pairs for a moment, a sawtooth of a few MB that sways a fit over raw samples (and more so
    over a short window); the median of a minute does not see it."""
    minutes: dict[int, list[float]] = {}
    for t, rss, _ in samples:
        minutes.setdefault(int(t - since), []).append(rss)
    whole = int(samples[-1][0] - since) if samples else 0
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
    """A version whose index files (a sharded version's: each shard's) are cut short, and a name no
    version has."""
    live = artifacts.version_dir(root)
    staging = artifacts.index_staging_dir(root)
    for path in live.rglob("*"):
        target = staging / path.relative_to(live)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            shutil.copy2(path, target)
    for index_file in staging.rglob(artifacts.INDEX_FILE):
        index_file.write_bytes(index_file.read_bytes()[: index_file.stat().st_size // 3])
    damaged = artifacts.new_version_name("damaged00000000")
    artifacts.publish_version(root, staging, damaged, make_current=False)
    return [damaged, "v-no-such-version"]


# -- what a soak serves --------------------------------------------------------------------------

SIDE = 224  # the synthetic catalog's images and its model's input: what users send


@dataclass
class Served:
    """A model (`folder`/model) and the catalog its index versions are built from (None: the
    model's test split, as a demo run's index was): an index root of S shards built from them
    once, in `folder`, and copied for each soak."""

    folder: Path
    catalog: Path | None = None

    def index_root(self, shards: int, env: dict[str, str]) -> Path:
        built = self.folder / ("index" if shards == 1 and self.catalog is None else f"index-s{shards}")
        if artifacts.current_version(built) is None:
            command = [
                sys.executable, "-m", "index", "build", "--model", str(self.folder / "model"), "--index-root",
                str(built), "--shards", str(shards), "--no-progress",
            ]  # fmt: skip
            command += ["--catalog", str(self.catalog)] if self.catalog else []
            subprocess.run(command, cwd=ROOT, env=env, check=True)
        return built


def demo_run(run: Path) -> Served:
    harness.ensure_artifacts(run, quick=False)
    return Served(run)


def synthetic_run(folder: Path, count: int, dim: int = 64) -> Served:
    """`count` 224-px JPEG images in 50 classes (`harness.photo_like_images`) and their catalog,
    and a 224-px model whose graph is an average pool to 8×8 and one projection to `dim`
    (tests/support/index.py: a query's cost at the server is its decoding, its pixels' trip to
    the model and its search, as with a real model less the network's own time), written into
    `folder` once."""
    from tests.support.index import write_tiny_model

    catalog = folder / "images" / "catalog.csv"
    if not catalog.is_file():
        catalog.parent.mkdir(parents=True, exist_ok=True)
        images, labels = harness.photo_like_images(count, side=SIDE)
        partial = catalog.with_suffix(".partial")
        with open(partial, "w", newline="") as out:  # paths relative to the catalog
            writer = csv.writer(out)
            writer.writerow(["id", "path", "label"])
            for n, (image, label) in enumerate(zip(images, labels, strict=True)):
                (catalog.parent / f"{n:06d}.jpg").write_bytes(image)
                writer.writerow([f"img{n:06d}", f"{n:06d}.jpg", f"class{label:02d}"])
        partial.rename(catalog)  # a catalog is there once every image is
    if not (folder / "model" / artifacts.MANIFEST).is_file():
        write_tiny_model(folder / "model", dim=dim, side=SIDE)
    return Served(folder, catalog)


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\S* (?P<level>[A-Z]+) ")


def log_records_of_note(log: Path, bad_versions: list[str]) -> list[tuple[str, str]]:
    """The server's log records (text format: a record's first line starts with its time and
    level, a traceback's lines follow it) at WARNING and above, as (level, the record in one
    line: its first line, and its last where it has more), bar what the bad input must cause —
    the bad requests' INVALID_ARGUMENT and every record naming a bad version."""
    records: list[list[str]] = []
    for line in log.read_text(errors="replace").splitlines():
        if LOG_RECORD.match(line) or not records:
            records.append([line])
        else:
            records[-1].append(line)
    noted = []
    for record in records:
        found = LOG_RECORD.match(record[0])
        level = found.group("level") if found else "?"
        text = "\n".join(record)
        if level not in ("WARNING", "ERROR", "CRITICAL") and "Traceback" not in text:
            continue
        if "code=INVALID_ARGUMENT" in record[0] or any(version in text for version in bad_versions):
            continue
        noted.append((level, record[0] if len(record) == 1 else f"{record[0]} … {record[-1].strip()}"))
    return noted


def soak(
    served: Served,
    minutes: float,
    reload_every: float,
    concurrency: int,
    sample_every: float,
    warmup_min: float,
    bad_reload_every: int,
    server_flags: list[str],
    settle_min: float = 5.0,
    http_share: float = 0.0,
    ray: bool = False,
    shards: int = 1,
    server_log: Path | None = None,
    max_growth_mb: float = 8.0,
) -> dict:
    began = time.monotonic()

    def say(what: str) -> None:
        print(f"[{time.monotonic() - began:5.0f} s] {what}", flush=True)

    with contextlib.ExitStack() as stack:
        stack.callback(lambda: say("stopped"))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        env = stack.enter_context(harness.local_ray()) if ray else {**os.environ, "PYTHONPATH": str(ROOT)}
        root = tmp / "index"
        shutil.copytree(served.index_root(shards, env), root)
        say(f"index of {shards} shard{'s' if shards > 1 else ''} ready")
        bad_versions = damaged_and_missing_versions(root) if reload_every else []
        log = tmp / "server.log"
        command = [
            sys.executable, "-m", "serving", "serve", *(["--ray"] if ray else []), "--index-root", str(root),
            "--port", "0", "--metrics-port", str(harness.free_port()), "--http-port", "0", "--admin-token", TOKEN,
            "--log-format", "text", *([] if ray else ["--processes", "1"]), *server_flags,
        ]  # fmt: skip
        proc, ports = harness.serving(command, env, log)
        say(f"{' '.join(command[2 : 5 if ray else 4])} serving: {ports}")
        target = f"127.0.0.1:{ports['port']}"
        try:
            with grpc.insecure_channel(target) as channel:
                info = pb_grpc.SimilaritySearchStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
            traffic = Traffic.build(IndexVersion.live(root), info.embedding_dim, info.limits.max_k)
            tally = Tally()
            sampler = Sampler(proc.pid, sample_every, ray)
            sampler.start()

            async def main() -> float:
                began = time.monotonic()
                stop_at = began + minutes * 60
                over_http = round(concurrency * http_share)
                jobs = [callers(target, traffic, concurrency - over_http, stop_at, tally)]
                if over_http:
                    jobs.append(http_callers(f"127.0.0.1:{ports['http_port']}", traffic, over_http, stop_at, tally))
                if reload_every:
                    jobs.append(reloader(target, reload_every, bad_reload_every, bad_versions, stop_at, tally))
                await asyncio.gather(*jobs)
                return time.monotonic() - began

            wall = asyncio.run(main())
            sampler.stopped.set()
            sampler.join()
            noted = log_records_of_note(log, bad_versions)  # before it stops: what the traffic met
            say(f"traffic done: {tally.queries:,} queries, {sum(tally.unexpected.values())} unexpected")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            if server_log is not None:
                shutil.copyfile(log, server_log)
    main_label = "ingress" if ray else "serve"
    samples = sampler.of(main_label)
    rss = [s[1] for s in samples]
    medians = minute_medians(samples)
    latencies = {kind: np.asarray(v) * 1e3 for kind, v in tally.latencies.items()}
    every = np.concatenate(list(latencies.values())) if latencies else np.zeros(1)
    return {
        "server": f"serve --ray, S = {shards}" if ray else f"serve, S = {shards}",
        "ray": ray,
        "shards": shards,
        "minutes": minutes,
        "reload_every_s": reload_every,
        "http_share": http_share,
        "concurrency": concurrency,
        "queries": tally.queries,
        "qps": tally.queries / wall,
        "p50_ms": float(np.percentile(every, 50)),
        "p99_ms": float(np.percentile(every, 99)),
        "latency_ms": {
            kind: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
            for kind, v in sorted(latencies.items())
        },
        "unexpected": sum(tally.unexpected.values()),
        "unexpected_by_kind": {f"{k}:{c}": n for (k, c), n in tally.unexpected.items()},
        "unexpected_messages": {f"{k}:{c}": said for (k, c), said in tally.messages.items()},
        "statuses": {f"{k}:{c}": n for (k, c), n in sorted(tally.statuses.items())},
        "reloads_ok": tally.reloads_ok,
        "reloads_failed": tally.reloads_failed,
        "bad_reloads_refused": tally.bad_reloads_refused,
        "bad_reloads_wrong": tally.bad_reloads_wrong,
        "processes": memory_by_process(sampler, warmup_min, max_growth_mb),
        "server_log_warnings": sum(level == "WARNING" for level, _ in noted),
        "server_log_errors": [line for level, line in noted if level != "WARNING"],
        "server_log_first": [line for _, line in noted[:20]],
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
        "samples": {f"{label}:{pid}": [[round(t, 3), round(r, 2), f] for t, r, f in rows]
                    for (label, pid), rows in sampler.series.items()},
    }  # fmt: skip


def failures(r: dict, max_growth_mb: float) -> list[str]:
    """Why a run failed, a line a reason: unexpected statuses, reloads that went wrong, a serving
    process that exited or was replaced, or one that grew over `max_growth_mb`."""
    out = []
    if not r["queries"]:
        out.append("no query was answered")
    if r["unexpected"]:
        out.append(f"{r['unexpected']} unexpected statuses: {r['unexpected_by_kind']}")
    if r["reloads_failed"]:
        out.append(f"{len(r['reloads_failed'])} reloads of CURRENT failed: {r['reloads_failed'][:3]}")
    if r["server_log_errors"]:
        out.append(f"the server logged {len(r['server_log_errors'])} errors; the first: {r['server_log_errors'][0]}")
    if r["bad_reloads_wrong"]:
        out.append(f"{len(r['bad_reloads_wrong'])} bad reloads did not fail as they must: {r['bad_reloads_wrong'][:3]}")
    for p in r["processes"]:
        kind = p.get("kind", "serving" if p["serving"] else "other")
        if kind == "other":
            continue
        if kind == "serving" and not p["whole_run"]:
            out.append(f"{p['process']} (pid {p['pid']}) was sampled only from minute {p['first_min']:.1f} to "
                       f"{p['last_min']:.1f}: it exited or was replaced")  # fmt: skip
        if p["judged"] and p["growth_mb"] > p["allowed_mb"]:
            allowed = f"{p['allowed_mb']:.1f} MB allowed" + (
                f" (--max-growth-mb {max_growth_mb:g})" if p["allowed_mb"] == max_growth_mb else " (its own swing)"
            )
            out.append(
                f"{p['process']} (pid {p['pid']}) grew {p['growth_mb']:+.1f} MB after the warm-up "
                f"({p['start_mb']:.0f} → {p['end_mb']:.0f} MB), over the {allowed}"
            )
    return out


def fmt_slope(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} MB/min"


def fmt_mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MB"


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


def show_run(name: str, r: dict) -> None:
    """A run's traffic figures and its processes' memory."""
    kinds = "; ".join(f"{kind} {v['p50']:.1f} / {v['p99']:.1f} ms" for kind, v in r["latency_ms"].items())
    print(f"\n{name} ({r['server']}, {r['concurrency']} callers, {r['http_share']:.0%} over HTTP): "
          f"{r['queries']:,} queries, {r['qps']:.0f} q/s; good queries' p50 / p99 {r['p50_ms']:.1f} / "
          f"{r['p99_ms']:.1f} ms ({kinds})")  # fmt: skip
    print(f"statuses: {r['statuses']}")
    for kind, said in r["unexpected_messages"].items():
        print(f"unexpected {kind}: {r['unexpected_by_kind'][kind]}, e.g. {said}")
    print(f"\n| process | pid | RSS at the start (first third after {r['warmup_min']:g} min) "
          "| RSS at the end (last third) | growth | allowed | slope of minute medians after the warm-up "
          "| max | open fds |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in r["processes"]:
        growth = "n/a" if p.get("growth_mb") is None else f"{p['growth_mb']:+.1f} MB"
        if p.get("kind", "serving" if p["serving"] else "other") == "other":
            allowed = "comes and goes, not judged"
        elif not p["judged"]:
            allowed = "not judged: a short run"
        else:
            over = p["growth_mb"] > p["allowed_mb"]
            allowed = f"{p['allowed_mb']:.1f} MB{' — FAILED' if over else ''}"
        print(f"| {p['process']} | {p['pid']} | {fmt_mb(p['start_mb'])} | {fmt_mb(p['end_mb'])} | {growth} "
              f"| {allowed} | {fmt_slope(p.get('slope_mb_per_min'))} | {p['max_mb']:.0f} MB "
              f"| {p['fds'][0]} → {p['fds'][1]} |")  # fmt: skip
    if r["server_log_first"]:
        print(
            f"\nthe server's log under the traffic: {r['server_log_warnings']} warnings, "
            f"{len(r['server_log_errors'])} errors (bar the bad input's); the first 20 by kind:"
        )
        kinds = Counter(LOG_RECORD.sub("", line, count=1) for line in r["server_log_first"])
        print("\n".join(f"  {n} × {kind}" for kind, n in kinds.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path,
                        help="a demo run (model/, index/), made if absent (default runs/demo); with --synthetic, "
                             "where its catalog and model are kept (default runs/soak-224px-N)")  # fmt: skip
    parser.add_argument(
        "--synthetic", type=int, metavar="N",
        help="serve a catalog of N 224-px JPEG images and a 224-px tiny model instead of a demo run",
    )  # fmt: skip
    parser.add_argument("--ray", action="store_true", help="soak `serve --ray` on a local Ray (this process starts it)")
    parser.add_argument("--shards", type=int, help="shards of the served version (default 4 with --ray, else 1)")
    parser.add_argument("--minutes", type=float, default=15.0, help="length of each run")
    parser.add_argument("--reload-every", type=float, default=20.0, help="seconds between reloads")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-min", type=float, default=2.0, help="minutes left out of the slope")
    parser.add_argument("--settle-min", type=float, default=5.0, help="minutes left out of the minute medians' spread")
    parser.add_argument(
        "--max-growth-mb", type=float, default=8.0,
        help="fail when a serving process's RSS grows more than this (or than twice the growth's standard error, "
        "where its swing makes that larger) from the first third after the warm-up to the last",
    )  # fmt: skip
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
    parser.add_argument("--server-log", type=Path, help="copy the (last run's) server log here")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.reload_every <= 0 or args.concurrency < 1 or args.sample_every <= 0:
        parser.error("--minutes, --reload-every and --sample-every must be > 0, --concurrency ≥ 1")
    if not 0 <= args.http_share <= 1:
        parser.error(f"--http-share must be within [0, 1], got {args.http_share}")
    if args.warmup_min >= args.minutes:
        parser.error(f"--warmup-min ({args.warmup_min}) must be shorter than --minutes ({args.minutes})")
    shards = args.shards or (4 if args.ray else 1)
    if shards < 1 or (args.synthetic is not None and not shards <= args.synthetic):
        parser.error(f"--shards must be between 1 and the catalog's images, got {shards}")
    if args.synthetic is not None and args.synthetic < 64:
        parser.error(f"--synthetic needs at least 64 images (the queries are 64 of them), got {args.synthetic}")
    if args.synthetic is not None:
        served = synthetic_run((args.run or ROOT / "runs" / f"soak-224px-{args.synthetic}").resolve(), args.synthetic)
    else:
        served = demo_run((args.run or ROOT / "runs" / "demo").resolve())
    runs = {f"{args.minutes:g} min, reload every {args.reload_every:g} s": args.reload_every}
    if args.baseline:
        runs[f"{args.minutes:g} min, no reload"] = 0.0
    results = {}
    for name, every in runs.items():
        print(f"== {name}", flush=True)
        results[name] = soak(
            served, args.minutes, every, args.concurrency, args.sample_every, args.warmup_min,
            args.bad_reload_every, args.server_flag, args.settle_min, args.http_share, args.ray, shards,
            args.server_log, args.max_growth_mb,
        )  # fmt: skip
        summary = {
            k: v for k, v in results[name].items() if k not in ("samples", "statuses", "processes", "server_log_lines")
        }
        print(json.dumps(summary), flush=True)
    who = "ingress" if args.ray else "server"
    print(
        f"\n| run | queries | unexpected statuses | reloads | {who} RSS first → last (max) "
        f"| slope after {args.warmup_min:g} min | slope, second half | slope of minute medians | open fds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, result in results.items():
        print(row(name, result))
    for name, result in results.items():
        show_run(name, result)
    for name, result in results.items():
        print(f"\n{name}: {who} RSS minute medians (MB), minute 0 on:")
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
    failed = [
        f"{name}: {reason}" for name, result in results.items() for reason in failures(result, args.max_growth_mb)
    ]
    print()
    for reason in failed:
        print(f"FAILED: {reason}")
    if not failed:
        print("passed: no unexpected status, every reload as it must be, every serving process alive, and it and "
              "Ray's own within their allowed growth where judged")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
