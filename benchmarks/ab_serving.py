"""Interleaved A/B of server configurations: the same h2load load on servers that differ only in
their `serve` flags.

    python benchmarks/ab_serving.py --run runs/bench-mobilenet_v2-224 --rounds 6 \\
        --config "one stream=--batch-streams 1" --config "default="

Every round starts each configuration's server in turn (benchmarks/harness.py's server start, h2load
load, warm-up and /proc CPU reading), so the drift of a shared machine hits them alike. Printed:
each round as it ends, then per configuration and concurrency the medians, and for every
configuration after the first the median of its per-round ratios to the first (q/s and server
CPU per query) with the rounds it was ahead in. Not part of `make bench`: it compares the
configurations you name, on artifacts that already exist.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks import harness
from core.data.catalog import read_catalog


def parse_config(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--config takes NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name.strip(), tuple(shlex.split(flags))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/demo", help="directory with index/ and train/splits/test.csv")
    parser.add_argument("--config", action="append", type=parse_config, default=[], help="NAME=FLAGS, twice or more")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 32], help="concurrency levels (default 1 32)")
    parser.add_argument("--seconds", type=float, default=5.0, help="load duration per level")
    parser.add_argument("--query-image", type=Path, help="the image every query sends (default: the first test image)")
    parser.add_argument("--json", type=Path, help="also write every round's figures here")
    args = parser.parse_args()
    names = [name for name, _ in args.config]
    if len(names) < 2:
        parser.error("name at least two --config NAME=FLAGS to compare")
    if len(set(names)) != len(names):
        parser.error(f"--config names must differ, got {', '.join(names)}")
    if args.rounds < 1 or args.seconds <= 0 or min(args.levels) < 1:
        parser.error("--rounds and --levels must be ≥ 1 and --seconds > 0")
    if shutil.which("h2load") is None:
        parser.error("h2load not found: install Debian's nghttp2-client (setup.sh does)")
    run = Path(args.run).resolve()
    catalog = run / "train" / "splits" / "test.csv"
    if not (run / "index").is_dir() or not catalog.is_file():
        parser.error(f"{run} has no index/ or train/splits/test.csv: run the demo or bench_serving first")
    image = args.query_image or read_catalog(catalog).paths[0]
    if not Path(image).is_file():
        parser.error(f"--query-image {image} is not a file")

    workdir = Path(tempfile.mkdtemp(prefix="ab-serving-"))
    load = harness.h2load_sending(Path(image).read_bytes(), workdir)
    rounds: dict[str, list[list[dict]]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name, flags in args.config:
            figures = harness.serve_and_load(run, None, load, args.seconds, flags, args.levels)
            rounds[name].append(figures)
            cells = ", ".join(
                f"c={r['concurrency']} {r['qps']:.0f} q/s p50 {r['p50_ms']:.2f} ms "
                f"{r['server_cpu_ms_per_query']:.2f} ms CPU/q batch {r.get('mean_batch', 0):.1f}"
                for r in figures
            )
            print(f"round {i + 1}/{args.rounds} {name}: {cells}", flush=True)

    columns = ["config", "concurrency", "q/s", "p50 ms", "p99 ms", "server CPU ms/q", "mean batch", "errors"]
    print("\n| " + " | ".join([*columns, "vs first (q/s, CPU)"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    first = names[0]
    for name in names:
        for level, merged in enumerate(harness.median_rounds(rounds[name])):
            versus = "–"
            if name != first:
                pairs = [(r[level], f[level]) for r, f in zip(rounds[name], rounds[first], strict=True)]
                qps = statistics.median(r["qps"] / f["qps"] for r, f in pairs)
                cpu = statistics.median(r["server_cpu_ms_per_query"] / f["server_cpu_ms_per_query"] for r, f in pairs)
                ahead = sum(r["qps"] > f["qps"] for r, f in pairs)
                versus = f"{qps:.2f}×, {cpu:.2f}× (ahead in {ahead}/{len(pairs)})"
            print(
                f"| {name} | {merged['concurrency']} | {merged['qps']:.0f} {merged['qps_rounds']} | "
                f"{merged['p50_ms']:.2f} | {merged['p99_ms']:.2f} | {merged['server_cpu_ms_per_query']:.2f} | "
                f"{merged.get('mean_batch', 0):.1f} | {merged.get('errors', 0):.0f} | {versus} |"
            )
    shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        report = {"configs": dict(args.config), "image": str(image), "rounds": rounds}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
