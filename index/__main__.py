"""`python -m index {build,list,rollback}`: build, inspect and roll back index versions."""

from __future__ import annotations

import argparse
import json
import sys

from core.cli import add_verbose_flag, run_cli
from core.config import from_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m index", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="embed a catalog and publish a new faiss index version")
    build.add_argument("--config", help="YAML/TOML file with any of the options below")
    build.add_argument("--model", help="model artifact directory (model.onnx + manifest.json)")
    build.add_argument("--index-root", dest="index_root", help="index root (versions/ and CURRENT)")
    build.add_argument("--catalog", help="catalog to index (default: the model's test split)")
    build.add_argument("--probe-catalog", dest="probe_catalog", help="held-out labelled images for probe Recall@K")
    build.add_argument("--factory", help="faiss factory string: Flat, IVF256,Flat, IVF256,PQ16, HNSW32, ...")
    build.add_argument("--search-params", dest="search_params", type=json.loads, help="JSON, e.g. '{\"nprobe\": 16}'")
    build.add_argument("--train-size", dest="train_size", type=int, help="vectors sampled to train IVF/PQ")
    build.add_argument("--device", choices=["auto", "cpu", "gpu"], help="where faiss builds")
    build.add_argument("--provider", choices=["auto", "cpu", "cuda"], help="ONNX Runtime provider")
    build.add_argument("--batch-size", dest="batch_size", type=int)
    build.add_argument("--decode-threads", dest="decode_threads", type=int)
    build.add_argument("--max-pixels", dest="max_pixels", type=int, help="larger images are skipped as oversized")
    build.add_argument("--max-bad-fraction", dest="max_bad_fraction", type=float)
    build.add_argument("--ks", help="comma-separated K values for probe Recall@K")
    build.add_argument("--min-ann-recall", dest="min_ann_recall", type=float)
    build.add_argument("--min-probe-recall-at-1", dest="min_probe_recall_at_1", type=float)
    build.add_argument("--max-recall-drop", dest="max_recall_drop", type=float)
    build.add_argument("--force", action="store_const", const=True, help="publish even if the quality gate fails")
    build.add_argument("--keep", type=int, help="versions to retain")
    build.add_argument("--no-progress", action="store_true", default=None)

    rebuild = sub.add_parser("rebuild", help="batch rebuild on Ray Data (RAY_ADDRESS for a cluster), then publish")
    for flag, kwargs in (
        ("--config", {}),
        ("--model", {}),
        ("--index-root", {"dest": "index_root"}),
        ("--catalog", {}),
        ("--probe-catalog", {"dest": "probe_catalog", "help": "held-out labelled images for probe Recall@K"}),
        ("--factory", {}),
        ("--search-params", {"dest": "search_params", "type": json.loads}),
        ("--train-size", {"dest": "train_size", "type": int}),
        ("--device", {"choices": ["auto", "cpu", "gpu"]}),
        ("--provider", {"choices": ["auto", "cpu", "cuda"]}),
        ("--batch-size", {"dest": "batch_size", "type": int}),
        ("--max-bad-fraction", {"dest": "max_bad_fraction", "type": float}),
        ("--max-pixels", {"dest": "max_pixels", "type": int}),
        ("--min-ann-recall", {"dest": "min_ann_recall", "type": float}),
        ("--min-probe-recall-at-1", {"dest": "min_probe_recall_at_1", "type": float}),
        ("--max-recall-drop", {"dest": "max_recall_drop", "type": float}),
        ("--keep", {"type": int}),
    ):
        rebuild.add_argument(flag, **kwargs)
    rebuild.add_argument("--force", action="store_const", const=True)
    rebuild.add_argument("--workers", type=int, default=2, help="embedding actors (and decode tasks)")
    rebuild.add_argument("--work-dir", help="where embedding shards go (default INDEX_ROOT/.rebuild)")
    rebuild.add_argument("--no-progress", action="store_true", default=None)

    add = sub.add_parser("add", help="publish live version + new catalog rows, embedding only the new ones")
    add.add_argument("--config", help="YAML/TOML file with any of the options below")
    add.add_argument("--model", help="model artifact directory (must be the live index's model)")
    add.add_argument("--index-root", dest="index_root", help="index root (versions/ and CURRENT)")
    add.add_argument("--catalog", help="catalog with the new rows (ids already indexed are skipped)")
    add.add_argument("--probe-catalog", dest="probe_catalog", help="held-out labelled images for probe Recall@K")
    add.add_argument("--provider", choices=["auto", "cpu", "cuda"])
    add.add_argument("--batch-size", dest="batch_size", type=int)
    add.add_argument("--max-bad-fraction", dest="max_bad_fraction", type=float)
    add.add_argument("--min-ann-recall", dest="min_ann_recall", type=float)
    add.add_argument("--min-probe-recall-at-1", dest="min_probe_recall_at_1", type=float)
    add.add_argument("--max-recall-drop", dest="max_recall_drop", type=float)
    add.add_argument("--force", action="store_const", const=True)
    add.add_argument("--keep", type=int)
    add.add_argument("--no-progress", action="store_true", default=None)

    listing = sub.add_parser("list", help="list index versions, marking the live one")
    listing.add_argument("--index-root", required=True)

    rollback = sub.add_parser("rollback", help="point CURRENT at an earlier version")
    rollback.add_argument("--index-root", required=True)
    rollback.add_argument("--to", help="version name (default: the one before the live one)")
    add_verbose_flag(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def command() -> None:
        from pathlib import Path

        from core import artifacts
        from core.manifests import IndexManifest

        if args.command in ("list", "rollback") and not Path(args.index_root).is_dir():
            raise ValueError(f"index root not found: {args.index_root}")
        if args.command in ("build", "add"):
            from index.build import BuildConfig, run_add, run_build

            no_progress = args.no_progress
            del args.no_progress
            run = run_build if args.command == "build" else run_add
            print(run(from_cli(BuildConfig, args), progress=not no_progress))
        elif args.command == "rebuild":
            from index.build import BuildConfig
            from index.rebuild import run_rebuild

            options = {"workers": args.workers, "work_dir": args.work_dir, "progress": not args.no_progress}
            del args.workers, args.work_dir, args.no_progress
            print(run_rebuild(from_cli(BuildConfig, args), **options))
        elif args.command == "list":
            live = artifacts.current_version(args.index_root)
            for version in artifacts.list_versions(args.index_root):
                m = IndexManifest.read(artifacts.version_dir(args.index_root, version))
                probe = m.quality.probe_recall_at_1 if m.quality is not None else None
                mark = "*" if version == live else " "
                print(f"{mark} {version}  size={m.size}  factory={m.factory}  model={m.model_id}  probe_R@1={probe}")
        elif args.command == "rollback":
            versions = artifacts.list_versions(args.index_root)
            live = artifacts.current_version(args.index_root)
            target = args.to
            if target is None:
                older = [v for v in versions if live is None or v < live]
                if not older:
                    raise ValueError("no earlier version to roll back to")
                target = older[-1]
            artifacts.set_current(args.index_root, target)
            print(f"CURRENT → {target}")

    return run_cli(command, verbose=bool(args.verbose))


if __name__ == "__main__":
    sys.exit(main())
