"""`python -m training {data,train,benchmark,export}`: the training stage's commands."""

from __future__ import annotations

import argparse
import json
import sys

from core.cli import COMMAND, add_config_flag, add_verbose_flag, run_cli
from core.config import add_options, from_cli

# The configuration classes live beside torch and Ray (4 s to import): only the command that runs
# builds its options, so `training data` and `--help` start at once.
HELP = {
    "train": "train an embedding model with Ray Train",
    "train-text": "train a text tower into a locked image model's space (LiT) with Ray Train",
    "benchmark": "train several losses × seeds under one protocol and tabulate test Recall@K",
    "export": "export a training run, or a pretrained network as it is, to a verified ONNX model artifact; "
    "a train-text run to a text model artifact (--text); open_clip weights to both (--backbone open_clip:<config>)",
}


def commands() -> dict[str, tuple[str, type, tuple[str, ...]]]:
    """command → (help, configuration class, its options this command does not take)."""
    from training.export.export import ExportConfig
    from training.runs.benchmark import BenchmarkConfig
    from training.runs.config import TrainConfig
    from training.text.text_config import TrainTextConfig

    return {
        "train": (HELP["train"], TrainConfig, ()),
        "train-text": (HELP["train-text"], TrainTextConfig, ()),
        "benchmark": (HELP["benchmark"], BenchmarkConfig, ("protocol",)),
        "export": (HELP["export"], ExportConfig, ()),
    }


def _parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The parser; the options of `wanted` only (the command about to run), the others bare."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="render a built-in data set (cached) and print its catalog path")
    data.add_argument(
        "--set", dest="data_set", choices=["glyphs", "icons"], default="glyphs",
        help="glyphs: font glyphs (the default data); icons: colour icons from Debian icon themes",
    )  # fmt: skip
    data.add_argument("--data-dir", help="where images and catalog.csv go (default data/<set>)")

    for name, text in HELP.items():
        command = sub.add_parser(name, help=text)
        add_config_flag(command)
        if name != wanted:
            continue
        _, cls, exclude = commands()[name]
        add_options(command, cls, exclude=exclude)
        if name == "benchmark":  # and the protocol: training's options, but those set per run
            from training.runs.benchmark import PER_RUN_FIELDS
            from training.runs.config import TrainConfig

            add_options(command, TrainConfig, exclude=PER_RUN_FIELDS)
    add_verbose_flag(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    wanted = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(wanted).parse_args(argv)

    def command() -> None:
        if args.command == "data":
            from training.data.glyphs import build_glyph_dataset
            from training.data.icons import build_icon_dataset

            build = {"glyphs": build_glyph_dataset, "icons": build_icon_dataset}[args.data_set]
            print(build(args.data_dir or f"data/{args.data_set}"))
        elif args.command == "train":
            from training.runs.config import TrainConfig
            from training.runs.train import run_training

            out = run_training(from_cli(TrainConfig, args))
            print(json.dumps({"run": str(out), **_summary(out)}, indent=2))
        elif args.command == "train-text":
            from training.text.text_config import TrainTextConfig
            from training.text.train_text import run_text_training

            out = run_text_training(from_cli(TrainTextConfig, args))
            results = json.loads((out / "results.json").read_text())
            trained_on = {k: results[k] for k in ("train_images", "train_captions")}
            print(json.dumps({"run": str(out), **trained_on, "text_to_image": results["evaluation"]}, indent=2))
        elif args.command == "benchmark":
            from core.config import explicit_args, flag_spellings, load_config_file
            from training.runs.benchmark import BenchmarkConfig, run_benchmark
            from training.runs.config import TrainConfig

            flags = explicit_args(args)
            values = {**(load_config_file(args.config) if args.config else {}), **flags}
            out = run_benchmark(
                BenchmarkConfig.from_values(values, flag_spellings(flags, BenchmarkConfig, TrainConfig))
            )
            print((out / "table.md").read_text())
        elif args.command == "export":
            from training.export.export import ExportConfig, run_export

            cfg = from_cli(ExportConfig, args)
            print(run_export(cfg))
            if cfg.text_out is not None:  # open_clip's text tower, published beside the image model
                print(cfg.text_out)

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
