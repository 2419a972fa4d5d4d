"""Soak: a real server under mixed good and bad traffic for minutes, reloaded every R seconds, the
resident memory of each of its processes sampled — does it hold up for weeks?

    python -m benchmarks.soak --run runs/demo --minutes 30 --reload-every 20 --no-baseline
    python -m benchmarks.soak --ray --shards 4 --synthetic 20000 --minutes 15 --no-baseline   # make soak
    python -m benchmarks.soak --processes 2 --synthetic 20000 --minutes 15 --no-baseline

The server is `python -m serving serve` in its own process (`--processes N`: N worker processes
under a supervisor, `serving.workers`), or with `--ray` `serve --ray` on a local Ray this process
starts (the ingress, the embedder and a deployment per shard, each its own Ray worker process),
over a copy of an index of `--shards` S shards, with gRPC and HTTP ports. What it serves: a demo
run's model and index (`--run`, made if absent), or with `--synthetic N` a catalog of N 224-px JPEG
images (what users send) and a 224-px model whose graph is an average pool and one projection
(tests/support/index.py), written once into `--run` (runs/soak-224px-N by default). The S-shard
index is built once from the run's model and catalog (`index build --shards S`) and copied for each
run.

C asyncio callers (32; `--http-share` of them, half by default, over HTTP/JSON: image queries as
a raw body or proto3 JSON, the rest as JSON) send, by weight: image queries 60%, embedding
queries 10%, and the rest bad input of seven kinds (garbage bytes, a truncated image, an
embedding of the wrong dimension, a NaN, k above the limit, an unknown item id, a request with no
query), each of which must answer INVALID_ARGUMENT; every good query must answer OK. Every R
seconds an authenticated `Reload` of CURRENT loads a fresh model+index pair and swaps it in;
every `--bad-reload-every`-th time a reload of a damaged version (its index files cut short)
and one of a missing version go first, and must fail with FAILED_PRECONDITION while the live
pair keeps serving. With `--processes N` the worker that takes a Reload relays it to the others
before it answers (`serving/api/siblings.py`), so every worker must end on CURRENT's version; the
gRPC callers each have a connection of their own, since the kernel spreads connections, not
calls, over the workers.

Every few seconds the RSS and open file descriptors of each process are sampled: the server's; with
`--processes N` also each worker's (worker-0, …); with `--ray` also every Ray process under this
one — each replica by its deployment (ingress, embedder, shard-000, …), the Serve controller, the
log queue, idle workers, the raylet, the GCS, Ray's dashboard and runtime-env agents and its log
monitor. Printed: a table row per run — queries, unexpected statuses, reloads, the server's (with
`--processes N` worker-0's, with `--ray` the ingress's) RSS first → last (max), and its RSS slope
(least squares, MB/min) after the warm-up, over the second half and over the minute medians — then
q/s and the good queries' p50/p99, each process's RSS at the start (the median of its samples in
the first third of what follows `--warmup-min`) and at the end (the median of the last third's),
its growth and the slope of its minute medians after the warm-up, then the minute medians of the
server (the ingress) with their slope and spread from `--settle-min` (5) on.

The soak fails (exit status 1, each reason on a `FAILED:` line) on any unexpected status, a reload
of CURRENT that failed, a bad reload that did not fail as it must, an error in the server's log
(with `--ray` every replica's records reach it) other than what the bad input causes, a worker
(`--processes N`) that answered no call or does not serve CURRENT's version at the end, a serving
process (the server; each worker; with `--ray` the command, the ingress, the embedder, each shard
replica) that exited or was replaced, or one — or one of Ray's long-lived processes (the GCS, the
raylet, the dashboard, its agents, the log and autoscaler monitors, the Serve controller, the log
queue) — whose RSS grew from the start to the end by more than `--max-growth-mb` (8), or than twice
the growth's standard error where the process's own swing under load makes that larger — judged
when at least 3 minutes follow the warm-up (shorter windows are within the sawtooth of the
reloads). Printed with it: the unexpected statuses' first messages, and the server's log records at
WARNING and above, by kind.

The run without reloads (`--baseline`, on by default) is the same traffic on a server that is
never reloaded: the memory a reload leaves behind is the difference between the two slopes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from benchmarks import harness
from benchmarks.soak_memory import (
    Sampler,
    memory_by_process,
    minute_medians,
    minute_medians_slope,
    minute_medians_spread,
    slope_mb_per_min,
)
from benchmarks.soak_served import ROOT, Served, damaged_and_missing_versions, demo_run, synthetic_run
from benchmarks.soak_traffic import TOKEN, Tally, Traffic, callers, http_callers, reloader
from core.artifacts import layout as artifacts
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

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


SERVING_INDEX = re.compile(r" serving\.server: serving index (?P<version>\S+) .*\bworker=(?P<worker>\d+)")
WORKER_CALLS = re.compile(r'^simsearch_worker_calls_total\{worker="(\d+)"\} (\S+)$', re.MULTILINE)


def workers_after(log: Path, root: Path, metrics_port: int, processes: int, wait_s: float = 30.0) -> dict:
    """After the traffic, what each worker of `serve --processes N` did: the calls it answered
    (`simsearch_worker_calls_total` on the supervisor's /metrics), the loads its log records
    (`worker=I`) and the version it serves — the last it loaded — waited for up to `wait_s` until
    every worker serves CURRENT's (a reload still under way as the traffic stopped may end after it)."""
    current = artifacts.current_version(root)
    deadline = time.monotonic() + wait_s
    while True:
        found = list(SERVING_INDEX.finditer(log.read_text(errors="replace")))
        versions = {record["worker"]: record["version"] for record in found}  # the last of each
        loads = Counter(record["worker"] for record in found)
        if (len(versions) == processes and set(versions.values()) == {current}) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as metrics:
        calls = {worker: float(n) for worker, n in WORKER_CALLS.findall(metrics.read().decode())}
    return {"worker_calls": calls, "worker_versions": versions, "worker_loads": dict(loads), "current_version": current}


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
    processes: int = 1,
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
            "--log-format", "text", *([] if ray else ["--processes", str(processes)]), *server_flags,
        ]  # fmt: skip
        proc, ports = harness.serving(command, env, log)
        say(f"{' '.join(command[2 : 5 if ray else 4])} serving: {ports}")
        target = f"127.0.0.1:{ports['port']}"
        try:
            with grpc.insecure_channel(target) as channel:
                info = pb_grpc.SimilaritySearchStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
            traffic = Traffic.build(IndexVersion.live(root), info.embedding_dim, info.limits.max_k)
            tally = Tally()
            sampler = Sampler(proc.pid, sample_every, ray, workers=processes > 1)
            sampler.start()

            async def main() -> float:
                began = time.monotonic()
                stop_at = began + minutes * 60
                over_http = round(concurrency * http_share)
                over_grpc = concurrency - over_http  # with several workers a connection a caller, to reach each
                jobs = [callers(target, traffic, over_grpc, stop_at, tally, over_grpc if processes > 1 else 1)]
                if over_http:
                    jobs.append(http_callers(f"127.0.0.1:{ports['http_port']}", traffic, over_http, stop_at, tally))
                if reload_every:
                    jobs.append(reloader(target, reload_every, bad_reload_every, bad_versions, stop_at, tally))
                await asyncio.gather(*jobs)
                return time.monotonic() - began

            wall = asyncio.run(main())
            sampler.stopped.set()
            sampler.join()
            workers = workers_after(log, root, ports["metrics_port"], processes) if processes > 1 else {}
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
    main_label = "ingress" if ray else "worker-0" if processes > 1 else "serve"  # the one that answers
    named_workers = f", {processes} workers" if processes > 1 else ""
    samples = sampler.of(main_label)
    rss = [s[1] for s in samples]
    medians = minute_medians(samples)
    latencies = {kind: np.asarray(v) * 1e3 for kind, v in tally.latencies.items()}
    every = np.concatenate(list(latencies.values())) if latencies else np.zeros(1)
    return {
        "server": f"serve --ray, S = {shards}" if ray else f"serve, S = {shards}{named_workers}",
        "ray": ray,
        "worker_processes": processes,
        **workers,
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
    """Why a run failed, a line a reason: unexpected statuses, reloads that went wrong, a worker
    that answered no call or does not serve CURRENT's version at the end, a serving process that
    exited or was replaced, or one that grew over `max_growth_mb`."""
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
    if r.get("worker_processes", 1) > 1:  # `serve --processes N`: each worker took calls and followed CURRENT
        for worker in map(str, range(r["worker_processes"])):
            if not r["worker_calls"].get(worker):
                out.append(f"worker-{worker} answered no call: the traffic reached only the other workers")
            if (version := r["worker_versions"].get(worker)) != (current := r["current_version"]):
                out.append(f"worker-{worker} serves {version}, not CURRENT's {current}: it missed a reload")
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
    parser.add_argument(
        "--processes", type=int, default=1, metavar="N",
        help="soak `serve --processes N` (N worker processes under a supervisor, each sampled and judged; default 1)",
    )  # fmt: skip
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
    if args.processes < 1 or (args.ray and args.processes > 1):
        parser.error(f"--processes must be ≥ 1, and 1 with --ray (Ray runs the processes), got {args.processes}")
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
            args.server_log, args.max_growth_mb, args.processes,
        )  # fmt: skip
        summary = {
            k: v for k, v in results[name].items() if k not in ("samples", "statuses", "processes", "server_log_lines")
        }
        print(json.dumps(summary), flush=True)
    who = "ingress" if args.ray else "worker-0" if args.processes > 1 else "server"
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
