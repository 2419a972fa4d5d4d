"""`python -m training {data,train,benchmark,export}`: the training stage's commands."""

from __future__ import annotations

import argparse
import json
import sys

from core.cli import add_verbose_flag, run_cli
from core.config import from_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="render a built-in data set (cached) and print its catalog path")
    data.add_argument(
        "--set", dest="data_set", choices=["glyphs", "icons"], default="glyphs",
        help="glyphs: font glyphs (the default data); icons: colour icons from Debian icon themes",
    )  # fmt: skip
    data.add_argument("--data-dir", help="where images and catalog.csv go (default data/<set>)")

    train = sub.add_parser("train", help="train an embedding model with Ray Train")
    train.add_argument("--config", help="YAML/TOML file with any of the options below")
    train.add_argument("--out", help="run directory to publish (default runs/train)")
    add_training_arguments(train)

    bench = sub.add_parser(
        "benchmark", help="train several losses × seeds under one protocol and tabulate test Recall@K"
    )
    bench.add_argument("--config", help="YAML/TOML file with any of the options below")
    bench.add_argument("--out", help="benchmark directory (default runs/loss-benchmark); re-run to resume")
    bench.add_argument("--losses", help="comma-separated registry names, or 'all' (the papers' losses)")
    bench.add_argument("--seeds", type=int, help="runs per loss, seeds 0..N-1 (default 3)")
    bench.add_argument(
        "--per-loss-options",
        dest="per_loss_options",
        type=json.loads,
        help='JSON {"loss": {"option": value}} for options of one loss (defaults: the papers\')',
    )
    bench.add_argument("--parallel", type=int, help="training jobs at once (default: as Ray's CPUs allow)")
    add_training_arguments(bench, protocol_only=True)

    export = sub.add_parser(
        "export", help="export a training run, or a pretrained network as it is, to a verified ONNX model artifact"
    )
    export.add_argument("--config", help="YAML/TOML file with any of the options below")
    export.add_argument("--run", help="training run directory (default runs/train)")
    export.add_argument("--backbone", help="with --pretrained: export this network with no training run")
    export.add_argument("--pretrained", help="torchvision state dict: a local file or pkg:<package>/<file>")
    export.add_argument("--pooling", choices=["gap", "gmp", "gap+gmp"], help="with --pretrained (default gap)")
    export.add_argument("--image-size", dest="image_size", type=int, help="with --pretrained (default: the backbone's)")
    export.add_argument(
        "--parity-catalog", dest="parity_catalog", help="images to check ONNX against PyTorch on (default: test split)"
    )
    export.add_argument("--out", help="model artifact directory to publish (default runs/model)")
    export.add_argument("--opset", type=int)
    export.add_argument("--parity-images", dest="parity_images", type=int)
    export.add_argument("--min-cosine", dest="min_cosine", type=float)
    export.add_argument("--variants", help="reduced-precision copies to publish beside it: fp16,int8")
    add_verbose_flag(sub)
    return parser


# Options of one training run. `benchmark` takes the protocol part: everything but what a
# benchmark varies itself (loss, seed) or manages per run (output, resume, progress, ...).
PER_RUN_OPTIONS = ("--loss", "--loss-options", "--seed", "--resume", "--progress", "--metrics-export-port", "--plots")


def _dimension(text: str) -> int | str:
    """An embedding width, or 'none' (kept as the string: None would read as "not given")."""
    if text.lower() == "none":
        return "none"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {text!r}") from None


def _option(*flags: str, **kwargs) -> tuple[tuple[str, ...], dict]:
    return flags, kwargs


TRAINING_OPTIONS = [
    _option("--catalog", help="catalog file or class-folder tree (default: embedded glyph set)"),
    _option("--dataset", help="a benchmark in its published layout: cub, cars196, sop, inshop"),
    _option("--data-root", dest="data_root", help="folder holding the --dataset (never downloaded)"),
    _option("--data-dir", dest="data_dir", help="glyph set cache directory"),
    _option(
        "--backbone", help="small_cnn, resnet18, resnet50, googlenet, efficientnet_b0, mobilenet_v2, mobilenet_v3_large"
    ),
    _option("--embedding-dim", dest="embedding_dim", type=_dimension, help="the head's width, or 'none': no head"),
    _option("--head-init", dest="head_init", choices=["random", "pca"], help="default: the recipe's"),
    _option("--proxy-init", dest="proxy_init", choices=["random", "class_means"], help="default: the recipe's"),
    _option("--pooling", choices=["gap", "gmp", "gap+gmp"]),
    _option("--pretrained", help="torchvision state dict: a local file or pkg:<package>/<file> (never downloaded)"),
    _option("--image-size", dest="image_size", type=int),
    _option("--loss", help="loss name from the registry (raw_vthm, proxy_anchor, ...)"),
    _option("--loss-options", dest="loss_options", type=json.loads, help="JSON object, e.g. '{\"alpha\": 2}'"),
    _option("--epochs", type=int, help="default: the recipe's (scratch 6, finetune 10)"),
    _option("--classes-per-batch", dest="classes_per_batch", type=int),
    _option("--samples-per-class", dest="samples_per_class", type=int),
    _option("--batches-per-epoch", dest="batches_per_epoch", type=int),
    _option(
        "--recipe",
        choices=["finetune", "scratch"],
        help="named defaults for the rates, warm-up and BatchNorm (default: finetune with --pretrained)",
    ),
    _option("--lr", type=float, help="the head's rate (default: the recipe's)"),
    _option("--backbone-lr", dest="backbone_lr", type=float, help="backbone rate (default: --lr)"),
    _option("--proxy-lr", dest="proxy_lr", type=float, help="proxies' rate (default: --lr)"),
    _option("--warmup-epochs", dest="warmup_epochs", type=int, help="epochs with the backbone frozen"),
    _option("--freeze-bn", dest="freeze_bn", action=argparse.BooleanOptionalAction, default=None),
    _option("--augment", choices=["none", "flip", "crop", "crop+flip"], help="default: photos crop+flip"),
    _option("--data-mode", dest="data_mode", choices=["auto", "memory", "lazy"]),
    _option("--loader-workers", dest="loader_workers", type=int, help="decoding processes (lazy mode)"),
    _option("--weight-decay", dest="weight_decay", type=float),
    _option("--seed", type=int),
    _option("--split-seed", dest="split_seed", type=int),
    _option("--test-fraction", dest="test_fraction", type=float),
    _option("--val-fraction", dest="val_fraction", type=float),
    _option("--max-classes", dest="max_classes", type=int, help="use a slice of the classes (quick runs)"),
    _option("--max-per-class", dest="max_per_class", type=int, help="use at most N images per class"),
    _option("--ks", help="comma-separated K values for Recall@K"),
    _option("--num-workers", dest="num_workers", type=int, help="Ray Train workers"),
    _option("--use-gpu", dest="use_gpu", choices=["auto", "true", "false"]),
    _option("--max-failures", dest="max_failures", type=int, help="worker failures to recover from"),
    _option("--resume", action=argparse.BooleanOptionalAction, default=None, help="continue the stopped run at --out"),
    _option("--progress", action=argparse.BooleanOptionalAction, default=None, help="default: on a tty"),
    _option("--metrics-export-port", dest="metrics_export_port", type=int, help="local Ray's Prometheus metrics port"),
    _option("--plots", action=argparse.BooleanOptionalAction, default=None, help="write PNG plots"),
]


def add_training_arguments(parser: argparse.ArgumentParser, protocol_only: bool = False) -> None:
    for flags, kwargs in TRAINING_OPTIONS:
        if not (protocol_only and flags[0] in PER_RUN_OPTIONS):
            parser.add_argument(*flags, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def command() -> None:
        if args.command == "data":
            from training.glyphs import build_glyph_dataset
            from training.icons import build_icon_dataset

            build = {"glyphs": build_glyph_dataset, "icons": build_icon_dataset}[args.data_set]
            print(build(args.data_dir or f"data/{args.data_set}"))
        elif args.command == "train":
            from training.train import TrainConfig, run_training

            out = run_training(from_cli(TrainConfig, args))
            print(json.dumps({"run": str(out), **_summary(out)}, indent=2))
        elif args.command == "benchmark":
            from core.config import explicit_args, load_config_file
            from training.benchmark import BenchmarkConfig, run_benchmark

            values = {**(load_config_file(args.config) if args.config else {}), **explicit_args(args)}
            out = run_benchmark(BenchmarkConfig.from_values(values))
            print((out / "table.md").read_text())
        elif args.command == "export":
            from training.export import ExportConfig, run_export

            print(run_export(from_cli(ExportConfig, args)))

    return run_cli(command, verbose=bool(args.verbose))


def _summary(out) -> dict:
    results = json.loads((out / "results.json").read_text())
    return {
        "untrained_test": results["untrained"],
        "trained_test": results["trained"],
        "best_epoch": results["best_epoch"],
    }


if __name__ == "__main__":
    sys.exit(main())
