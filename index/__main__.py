"""`python -m index COMMAND`: build, rebuild, add to, remove from, inspect and roll back index versions."""

from __future__ import annotations

import argparse
import sys

from core.cli import COMMAND, add_config_flag, add_progress_flag, add_verbose_flag, run_cli
from core.config import add_options, from_cli
from index.build.config import BuildConfig
from index.build.duplicates import DuplicatesConfig
from index.build.rebuild import RebuildConfig
from index.changes.compact import CompactConfig
from index.changes.lifecycle import RemoveConfig

# command → (help, configuration class, its options this command does not take)
COMMANDS = {
    "build": (
        "embed a catalog and publish a new faiss index version",
        BuildConfig,
        ("upsert", "max_segments", "max_deleted_fraction"),
    ),
    "rebuild": (
        "batch rebuild on Ray Data (RAY_ADDRESS for a cluster), then publish",
        RebuildConfig,
        ("decode_threads", "ks", "upsert", "max_segments", "max_deleted_fraction"),
    ),
    "add": (
        "publish live version + new catalog rows, embedding only the new ones (ids already indexed are skipped)",
        BuildConfig,
        # The live version fixes these: its factory and search parameters (its model is the default).
        (
            "factory",
            "search_params",
            "nprobe",
            "target_ann_recall",
            "train_size",
            "device",
            "decode_threads",
            "max_pixels",
            "ks",
            "shards",
        ),
    ),
    "remove": ("publish the live version less some items (takedowns, logged to audit.jsonl)", RemoveConfig, ()),
    "compact": (
        "merge each shard's segments of the live version into one, dropping deleted rows (on Ray, a task a shard)",
        CompactConfig,
        (),
    ),
    "duplicates": ("write the groups of near-duplicates (pairs at or above --min-score)", DuplicatesConfig, ()),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{COMMAND} index", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    for name, (text, cls, exclude) in COMMANDS.items():
        command = sub.add_parser(name, help=text)
        add_config_flag(command)
        add_options(command, cls, exclude=exclude)
        add_progress_flag(command)

    listing = sub.add_parser("list", help="list index versions, marking the live one")
    listing.add_argument("--index-root", required=True, help="index root with versions/ and CURRENT")

    rollback = sub.add_parser("rollback", help="point CURRENT at an earlier version")
    rollback.add_argument("--index-root", required=True, help="index root with versions/ and CURRENT")
    rollback.add_argument("--to", help="version name (default: the one before the live one)")
    rollback.add_argument(
        "--restore-taken-down",
        action="store_true",
        help="republish items taken down since that version was built (default: the takedowns are re-applied)",
    )
    rollback.add_argument("--keep", type=int, default=5, help="versions to retain when takedowns are re-applied")
    add_verbose_flag(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def command() -> None:
        from core.artifacts import layout as artifacts

        if args.command in ("list", "rollback"):
            artifacts.check_index_root(args.index_root)
        if args.command in ("build", "add"):
            from index.build.build import run_build
            from index.build.config import BuildConfig
            from index.changes.add import run_add

            progress = args.progress
            del args.progress
            run = run_build if args.command == "build" else run_add
            print(run(from_cli(BuildConfig, args), progress=progress))
        elif args.command == "remove":
            from index.changes.lifecycle import RemoveConfig, run_remove

            del args.progress
            report = run_remove(from_cli(RemoveConfig, args))  # its summary is logged
            print(artifacts.version_dir(args.index_root, report.version))
        elif args.command == "compact":
            from index.changes.compact import run_compact

            del args.progress
            done = run_compact(from_cli(CompactConfig, args))
            if done is not None:  # nothing published: the log line says why, stdout stays empty
                print(done.version)
        elif args.command == "rebuild":
            from index.build.rebuild import RebuildConfig, run_rebuild

            progress = args.progress
            del args.progress
            cfg = from_cli(RebuildConfig, args)
            print(run_rebuild(cfg, progress=progress))
        elif args.command == "duplicates":
            from index.build.duplicates import run_duplicates

            progress = args.progress
            del args.progress
            print(run_duplicates(from_cli(DuplicatesConfig, args), progress=progress))
        elif args.command == "list":
            from index.build.listing import list_versions

            for line in list_versions(args.index_root):
                print(line)
        elif args.command == "rollback":
            versions = artifacts.list_versions(args.index_root)
            live = artifacts.current_version(args.index_root)
            target = args.to
            if target is None:
                older = [v for v in versions if live is None or v < live]
                if not older:
                    raise ValueError("no earlier version to roll back to")
                target = older[-1]
            if args.keep < 1:
                raise ValueError(f"--keep must be at least 1, got {args.keep}")
            from index.changes.lifecycle import rollback
            from index.versions.audit import local_identity

            report = rollback(
                args.index_root, target, local_identity(), "cli", args.restore_taken_down, keep=args.keep
            )  # its summary is logged
            print(f"CURRENT → {report.version}")

    return run_cli(command, verbose=bool(args.verbose))


if __name__ == "__main__":
    sys.exit(main())
