"""Index operations on real artifacts: incremental add, and builds killed at random moments."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from core.data.items import ItemTable
from index.versions.version import IndexVersion

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def index_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "index", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_add_embeds_only_new_rows_and_keeps_existing_vectors(demo_run, tmp_path):
    catalog = read_catalog(demo_run / "train" / "splits" / "test.csv")
    first_half = catalog.subset(range(0, len(catalog), 2)).write(tmp_path / "half.csv")
    full = catalog.write(tmp_path / "full.csv")
    root = tmp_path / "index"
    model = str(demo_run / "model")
    built = index_cli(
        "build",
        "--model",
        model,
        "--index-root",
        str(root),
        "--catalog",
        str(first_half),
        "--factory",
        "IVF8,Flat",
        "--search-params",
        '{"nprobe": 8}',
        "--no-progress",
    )
    assert built.returncode == 0, built.stderr
    parent = artifacts.current_version(root)
    parent_dir = artifacts.version_dir(root, parent)
    added = index_cli(
        "add", "--model", model, "--index-root", str(root), "--catalog", str(full), "--no-progress", "--merges", "whole"
    )  # its own version stays live: no base merge after it
    assert added.returncode == 0, added.stderr
    child = artifacts.current_version(root)
    assert child != parent and set(artifacts.list_versions(root)) == {parent, child}
    child_dir = artifacts.version_dir(root, child)
    manifest = artifacts.read_manifest(child_dir)
    n_half = len(read_catalog(first_half))
    assert manifest["rows"]["already_indexed"] == n_half
    assert manifest["rows"]["added"] == len(catalog) - n_half
    assert manifest["size"] == len(catalog) and manifest["parent_version"] == parent
    assert manifest["factory"] == "IVF8,Flat" and manifest["search_params"] == {"nprobe": 8}
    old = np.load(parent_dir / artifacts.EMBEDDINGS_FILE)
    opened = IndexVersion(child_dir).load()
    assert np.asarray(opened.vectors)[: len(old)].tobytes() == old.tobytes()  # existing items were not re-embedded
    # ... nor written again: the parent's rows are the child's first segment, hard-linked.
    first = child_dir / artifacts.SEGMENTS / "000000"
    for name in (artifacts.INDEX_FILE, artifacts.EMBEDDINGS_FILE, artifacts.ITEMS_FILE):
        assert (first / name).stat().st_ino == (parent_dir / name).stat().st_ino
    assert [s.rows for s in opened.manifest.segments] == [n_half, len(catalog) - n_half]
    assert sorted(opened.items.ids) == sorted(catalog.ids)
    again = index_cli("add", "--model", model, "--index-root", str(root), "--catalog", str(first_half))
    assert again.returncode == 2 and "already in version" in again.stderr

    listing = index_cli("list", "--index-root", str(root))
    assert listing.returncode == 0
    assert f"* {child}" in listing.stdout and f"  {parent}" in listing.stdout
    assert index_cli("rollback", "--index-root", str(root)).returncode == 0
    assert artifacts.current_version(root) == parent
    assert index_cli("rollback", "--index-root", str(root), "--to", child).returncode == 0
    assert artifacts.current_version(root) == child
    bad = index_cli("rollback", "--index-root", str(root), "--to", "no-such-version")
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_build_killed_at_random_moments_leaves_previous_version_live(demo_run, tmp_path):
    root = tmp_path / "index"
    shutil.copytree(demo_run / "index", root)
    live = artifacts.current_version(root)
    live_manifest = artifacts.read_manifest(artifacts.version_dir(root))
    # A catalog big enough that the build is still running when the kill comes.
    base = read_catalog(demo_run / "train" / "splits" / "test.csv")
    from core.data.catalog import Catalog

    big = Catalog(
        ids=[f"{i}-{copy}" for copy in range(20) for i in base.ids],
        paths=[p for _ in range(20) for p in base.paths],
        labels=[label for _ in range(20) for label in base.labels],
        source="big",
    ).write(tmp_path / "big.csv")
    rng = random.Random(7)
    kills = builds = 0
    # Five kills at random moments; a build that beats its kill (a fast machine) is checked
    # like the others and followed by another, rather than leaving the test with fewer kills.
    while kills < 5:
        assert builds < 25, f"only {kills} of {builds} builds were still running when killed"
        builds += 1
        delay = rng.uniform(0.3, 3.0)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "index",
                "build",
                "--model",
                str(demo_run / "model"),
                "--index-root",
                str(root),
                "--catalog",
                str(big),
                "--batch-size",
                "8",
                "--decode-threads",
                "1",
                "--no-progress",
                "--force",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        finished = proc.wait() == 0
        current = artifacts.current_version(root)
        if finished:  # it beat the kill: then its version is live, and whole
            live, live_manifest = current, artifacts.read_manifest(artifacts.version_dir(root))
        assert current == live, "a killed build must not switch CURRENT"
        version_dir = artifacts.version_dir(root)
        manifest = artifacts.read_manifest(version_dir)
        assert manifest == live_manifest
        assert len(ItemTable.read(version_dir / "items.parquet")) == manifest["size"]
        from index.search.faiss_index import load_index

        assert load_index(version_dir / "index.faiss").ntotal == manifest["size"]
        for version in artifacts.list_versions(root):
            assert (root / "versions" / version / "index.faiss").is_file()
    done = index_cli("build", "--model", str(demo_run / "model"), "--index-root", str(root), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert artifacts.current_version(root) != live
