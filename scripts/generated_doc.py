"""The command line both document generators share: write the document, or with `--check` exit 1
where the file on disk is not what the code renders now (a test runs each with `--check`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(doc: Path, render: Callable[[], str], description: str | None, module: str) -> int:
    """`main` of the generator `module` (run as `python -m <module>`) of `doc`: the exit status."""
    name = doc.relative_to(ROOT)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {name} is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not doc.is_file() or doc.read_text() != text:
            print(f"{name} is stale: run python -m {module}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(text)
    print(name)
    return 0
