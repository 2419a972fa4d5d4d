"""Training quality on the embedded glyph set, in one identical setup for every loss.

Our `raw_vthm` and `proxy_anchor` against pytorch-metric-learning's twins
(`pml_multi_similarity` = MultiSimilarityMiner + MultiSimilarityLoss, `pml_proxy_anchor`), each
trained with Ray Train over the same split, backbone, sampler, epochs and seeds; test-class
Recall@K as mean ± std over the seeds, beside the untrained network. Then `raw_vthm` with 1 and
with 2 Ray Train workers: Recall@1 and images/s of each.

    python benchmarks/bench_training.py            # 3 seeds, full glyph set (~25 min on 2 cores)
    python benchmarks/bench_training.py --quick    # 1 seed, a slice (a check that it runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from training.runs.benchmark import BenchmarkConfig, markdown_table, run_benchmark
from training.runs.config import TrainConfig
from training.runs.train import RESULTS_FILE, run_training

LOSSES = ["raw_vthm", "pml_multi_similarity", "proxy_anchor", "pml_proxy_anchor"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed on a slice of the classes")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--proxy-lr", type=float, default=1e-2, help="proxies' rate for both proxy losses")
    parser.add_argument("--json", help="also write every run's figures here")
    args = parser.parse_args()
    protocol = {"epochs": 2 if args.quick else args.epochs, "proxy_lr": args.proxy_lr}
    if args.quick:
        protocol.update(max_classes=40, max_per_class=40, classes_per_batch=10)
    with tempfile.TemporaryDirectory() as tmp:
        # The losses go through the loss benchmark itself: one protocol, seeds 0..N-1.
        cfg = BenchmarkConfig.from_values(
            {"out": tmp, "losses": LOSSES, "seeds": 1 if args.quick else args.seeds, **protocol}
        )
        table = json.loads((run_benchmark(cfg) / "results.json").read_text())
        workers = {}
        for n in (1, 2):
            run = TrainConfig(out=f"{tmp}/workers-{n}", num_workers=n, progress=False, plots=False, **protocol)
            workers[n] = json.loads((run_training(run) / RESULTS_FILE).read_text())

    print(
        f"\nTest-class Recall@K (%), mean ± std over {table['seeds']} seed(s), {protocol['epochs']} epochs, glyph set"
    )
    print(markdown_table(table))
    for ours, theirs in (("raw_vthm", "pml_multi_similarity"), ("proxy_anchor", "pml_proxy_anchor")):
        difference = table["rows"][ours]["R@1"]["mean"] - table["rows"][theirs]["R@1"]["mean"]
        print(f"R@1 {ours} − {theirs}: {100 * difference:+.2f} points")

    print("\nRay Train workers (raw_vthm, seed 0): test R@1, training images/s (median over epochs)")
    base = None
    for n, result in workers.items():
        speed = statistics.median(row["images_per_s"] for row in result["history"])
        base = base or speed
        print(
            f"  {n} worker(s): R@1 {100 * result['trained']['recall_at_k']['1']:.2f}  "
            f"{speed:,.0f} img/s  ({speed / base:.2f}× one worker)  {result['train_seconds']:.0f} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"losses": table, "workers": workers}, indent=1))


if __name__ == "__main__":
    main()
