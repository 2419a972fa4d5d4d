"""Serving benchmark: queries/s and p50/p99 at concurrency 1/8/32/64 for both server modes —
dynamic batching on (`on`) and off (`off`: each query alone on one of `--workers` inference
threads, on every ONNX Runtime thread when it is the only one in flight and single-threaded
beside others) — against two baselines measured in the same run:

- the in-process ceiling: the same ONNX Runtime session and faiss index called directly, at
  batch 1/8/32/64 and at the mean batch size the server actually formed, each batch in one ORT
  run and split into runs as the server splits them (`--run-rows`), measured again in
  every round right after its servers; each ratio is one round's server figure over the same
  round's ceiling, and the median of those ratios is reported. Each mode is also compared with
  the same work done directly (batches of the size it formed; or single queries, one at a time
  at concurrency 1 and otherwise by as many threads at once, each on the session the server
  gives a query beside others) and with the best of all these ceilings. The ceiling's pair is
  loaded as the server loads it, from the server's own parsed flags (`--server-flag` included);
- the gRPC floor: a bare grpc.aio server answering with a canned response (no decode, model or
  index) under the same load — what Python gRPC alone allows on this machine.

The server runs as `python -m serving serve` in its own process. Load comes from h2load (C,
nghttp2's HTTP/2 benchmark, ~35 µs of CPU a query) sending one gRPC-framed SearchRequest, so the
load generator takes little of the cores it shares with the server; `--loadgen python` uses
benchmarks/loadgen.py (grpc.aio, a different image per query, ~0.3 ms of CPU a query) instead.
Errors are read from the server's own `simsearch_requests_total` (h2load sees HTTP, not gRPC
status). Each figure is the median of `--repeats` rounds, the modes interleaved, because the
figures of a shared virtual machine drift by 2× from minute to minute; server CPU ms/query (from
/proc) is reported beside them as the steadier measure of cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import (
    LEVELS,
    MODES,
    ROOT,
    Ceiling,
    ensure_artifacts,
    ensure_backbone_artifacts,
    floor_and_load,
    formed_batch,
    h2load_sending,
    median_rounds,
    python_loadgen,
    serve_and_load,
    serve_flags,
)
from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from serving.__main__ import server_config


def paired_ratios(rounds: dict[str, list[list[dict]]], ceiling_rounds: list[dict]) -> dict:
    """Per mode and concurrency, each round's server figures over the ceilings of the same round:
    against batch 32 in one ORT run; against the same work the server did (batching on: batches
    of the size it formed, split into runs as the server splits them, the better of one at a
    time on every thread and its streams' worth at once; off:
    single queries, one at a time at concurrency 1, else run by as many threads at once, each on
    the session the server gives a query beside others); against the best of them all; and the
    p50 the server adds to the ceiling's batch-1 latency with decoding."""
    out: dict[str, dict[int, dict[str, list[float]]]] = {}
    for mode in MODES:
        per_level: dict[int, dict[str, list[float]]] = {}
        for server_round, ceiling_round in zip(rounds[mode], ceiling_rounds, strict=True):
            batches, streams = ceiling_round["batches"], ceiling_round.get("streams", {})
            served = {b: {**c, "qps": c.get("qps_as_served", c["qps"])} for b, c in batches.items()}
            ceilings = [batches[32], served[32], ceiling_round["concurrent"], *streams.values()]
            best = max(c["qps"] for c in ceilings)
            for r in server_round:
                if mode == "on":
                    formed = formed_batch(r)
                    same = max((served[formed], streams.get(formed, served[formed])), key=lambda c: c["qps"])
                else:
                    same = batches[1] if r["concurrency"] == 1 else ceiling_round["concurrent"]
                figures = {
                    "vs_b32": r["qps"] / batches[32]["qps"],
                    "vs_b32_with_decode": r["qps"] / batches[32]["qps_with_decode"],
                    "vs_same_batch": r["qps"] / same["qps"],
                    "vs_best": r["qps"] / best,
                    "added_p50_ms": r["p50_ms"] - batches[1]["latency_with_decode_ms"],
                }
                level = per_level.setdefault(r["concurrency"], {key: [] for key in figures})
                for key, value in figures.items():
                    level[key].append(value)
        out[mode] = per_level
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--run", default="runs/demo", help="directory with model/ and index/ (built by the demo if missing)"
    )
    parser.add_argument("--quick", action="store_true", help="one short round; a glyph slice if artifacts are built")
    parser.add_argument("--seconds", type=float, help="load duration per concurrency level (default 5, quick 2)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds per mode; medians reported (default 3)")
    parser.add_argument("--loadgen", choices=["h2load", "python"], default="h2load", help="load generator")
    parser.add_argument(
        "--backbone", help="benchmark a production-size model instead of the demo's (e.g. mobilenet_v2)"
    )
    parser.add_argument("--pretrained", help="its weights (local file or pkg:<package>/<file>)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--server-flag", action="append", default=[], help="extra `serve` flag (repeatable)")
    args = parser.parse_args()
    if args.loadgen == "h2load" and shutil.which("h2load") is None:
        parser.error("h2load not found: install Debian's nghttp2-client (setup.sh does), or use --loadgen python")
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    if repeats < 1 or seconds <= 0:
        parser.error("--repeats must be ≥ 1 and --seconds > 0")
    if args.backbone and args.run == "runs/demo":
        args.run = f"runs/bench-{args.backbone}-{args.image_size}"
    run = (ROOT / args.run).resolve() if not Path(args.run).is_absolute() else Path(args.run)
    if args.backbone:
        ensure_backbone_artifacts(run, args.backbone, args.pretrained, args.image_size)
    else:
        ensure_artifacts(run, args.quick)
    catalog = run / "train" / "splits" / "test.csv"
    server_flags = tuple(f for flag in args.server_flag for f in flag.split())

    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    h2load_load = h2load_sending(read_catalog(catalog).paths[0].read_bytes(), workdir)

    def load(port: int, c: int, duration: float) -> dict:
        if args.loadgen == "python":
            return python_loadgen(port, catalog, c, duration)
        return h2load_load(port, c, duration)

    batched = server_config(serve_flags(run, "on", server_flags))
    unbatched = server_config(serve_flags(run, "off", server_flags))
    ceiling = Ceiling(batched, unbatched, catalog, repeats=5 if args.quick or args.backbone else 30)
    rounds: dict[str, list[list[dict]]] = {mode: [] for mode in [*MODES, "floor"]}
    # {"batches": {b: figures}, "concurrent": figures, "streams": {b: figures}}
    ceiling_rounds: list[dict] = []
    callers = unbatched.runtime.worker_threads
    for i in range(repeats):
        print(f"round {i + 1}/{repeats}", file=sys.stderr, flush=True)
        for mode in MODES:
            rounds[mode].append(serve_and_load(run, mode, load, seconds, server_flags))
        rounds["floor"].append(floor_and_load(load, LEVELS, seconds))
        formed = {formed_batch(r) for r in rounds["on"][-1]}
        ceiling_rounds.append(
            {
                "batches": ceiling.measure(set(LEVELS) | formed),
                "concurrent": ceiling.measure_concurrent(callers),
                "streams": {b: ceiling.measure_streams(b) for b in formed} if ceiling.streams > 1 else {},
            }
        )
    server = {mode: median_rounds(rounds[mode]) for mode in MODES}
    floor = {r["concurrency"]: r for r in median_rounds(rounds["floor"])}
    ratios = paired_ratios(rounds, ceiling_rounds)
    keys = ceiling_rounds[0]["batches"][1].keys()
    ceiling_median = {
        b: {key: statistics.median(c["batches"][b][key] for c in ceiling_rounds) for key in keys} for b in LEVELS
    }
    concurrent = {
        key: statistics.median(c["concurrent"][key] for c in ceiling_rounds) for key in ("qps", "cpu_ms_per_query")
    }

    print(
        f"\nServing benchmark on {os.cpu_count()} CPUs, index {artifacts.current_version(run / 'index')}, "
        f"{args.loadgen}, {seconds:g} s per level, median of {repeats} round(s)\n"
    )
    print("In-process ceiling (same ORT session + faiss index, called directly; median of the rounds):")
    print(f"{'batch':>6} {'q/s':>9} {'q/s +decode':>12} {'ms/batch':>9} {'CPU ms/q':>9} {'q/s as served':>14}")
    for b, c in ceiling_median.items():
        print(
            f"{b:>6} {c['qps']:9.0f} {c['qps_with_decode']:12.0f} {c['latency_ms']:9.2f} "
            f"{c['cpu_ms_per_query']:9.3f} {c['qps_as_served']:14.0f}"
        )
    embedder = ceiling.embedder
    print(
        f"(q/s: each batch in one ORT run; as served: in runs of at most {embedder.run_rows or 'the batch'} "
        f"images, and {embedder.side_by_side_run_rows or 'the batch'} beside another batch — the split the "
        "server's loader measured fastest in this process)"
    )

    def side_session(embedder) -> str:
        session = embedder.side_by_side_session
        return f"{session.get_session_options().intra_op_num_threads}-thread session" if session else "one session"

    print(
        f"single queries, {callers} threads at once, {side_session(ceiling.unbatched_embedder)}: "
        f"{concurrent['qps']:.0f} q/s, {concurrent['cpu_ms_per_query']:.3f} ms CPU/q"
    )
    if ceiling.streams > 1:  # at the batch size the server formed at concurrency 32, round by round
        at_c32 = [
            c["streams"][formed_batch(r)]
            for c, server_round in zip(ceiling_rounds, rounds["on"], strict=True)
            for r in server_round
            if r["concurrency"] == 32
        ]
        print(
            f"batches of the size formed at concurrency 32 ({statistics.median(s['batch'] for s in at_c32):.0f}), "
            f"{ceiling.streams} at once, {side_session(ceiling.embedder)}: "
            f"{statistics.median(s['qps'] for s in at_c32):.0f} q/s, "
            f"{statistics.median(s['cpu_ms_per_query'] for s in at_c32):.3f} ms CPU/q"
        )
    print("\ngRPC floor (bare grpc.aio server, canned response, same load):")
    for c, r in floor.items():
        cpu = r["server_cpu_ms_per_query"]
        print(f"  concurrency {c:>3}: {r['qps']:7.0f} q/s, p50 {r['p50_ms']:.2f} ms, {cpu:.3f} ms CPU/q")
    print("\nServer over gRPC (closed loop; ratios: median of each round over that round's ceiling):")
    header = f"{'mode':>8} {'conc':>5} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/q':>9} {'batch':>6}"
    print(header + f" {'errors':>6} {'vs b=32':>8} {'vs same':>8} {'vs best':>8} {'vs floor':>9}  rounds q/s")
    for mode, levels in server.items():
        for r in levels:
            c = r["concurrency"]
            paired = ratios[mode][c]
            print(
                f"{mode:>8} {c:>5} {r['qps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                f"{r['server_cpu_ms_per_query']:9.3f} {r.get('mean_batch', 0):6.1f} {r.get('errors', 0):>6.0f} "
                f"{statistics.median(paired['vs_b32']):8.0%} {statistics.median(paired['vs_same_batch']):8.0%} "
                f"{statistics.median(paired['vs_best']):8.0%} "
                f"{r['qps'] / floor[c]['qps']:9.0%}  {r['qps_rounds']}"
            )
    on = {r["concurrency"]: r for r in server["on"]}
    off = {r["concurrency"]: r for r in server["off"]}
    paired_summary = {
        "throughput_ratio_c32_vs_ceiling_b32": ratios["on"][32]["vs_b32"],
        "throughput_ratio_c32_vs_ceiling_b32_with_decode": ratios["on"][32]["vs_b32_with_decode"],
        "throughput_ratio_c32_vs_ceiling_same_batch": ratios["on"][32]["vs_same_batch"],
        "throughput_ratio_c32_unbatched_vs_ceiling_b32": ratios["off"][32]["vs_b32"],
        **{f"throughput_ratio_c32_{mode}_vs_best_ceiling": ratios[mode][32]["vs_best"] for mode in MODES},
        "added_p50_ms_c1": ratios["on"][1]["added_p50_ms"],
        "added_p50_ms_c1_unbatched": ratios["off"][1]["added_p50_ms"],
    }
    summary = {key: statistics.median(values) for key, values in paired_summary.items()}
    summary |= {
        "throughput_ratio_c32_vs_grpc_floor": on[32]["qps"] / floor[32]["qps"],
        "batching_speedup_c32": on[32]["qps"] / off[32]["qps"],
        "ceiling_cpu_ms_per_query_b32": ceiling_median[32]["cpu_ms_per_query"],
        "server_cpu_ms_per_query_c32": on[32]["server_cpu_ms_per_query"],
    }
    print("\nGoals: ≥ 90% of the ceiling at concurrency 32; ≤ 2 ms added to p50 at concurrency 1")
    for key, value in summary.items():
        rounds_note = f"  rounds {[round(v, 3) for v in paired_summary[key]]}" if key in paired_summary else ""
        print(f"  {key}: {value:.3f}{rounds_note}")
    out = run / "bench_serving.json"
    out.write_text(
        json.dumps(
            {
                "loadgen": args.loadgen,
                "seconds": seconds,
                "repeats": repeats,
                "ceiling_rounds": ceiling_rounds,
                "paired_ratios": ratios,
                "grpc_floor": rounds["floor"],
                "server_rounds": {m: rounds[m] for m in MODES},
                "server": server,
                "summary": summary,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
