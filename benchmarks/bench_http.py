"""HTTP/JSON against gRPC on the same server, in the same run: is the second transport as fast?

    python -m benchmarks.bench_http [--run runs/demo] [--seconds 5] [--rounds 3]

One `python -m serving serve` with both ports over the run's index (the demo's, made with
`make demo` when missing); the project's load generator (`benchmarks/loadgen.py`, its own
process) searches by image (gRPC `Search` with the image bytes; HTTP the raw image as the body
of `POST /v1/search/image`) and by item id (`Search{item_id}`; `POST /v1/search` with
`{"itemId": …}`), at each concurrency, gRPC and HTTP alternating within a round. Printed: the
median over rounds of each side's q/s and p50/p99, HTTP's q/s as a fraction of gRPC's and the
p50 it adds. Goals (issue 33): HTTP ≥ 80% of gRPC's q/s at concurrency 32, ≤ 2 ms added p50 at 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

from benchmarks.harness import ensure_artifacts, free_port, healthy, python_loadgen, start, stop

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("image", "item")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo", help="a demo run (model/, index/)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    ensure_artifacts(args.run, quick=False)
    catalog = args.run / "train" / "splits" / "test.csv"
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    server = start(
        [sys.executable, "-m", "serving", "serve", "--index-root", str(args.run / "index"), "--port", str(grpc_port)]
        + ["--http-port", str(http_port), "--metrics-port", str(metrics_port), "--probe-interval-s", "3600"]
        + ["--processes", "1"],
        lambda: healthy(metrics_port),
    )
    results: dict[tuple[str, str, int], list[dict]] = {}
    try:
        for round_ in range(args.rounds):
            for kind in KINDS:
                for c in levels:
                    order = ("grpc", "http") if round_ % 2 == 0 else ("http", "grpc")
                    for protocol in order:
                        port = grpc_port if protocol == "grpc" else http_port
                        results.setdefault((kind, protocol, c), []).append(
                            python_loadgen(port, catalog, c, args.seconds, protocol, kind)
                        )
    finally:
        stop(server)

    def median(kind: str, protocol: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(kind, protocol, c)])

    print(
        f"\n{platform.node()}: {os.cpu_count()} cores; {args.run / 'index'}; {args.seconds:g} s a measurement, "
        f"median of {args.rounds} rounds, gRPC and HTTP alternating\n"
    )
    print("| query | concurrency | gRPC q/s | HTTP q/s | HTTP ÷ gRPC | gRPC p50 ms | HTTP p50 ms | added p50 ms | "
          "gRPC p99 ms | HTTP p99 ms | errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        for c in levels:
            g, h = (median(kind, p, c, "qps") for p in ("grpc", "http"))
            g50, h50 = (median(kind, p, c, "p50_ms") for p in ("grpc", "http"))
            g99, h99 = (median(kind, p, c, "p99_ms") for p in ("grpc", "http"))
            errors = sum(r["errors"] for p in ("grpc", "http") for r in results[(kind, p, c)])
            print(
                f"| {kind} | {c} | {g:,.0f} | {h:,.0f} | {h / g:.2f} | {g50:.2f} | {h50:.2f} | {h50 - g50:+.2f} | "
                f"{g99:.2f} | {h99:.2f} | {errors} |"
            )
    top, low = max(levels), min(levels)
    for kind in KINDS:
        ratio = median(kind, "http", top, "qps") / median(kind, "grpc", top, "qps")
        added = median(kind, "http", low, "p50_ms") - median(kind, "grpc", low, "p50_ms")
        print(
            f"{kind}: HTTP at concurrency {top} = {ratio:.0%} of gRPC's q/s (goal ≥ 80%: "
            f"{'met' if ratio >= 0.8 else 'NOT met'}); added p50 at {low}: {added:+.2f} ms (goal ≤ 2 ms: "
            f"{'met' if added <= 2 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
