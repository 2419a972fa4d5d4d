"""`simsearch COMMAND …`: every stage's commands under the one name `pip install` puts on PATH.

Each is its package's own command, run as `python -m PACKAGE COMMAND …` runs it (that form stays):
`simsearch train …` is `python -m training train …`, `simsearch index build …` is `python -m index
build …`, `simsearch serve …` is `python -m serving serve …`.

The package a command belongs to is named here, not imported: it is imported when its command
runs, and only it, so `simsearch serve` on a serving image never loads training's torch and the
rule that training and serving never import each other holds here too (tests/system/test_import_rule.py).
"""

from __future__ import annotations

import difflib
import importlib
import sys

# command → (the package whose `__main__.main` runs it, the command's name there; None: the
# package's own commands follow, `simsearch index build`), what it does
COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "data": ("training", "data", "render a built-in data set and print its catalog path"),
    "train": ("training", "train", "train an embedding model with Ray Train"),
    "train-text": ("training", "train-text", "train a text tower into a locked image model's space (LiT)"),
    "benchmark": ("training", "benchmark", "train several losses × seeds under one protocol"),
    "export": ("training", "export", "export a run or a pretrained network to a verified ONNX model"),
    "index": ("index", None, "build, add to, remove from, compact, list and roll back index versions"),
    "serve": ("serving", "serve", "serve similarity search over gRPC (and HTTP/JSON)"),
    "query": ("serving", "query", "search a server with image files, item ids or phrases"),
    "info": ("serving", "info", "print a server's live versions, limits and recall figures"),
}
USAGE = "usage: simsearch COMMAND [ARGS …]   (simsearch COMMAND --help for its options)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    return "\n".join([USAGE, "", "commands:", *lines])


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` names (sys.argv's by default); its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: unknown command {name!r}; {hint}the commands are {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    package, command, _ = COMMANDS[name]
    run = importlib.import_module(f"{package}.__main__").main
    return run([command, *rest] if command else rest)
