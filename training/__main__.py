"""`python -m training {data,train,export}`: the training stage's commands."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from index.cli import run_cli
from index.config import from_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="render the embedded glyph set (cached) and print its catalog path")
    data.add_argument("--data-dir", default="data/glyphs", help="where images and catalog.csv go")

    train = sub.add_parser("train", help="train an embedding model with Ray Train")
    train.add_argument("--config", help="YAML/TOML file with any of the options below")
    train.add_argument("--out", help="run directory to publish (default runs/train)")
    train.add_argument("--catalog", help="catalog file or class-folder tree (default: embedded glyph set)")
    train.add_argument("--dataset", help="a benchmark in its published layout: cub, cars196, sop, inshop")
    train.add_argument("--data-root", dest="data_root", help="folder holding the --dataset (never downloaded)")
    train.add_argument("--data-dir", dest="data_dir", help="glyph set cache directory")
    train.add_argument(
        "--backbone", help="small_cnn, resnet18, resnet50, googlenet, efficientnet_b0, mobilenet_v2, mobilenet_v3_large"
    )
    train.add_argument("--embedding-dim", dest="embedding_dim", type=int)
    train.add_argument("--pooling", choices=["gap", "gmp", "gap+gmp"])
    train.add_argument(
        "--pretrained", help="torchvision state dict: a local file or pkg:<package>/<file> (never downloaded)"
    )
    train.add_argument("--image-size", dest="image_size", type=int)
    train.add_argument("--loss", help="loss name from the registry (raw_vthm, proxy_anchor, ...)")
    train.add_argument(
        "--loss-options", dest="loss_options", type=json.loads, help="JSON object, e.g. '{\"alpha\": 2}'"
    )
    train.add_argument("--epochs", type=int)
    train.add_argument("--classes-per-batch", dest="classes_per_batch", type=int)
    train.add_argument("--samples-per-class", dest="samples_per_class", type=int)
    train.add_argument("--batches-per-epoch", dest="batches_per_epoch", type=int)
    train.add_argument("--lr", type=float)
    train.add_argument("--backbone-lr", dest="backbone_lr", type=float, help="backbone rate (default: --lr)")
    train.add_argument("--proxy-lr", dest="proxy_lr", type=float, help="proxies' rate (default: --lr)")
    train.add_argument("--warmup-epochs", dest="warmup_epochs", type=int, help="epochs with the backbone frozen")
    train.add_argument("--freeze-bn", dest="freeze_bn", action=argparse.BooleanOptionalAction, default=None)
    train.add_argument("--augment", choices=["none", "flip", "crop", "crop+flip"], help="default: photos crop+flip")
    train.add_argument("--data-mode", dest="data_mode", choices=["auto", "memory", "lazy"])
    train.add_argument("--loader-workers", dest="loader_workers", type=int, help="decoding processes (lazy mode)")
    train.add_argument("--weight-decay", dest="weight_decay", type=float)
    train.add_argument("--seed", type=int)
    train.add_argument("--split-seed", dest="split_seed", type=int)
    train.add_argument("--test-fraction", dest="test_fraction", type=float)
    train.add_argument("--val-fraction", dest="val_fraction", type=float)
    train.add_argument("--max-classes", dest="max_classes", type=int, help="use a slice of the classes (quick runs)")
    train.add_argument("--max-per-class", dest="max_per_class", type=int, help="use at most N images per class")
    train.add_argument("--ks", help="comma-separated K values for Recall@K")
    train.add_argument("--num-workers", dest="num_workers", type=int, help="Ray Train workers")
    train.add_argument("--use-gpu", dest="use_gpu", choices=["auto", "true", "false"])
    train.add_argument("--max-failures", dest="max_failures", type=int, help="worker failures to recover from")
    train.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=None, help="continue the stopped run at --out"
    )
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="default: on a tty")
    train.add_argument(
        "--metrics-export-port", dest="metrics_export_port", type=int, help="local Ray's Prometheus metrics port"
    )
    train.add_argument("--plots", action=argparse.BooleanOptionalAction, default=None, help="write PNG plots")

    export = sub.add_parser("export", help="export a training run to a verified ONNX model artifact")
    export.add_argument("--config", help="YAML/TOML file with any of the options below")
    export.add_argument("--run", help="training run directory (default runs/train)")
    export.add_argument("--out", help="model artifact directory to publish (default runs/model)")
    export.add_argument("--opset", type=int)
    export.add_argument("--parity-images", dest="parity_images", type=int)
    export.add_argument("--min-cosine", dest="min_cosine", type=float)
    export.add_argument("--variants", help="reduced-precision copies to publish beside it: fp16,int8")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def command() -> None:
        if args.command == "data":
            from training.glyphs import build_glyph_dataset

            print(build_glyph_dataset(args.data_dir))
        elif args.command == "train":
            from training.train import TrainConfig, run_training

            out = run_training(from_cli(TrainConfig, args))
            print(json.dumps({"run": str(out), **_summary(out)}, indent=2))
        elif args.command == "export":
            from training.export import ExportConfig, run_export

            print(run_export(from_cli(ExportConfig, args)))

    return run_cli(command)


def _summary(out) -> dict:
    results = json.loads((out / "results.json").read_text())
    return {
        "untrained_test": results["untrained"],
        "trained_test": results["trained"],
        "best_epoch": results["best_epoch"],
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
