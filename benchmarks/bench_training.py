"""Training quality on the embedded glyph set, in one identical setup for every loss.

Our `raw_vthm` and `proxy_anchor` against pytorch-metric-learning's twins
(`pml_multi_similarity` = MultiSimilarityMiner + MultiSimilarityLoss, `pml_proxy_anchor`), each
trained with Ray Train over the same split, backbone, sampler, epochs and seeds; test-class
Recall@K as mean ± std over the seeds, beside the untrained network. Then `raw_vthm` with 1 and
with 2 Ray Train workers: Recall@1 and images/s of each.

    python benchmarks/bench_training.py            # 3 seeds, full glyph set (~20 min on 2 cores)
    python benchmarks/bench_training.py --quick    # 1 seed, a slice (a check that it runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.train import TrainConfig, run_training  # noqa: E402

KS = ("1", "2", "4", "8")
LOSSES = ("raw_vthm", "pml_multi_similarity", "proxy_anchor", "pml_proxy_anchor")


def train(work: Path, name: str, **options) -> dict:
    out = run_training(TrainConfig(out=str(work / name), progress=False, plots=False, **options))
    return json.loads((out / "results.json").read_text())


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):6.2f} ± {100 * spread:4.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed on a slice of the classes")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--proxy-lr", type=float, default=1e-2, help="proxies' rate for both proxy losses")
    parser.add_argument("--json", help="also write every run's figures here")
    args = parser.parse_args()
    seeds = range(1 if args.quick else args.seeds)
    common = {"epochs": 2 if args.quick else args.epochs}
    if args.quick:
        common.update(max_classes=40, max_per_class=40, classes_per_batch=10)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for loss in LOSSES:
            extra = {"proxy_lr": args.proxy_lr} if "proxy" in loss else {}
            for seed in seeds:
                runs.setdefault(loss, []).append(train(work, f"{loss}-{seed}", loss=loss, seed=seed, **common, **extra))
                print(f"  {loss} seed {seed}: R@1 {runs[loss][-1]['trained']['recall_at_k']['1']:.4f}", flush=True)
        workers = {n: train(work, f"workers-{n}", loss="raw_vthm", seed=0, num_workers=n, **common) for n in (1, 2)}

    first = next(iter(runs.values()))
    print(f"\nTest-class Recall@K (%), mean ± std over {len(first)} seed(s), {common['epochs']} epochs, glyph set")
    print(f"{'':22}" + "".join(f"{'R@' + k:>16}" for k in KS))
    untrained = [r["untrained"]["recall_at_k"] for r in first]
    print(f"{'untrained':22}" + "".join(f"{mean_std([u[k] for u in untrained]):>16}" for k in KS))
    for loss, results in runs.items():
        row = "".join(f"{mean_std([r['trained']['recall_at_k'][k] for r in results]):>16}" for k in KS)
        print(f"{loss:22}{row}")
    for ours, theirs in (("raw_vthm", "pml_multi_similarity"), ("proxy_anchor", "pml_proxy_anchor")):
        a = [r["trained"]["recall_at_k"]["1"] for r in runs[ours]]
        b = [r["trained"]["recall_at_k"]["1"] for r in runs[theirs]]
        print(f"R@1 {ours} − {theirs}: {100 * (statistics.mean(a) - statistics.mean(b)):+.2f} points")

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
        Path(args.json).write_text(json.dumps({"losses": runs, "workers": workers}, indent=1))


if __name__ == "__main__":
    main()
