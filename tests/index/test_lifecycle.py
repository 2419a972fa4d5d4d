"""Takedowns on real faiss index versions of every type: rows leave (or are masked), the rest
keep their vectors and ids, and the audit log says who removed what."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import RowCounts
from core.data.items import ItemTable
from index.build.config import BuildConfig
from index.build.publish import NewVersion, publish_index_version
from index.changes.lifecycle import remove_items, rollback
from index.search.filters import Condition, Filter, Range
from index.versions.audit import AUDIT_LOG, returning_takedowns
from index.versions.version import IndexVersion

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {
    "flat": ("Flat", {}),
    "ivf-flat": ("IVF16,Flat", {"nprobe": 16}),
    "ivf-pq": ("IVF16,PQ4", {"nprobe": 16}),
    "hnsw": ("HNSW16", {"efSearch": 64}),
}
N, DIM = 600, 16


def publish_synthetic(
    root: Path, factory: str, params: dict, n: int = N, seed: int = 0, filterable: tuple[str, ...] = ("n:int",)
) -> IndexVersion:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    faiss.normalize_L2(vectors)
    items = ItemTable(
        ids=[f"item-{i}" for i in range(n)],
        labels=[f"class-{i % 30}" for i in range(n)],
        paths=[f"/nonexistent/{i}.png" for i in range(n)],
        metadata=[{"n": str(i)} for i in range(n)],
    )
    cfg = BuildConfig(
        model=str(root / "model"),
        index_root=str(root),
        factory=factory,
        search_params=params,
        filterable=list(filterable),
    )
    new = NewVersion("model-a", vectors, items, root / "catalog.csv", RowCounts(n, n), time.perf_counter(), 0.0)
    publish_index_version(
        new, cfg.index_recipe, cfg.gate_thresholds, cfg.probe, cfg.filterable_fields, cfg.item_field, cfg.publish_target
    )
    return IndexVersion.open(root).load()


def row_vectors_by_id(version: IndexVersion) -> dict[str, np.ndarray]:
    mask = version.live_mask
    return {version.items.ids[r]: version.vector(r) for r in range(len(version.items)) if mask is None or mask[r]}


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_removed_items_leave_and_the_rest_keep_their_vectors(tmp_path, kind):
    factory, params = FACTORIES[kind]
    parent = publish_synthetic(tmp_path, factory, params)
    before = row_vectors_by_id(parent)
    removed = [f"item-{i}" for i in range(0, N, 10)]  # 60 of 600: 10%, under HNSW's compaction fraction
    report = remove_items(tmp_path, [*removed, "no-such-item", removed[0]], who="test", reason="legal")

    assert report.removed == len(removed) and report.not_found == ["no-such-item"] and report.requested == 61
    child = IndexVersion.open(tmp_path).load()
    assert child.name == report.version != parent.name and child.manifest.parent_version == parent.name
    assert child.size == report.size == N - len(removed)
    assert all(child.row_of(i) is None for i in removed)
    after = row_vectors_by_id(child)
    assert set(after) == set(before) - set(removed)
    for item_id, vector in after.items():  # every row kept its own vector (the IVF ids renumbered right)
        np.testing.assert_array_equal(vector, before[item_id])

    # The filterable field's value → rows structure describes the child's rows, not the parent's.
    below = Filter(must=(Condition("n", range=Range(lt=100)),))
    matching = child.filters.mask(below)
    if child.live_mask is not None:
        matching &= child.live_mask
    expected = {f"item-{i}" for i in range(100)} - set(removed)
    assert {child.items.ids[r] for r in np.flatnonzero(matching)} == expected

    # Tombstones only: the parent's row files are the child's first segment, hard-linked, so a
    # takedown writes kilobytes whatever the index type.
    assert len(child.deleted) == len(removed) and child.manifest.deleted_rows == len(removed)
    assert child.manifest.schema_version == 3 and [s.name for s in child.manifest.segments] == ["000000"]
    for name in (artifacts.INDEX_FILE, artifacts.EMBEDDINGS_FILE, artifacts.ITEMS_FILE):
        linked = child.directory / artifacts.SEGMENTS / "000000" / name
        assert linked.stat().st_ino == (parent.directory / name).stat().st_ino
    live_rows = np.flatnonzero(child.live_mask)
    queries = child.vectors[live_rows]
    assert np.isneginf(child.exact_scores(queries[0])[child.deleted]).all()


def test_hnsw_is_rebuilt_without_its_removed_rows_past_the_fraction(tmp_path):
    parent = publish_synthetic(tmp_path, "HNSW16", {"efSearch": 64})
    first = [f"item-{i}" for i in range(0, 60)]
    remove_items(tmp_path, first, who="test", max_deleted_fraction=0.15)
    masked = IndexVersion.open(tmp_path).load()
    assert len(masked.deleted) == 60 and masked.index.ntotal == N
    second = [f"item-{i}" for i in range(60, 120)]  # 120 of 600 > 15%: compacted
    report = remove_items(tmp_path, second, who="test", max_deleted_fraction=0.15)
    compacted = IndexVersion.open(tmp_path).load()
    assert report.deleted_rows == 0 and len(compacted.deleted) == 0 and compacted.index.ntotal == N - 120
    assert not (compacted.directory / artifacts.DELETED_FILE).exists()
    assert [s.name for s in compacted.manifest.segments] == ["000001"]  # one segment, made anew
    before = row_vectors_by_id(parent)
    for item_id, vector in row_vectors_by_id(compacted).items():
        np.testing.assert_array_equal(vector, before[item_id])
    _, rows = compacted.index.search(np.ascontiguousarray(compacted.vectors), 1)
    assert np.mean(rows[:, 0] == np.arange(N - 120)) >= 0.95


def test_ids_not_indexed_change_nothing_and_every_removal_is_audited(tmp_path):
    parent = publish_synthetic(tmp_path, "Flat", {})
    report = remove_items(tmp_path, ["ghost-1", "ghost-2"], who="token sha256:abc", reason="typo")
    assert report.version is None and report.removed == 0 and report.not_found == ["ghost-1", "ghost-2"]
    assert artifacts.current_version(tmp_path) == parent.name
    assert artifacts.list_versions(tmp_path) == [parent.name]
    remove_items(tmp_path, ["item-3"], who="token sha256:abc", reason="DMCA #12")
    entries = [json.loads(line) for line in (tmp_path / AUDIT_LOG).read_text().splitlines()]
    assert [e["removed"] for e in entries] == [0, 1]
    assert entries[1]["ids"] == ["item-3"] and entries[1]["who"] == "token sha256:abc"
    assert entries[1]["reason"] == "DMCA #12" and entries[1]["parent_version"] == parent.name
    assert entries[1]["version"] == artifacts.current_version(tmp_path)
    with pytest.raises(ValueError, match="no item id"):
        remove_items(tmp_path, [], who="test")


def test_a_build_that_brings_taken_down_items_back_says_so(tmp_path, caplog):
    publish_synthetic(tmp_path, "Flat", {})
    remove_items(tmp_path, ["item-3", "item-4"], who="test")
    with caplog.at_level("WARNING", logger="index.changes.lifecycle"):
        publish_synthetic(tmp_path, "Flat", {})  # the same catalog again, taken-down items in it
    assert "2 items of this version were taken down earlier" in caplog.text and "item-3" in caplog.text


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_a_rollback_re_applies_the_takedowns_made_since_its_version(tmp_path, kind):
    parent = publish_synthetic(tmp_path, *FACTORIES[kind])
    remove_items(tmp_path, ["item-3", "item-4"], who="legal", reason="court order 9")
    remove_items(tmp_path, ["item-5"], who="legal", reason="court order 10")
    taken_down_on = artifacts.current_version(tmp_path)

    report = rollback(tmp_path, parent.name, who="ops", via="http")
    live = IndexVersion.open(tmp_path).load()
    assert report.reapplied == ["item-3", "item-4", "item-5"] and report.version == live.name
    assert live.name not in (parent.name, taken_down_on) and live.manifest.parent_version == parent.name
    assert live.size == N - 3 and all(live.row_of(i) is None for i in report.reapplied)
    assert row_vectors_by_id(live).keys() == row_vectors_by_id(parent).keys() - set(report.reapplied)
    entry = json.loads((tmp_path / AUDIT_LOG).read_text().splitlines()[-1])
    assert entry["action"] == "rollback" and entry["via"] == "http" and entry["who"] == "ops"
    assert entry["reason"] == f"rollback to {parent.name} re-applied 3 takedowns → version {live.name}"
    assert entry["ids"] == report.reapplied and entry["parent_version"] == parent.name
    # A version made after the takedowns holds nothing to re-apply.
    again = rollback(tmp_path, taken_down_on, who="ops")
    assert again.reapplied == [] and again.version == taken_down_on == artifacts.current_version(tmp_path)


def test_restoring_taken_down_items_is_explicit_and_audited_by_id(tmp_path, caplog):
    parent = publish_synthetic(tmp_path, "Flat", {})
    remove_items(tmp_path, ["item-3", "item-4"], who="legal", reason="court order 9")
    entries = len((tmp_path / AUDIT_LOG).read_text().splitlines())

    report = rollback(tmp_path, parent.name, who="ops", restore_taken_down=True)
    assert report.restored == ["item-3", "item-4"] and report.reapplied == []
    assert artifacts.current_version(tmp_path) == parent.name
    log_lines = (tmp_path / AUDIT_LOG).read_text().splitlines()
    assert len(log_lines) == entries + 1
    entry = json.loads(log_lines[-1])
    assert entry["action"] == "restore" and entry["ids"] == ["item-3", "item-4"] and entry["who"] == "ops"
    assert "restored 2 taken-down items (item-3, item-4)" in entry["reason"]
    # Restored is lifted: a later rollback or build does not take them down or warn of them again.
    assert returning_takedowns(tmp_path, parent.name) == []
    with caplog.at_level("WARNING", logger="index.changes.lifecycle"):
        publish_synthetic(tmp_path, "Flat", {})
    assert "taken down earlier" not in caplog.text


def index_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "index", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_remove_command_publishes_lists_and_rolls_back(tmp_path):
    parent = publish_synthetic(tmp_path, "HNSW16", {"efSearch": 64})
    ids = tmp_path / "takedown.txt"
    ids.write_text("# legal request 7\nitem-1\n\nitem-2\nghost\n")
    done = index_cli("remove", "--index-root", str(tmp_path), "--ids", str(ids), "--reason", "legal request 7")
    assert done.returncode == 0, done.stderr
    # The summary once (the log's), the new version's directory on stdout, as build and add print theirs.
    assert done.stderr.count("removed 2 of 3 requested ids; 1 not in version") == 1
    assert done.stdout.strip() == str(artifacts.version_dir(tmp_path))
    listing = index_cli("list", "--index-root", str(tmp_path))
    assert f"size={N - 2} (+2 removed, masked)" in listing.stdout and f"  {parent.name}" in listing.stdout
    audit = json.loads((tmp_path / AUDIT_LOG).read_text().splitlines()[-1])
    assert audit["via"] == "cli" and audit["who"].startswith(("user:", "uid:")) and audit["not_found"] == ["ghost"]
    taken_down_on = artifacts.current_version(tmp_path)
    # Rolling back past the takedown re-applies it: a version derived from the parent, without them.
    back = index_cli("rollback", "--index-root", str(tmp_path), "--to", parent.name)
    assert back.returncode == 0, back.stderr
    derived = artifacts.current_version(tmp_path)
    assert derived not in (parent.name, taken_down_on) and back.stdout.strip() == f"CURRENT → {derived}"
    assert f"rollback to {parent.name} re-applied 2 takedowns → version {derived}" in back.stderr
    assert IndexVersion.open(tmp_path).manifest.parent_version == parent.name
    assert IndexVersion.open(tmp_path).row_of("item-1") is None
    restored = index_cli("rollback", "--index-root", str(tmp_path), "--to", parent.name, "--restore-taken-down")
    assert restored.returncode == 0, restored.stderr
    assert artifacts.current_version(tmp_path) == parent.name
    assert "restored 2 taken-down items (item-1, item-2)" in restored.stderr
    bad = index_cli("rollback", "--index-root", str(tmp_path), "--to", "no-such-version")
    assert bad.returncode == 2 and bad.stderr.count("version 'no-such-version' does not exist") == 1, bad.stderr

    (tmp_path / "empty.txt").write_text("# nothing\n")
    (tmp_path / "ghosts.txt").write_text("ghost\nghost-2\n")
    for args, message in (
        (("--ids", str(tmp_path / "missing.txt")), "--ids file not found"),
        (("--ids", str(tmp_path / "empty.txt")), "names no item id"),
        ((), "needs --ids FILE"),
        (("--ids", str(tmp_path / "ghosts.txt")), "none of the 2 ids is in version"),  # a takedown of nothing
    ):
        bad = index_cli("remove", "--index-root", str(tmp_path), *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
