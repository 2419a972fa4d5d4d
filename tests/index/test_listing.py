"""`index list` over real roots (issue 63): what made each version, each segment's rows, and
quality figures marked as carried from the version that measured them — on a root the commands
of today wrote, and on one the code at dbb543c wrote, which records no more than it did then."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from index.changes.add import add_vectors
from index.changes.lifecycle import rollback

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "versions_dbb543c"


def index_cli(*args: str, cwd: Path) -> str:
    """`python -m index` of this checkout, run in `cwd` (the roots' relative paths as a user types them)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "index", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def lines_of(listing: str) -> list[list[str]]:
    """Each version's line, split on its double spaces: [name, action, size, ...]."""
    return [[part.strip() for part in line[2:].split("  ") if part.strip()] for line in listing.splitlines()]


def test_each_version_says_what_made_it_its_segments_rows_and_whose_figures_it_carries(tmp_path):
    for name in ("model", "images"):
        shutil.copytree(FIXTURE / name, tmp_path / name)
    for name in ("first.csv", "more.csv", "takedown.txt"):
        shutil.copy(FIXTURE / name, tmp_path / name)
    # Merges follow each change at once (`--merges whole`), not in a background process that
    # would publish a version of its own at a moment of its own between these steps.
    keep = ("--keep", "20")
    changes = (*keep, "--merges", "whole")
    index_cli("build", "--model", "model", "--index-root", "r", "--catalog", "first.csv", "--factory", "Flat",
              "--no-progress", "--force", *keep, cwd=tmp_path)  # fmt: skip
    built = artifacts.current_version(tmp_path / "r")
    index_cli("add", "--index-root", "r", "--catalog", "more.csv", "--no-progress", "--force", *changes, cwd=tmp_path)
    index_cli("add", "--index-root", "r", "--catalog", "more.csv", "--upsert", "--no-progress", "--force", *changes,
              cwd=tmp_path)  # fmt: skip
    vectors = np.eye(16, dtype=np.float32)[:2]  # a server's ingest: rows embedded already, no catalog
    add_vectors(tmp_path / "r", vectors, ItemTable(["new-0", "new-1"], ["a", "b"], ["/a.png", "/b.png"], [{}, {}]),
                keep=20)  # fmt: skip
    index_cli("remove", "--index-root", "r", "--ids", "takedown.txt", *changes, cwd=tmp_path)
    index_cli("compact", "--index-root", "r", "--max-segments", "1", "--no-progress", *keep, cwd=tmp_path)
    index_cli("rollback", "--index-root", "r", "--to", built, "--keep", "20", cwd=tmp_path)  # takedowns re-applied
    rollback(tmp_path / "r", built, "user:test", via="http", keep=20)  # the console's "make live"

    listed = lines_of(index_cli("list", "--index-root", "r", cwd=tmp_path))
    assert [line[1] for line in listed] == [
        "build", "add", "upsert", "ingest", "remove", "compact", "rollback", "make-live"
    ], listed  # fmt: skip
    build, add, upsert, ingest, *_ = listed
    assert not any("carried" in part for part in build)  # measured when it was built
    assert all(line[-1].endswith(f"(figures carried from {built})") for line in listed[1:]), listed
    assert "segments=2 (rows 40+8)" in add and "segments=3 (rows 40+8+8)" in upsert
    assert "segments=4 (rows 40+8+8+2)" in ingest
    assert "size=48 (+8 removed, masked)" in upsert  # the upsert's replaced rows


def test_an_old_root_lists_what_made_its_versions(tmp_path):
    """The fixture's versions record no action: a build, an add and a takedown are read from
    what they do record (no parent, rows added, the audit log)."""
    for layout, segments in (("single", "segments=2 (rows 40+8)"), ("sharded", "segments=2/2 (rows 22+3/18+5)")):
        shutil.copytree(FIXTURE / layout, tmp_path / layout)
        listed = lines_of(index_cli("list", "--index-root", layout, cwd=tmp_path))
        assert [line[1] for line in listed] == ["build", "add", "remove"], listed
        assert segments in listed[1] and segments in listed[2]
        assert listed[2][-1].endswith(f"(figures carried from {listed[0][0]})")
