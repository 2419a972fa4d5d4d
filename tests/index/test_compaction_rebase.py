"""Compaction beside other writers (index/changes/lifecycle.py: compact_version; index/versions/rebase.py):
it merges a pinned snapshot of the live version without the root's writer lock, and
takes the lock only to publish — rebased onto what adds and removals published meanwhile (their
segments kept after the merged one, their removals still removed), or not at all when a
rollback superseded the snapshot. Real faiss, real files; the compaction runs in a thread paused
between its merge and its publish, or in a process of its own."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.changes.add import add_vectors
from index.changes.lifecycle import compact_version, remove_items, rollback
from index.search.faiss_search import search_within
from index.versions.units import segment_counts
from index.versions.version import IndexVersion
from tests.support import shards as support

ROOT = Path(__file__).resolve().parents[2]
N, DIM, ITEMS, K = 600, 16, 150, 10


def _rows(count: int, seed: int, prefix: str) -> tuple[np.ndarray, ItemTable]:
    vectors, table = support.catalog(count, DIM, ITEMS, seed=seed)
    return vectors, ItemTable([f"{prefix}-{i}" for i in range(count)], None, list(table.paths), list(table.metadata))


def _segmented(root: Path, shards: int) -> dict[str, np.ndarray]:
    """A version of N rows, two adds and a removal: segments to merge and rows to drop. Its live
    rows, id → vector."""
    data = support.catalog(N, DIM, ITEMS)
    support.publish(root, data, support.model(root.parent / "model", DIM), shards)
    rows = dict(zip(data[1].ids, data[0], strict=True))
    for number in range(2):
        vectors, items = _rows(30, seed=number + 1, prefix=f"add{number}")
        add_vectors(root, vectors, items, max_segments=100)
        rows.update(zip(items.ids, vectors, strict=True))
    gone = [f"id{i:05d}" for i in range(0, 60, 3)]
    remove_items(root, gone, "test", max_deleted_fraction=1.0)
    return {item_id: vector for item_id, vector in rows.items() if item_id not in gone}


class _Paused:
    """`compact_version` in a thread, paused once its merged segments are staged (before it takes
    the root's lock) until `go()`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.staged, self._go = threading.Event(), threading.Event()
        self.report, self.error = None, None

        def hold() -> None:
            self.staged.set()
            assert self._go.wait(60), "the test never let the compaction go on"

        def run() -> None:
            try:
                self.report = compact_version(root, keep=1, on_ray=False, staged=hold)
            except BaseException as exc:  # noqa: BLE001 — raised again in the test's thread
                self.error = exc

        self._thread = threading.Thread(target=run)
        self._thread.start()
        assert self.staged.wait(120), "the compaction never staged its segments"

    def go(self):
        self._go.set()
        self._thread.join(120)
        if self.error is not None:
            raise self.error
        return self.report

    def published_onto(self, parent: IndexVersion) -> IndexVersion:
        """Let go: the version it published, live and loaded whole, rebased onto `parent`."""
        report = self.go()
        assert report is not None and artifacts.current_version(self.root) == report.version.name
        compacted = IndexVersion(report.version).load(dim=DIM)
        assert compacted.manifest.parent_version == parent.name
        return compacted


def _live_ids(version: IndexVersion) -> set[str]:
    mask = version.live_mask
    return {item_id for row, item_id in enumerate(version.items.ids) if mask is None or mask[row]}


def _segment_counts(version: IndexVersion) -> list[int]:
    return segment_counts(version.manifest)


def units_of(version: IndexVersion) -> list[IndexVersion]:
    """Each unit of `version` as a version of its own: its shards, or itself."""
    return [version.unit(unit.number) for unit in version.units()]


def _answers_as_exact_search(version: IndexVersion, expected: dict[str, np.ndarray]) -> None:
    """Search of `version` answers what exact search over the `expected` live rows answers
    (Flat: to the id)."""
    ids = sorted(expected)
    matrix = np.stack([expected[i] for i in ids])
    queries = l2_normalized(matrix[::17] + 0.05)
    brute = [[ids[r] for r in np.argsort(-(matrix @ q), kind="stable")[:K]] for q in queries]
    _, rows, _ = search_within(version.searchable(), version.vectors, queries, K, version.live_mask, exact_below=0.0)
    assert [[version.items.ids[int(r)] for r in line] for line in rows] == brute


def _unsegmented(root: Path, shards: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """A version of N rows in the format from before segments (schema 1, or 2 sharded: its row
    files at the version's — or each shard's — top level, no segments listed) holding
    tombstones as that format's takedowns wrote them:
    `deleted.npy` beside the row files, counted in the manifest (and in each shard's entry,
    with its sha256). Every 15th row of each unit is deleted. Its live rows, id → vector, and
    the deleted ids."""
    data = support.catalog(N, DIM, ITEMS)
    version = IndexVersion(support.publish(root, data, support.model(root.parent / "model", DIM), shards))
    manifest, gone = version.manifest, []
    entries = []
    for number, unit in enumerate(units_of(version)):
        rows = np.arange(0, len(unit.items), 15, dtype=np.int64)
        np.save(unit.directory / artifacts.DELETED_FILE, rows)
        gone += [unit.items.ids[int(r)] for r in rows]
        if manifest.shards:
            entry = manifest.shards[number]
            files = {
                **entry.files,
                artifacts.DELETED_FILE: artifacts.file_sha256(unit.directory / artifacts.DELETED_FILE),
            }
            entries.append(dataclasses.replace(entry, deleted_rows=len(rows), files=files))
    dataclasses.replace(manifest, deleted_rows=len(gone), shards=entries or None).write(version.directory)
    rows = dict(zip(data[1].ids, data[0], strict=True))
    return {item_id: vector for item_id, vector in rows.items() if item_id not in gone}, gone


@pytest.mark.parametrize("shards", [1, 2])
def test_a_compaction_is_rebased_onto_what_was_published_while_it_ran(tmp_path, shards):
    root = tmp_path / "index"
    expected = _segmented(root, shards)
    snapshot = IndexVersion.open(root)
    paused = _Paused(root)
    # While the merge waits to publish, another writer adds rows and takes ids down — old rows,
    # and one of its own new rows — and publishes at once (keep=1: the snapshot stays pinned).
    vectors, items = _rows(25, seed=9, prefix="meanwhile")
    started = time.perf_counter()
    add_vectors(root, vectors, items, keep=1, max_segments=100)
    added_in = time.perf_counter() - started
    expected.update(zip(items.ids, vectors, strict=True))
    taken_down = ["id00001", "id00100", "id00599", "add1-4", "meanwhile-7"]
    remove_items(root, taken_down, "test", keep=1, max_deleted_fraction=1.0)
    for item_id in taken_down:
        del expected[item_id]
    meanwhile = IndexVersion.open(root)
    assert (root / artifacts.VERSIONS / snapshot.name).is_dir()  # pinned: not pruned under the merge

    compacted = paused.published_onto(meanwhile)
    assert _live_ids(compacted) == set(expected) and compacted.size == len(expected)
    # Each shard: the merged segment, then the segments the add appended while it ran.
    counts = zip(_segment_counts(snapshot), _segment_counts(meanwhile), strict=True)
    appended = [after - before for before, after in counts]
    assert _segment_counts(compacted) == [1 + count for count in appended] and sum(appended) >= 1
    assert len(compacted.deleted) == len(taken_down)  # mapped onto the merged rows and the appended ones
    _answers_as_exact_search(compacted, expected)
    for item_id in ("meanwhile-3", "add0-2", "id00002"):
        np.testing.assert_array_equal(compacted.vector(compacted.row_of(item_id)), expected[item_id])
    assert added_in < 30 and not list((root / artifacts.VERSIONS).glob(".staging-*"))
    # The next add numbers its segment after every segment the rebase kept.
    add_vectors(root, *_rows(3, seed=11, prefix="after"), max_segments=100)
    assert IndexVersion.open(root).load(dim=DIM).size == len(expected) + 3


@pytest.mark.parametrize("shards", [1, 2])
def test_a_compaction_of_an_unsegmented_version_is_rebased_onto_the_add_that_segmented_it(tmp_path, shards):
    """The pinned snapshot is a version of the format from before segments, with tombstones:
    the compaction merges its row files (segment 000000 to be) into segment 000001, while an
    add — the version's first change, which links those row files as segment 000000 and
    appends its own as 000001 — publishes. The rebase keeps the add's segment after the merged
    one, renumbered past both, and the add's (and a later removal's) tombstones mapped."""
    root = tmp_path / "index"
    expected, gone = _unsegmented(root, shards)
    snapshot = IndexVersion.open(root).load(dim=DIM)
    assert snapshot.manifest.schema_version == (2 if shards > 1 else 1) and snapshot.size == len(expected)
    assert not any(unit.segment_entries for unit in units_of(snapshot))
    assert all(len(unit.deleted) for unit in units_of(snapshot))  # every unit has something to compact
    paused = _Paused(root)
    vectors, items = _rows(25, seed=9, prefix="meanwhile")
    add_vectors(root, vectors, items, keep=1, max_segments=100)
    added = IndexVersion.open(root)
    # The add segmented every unit: its rows linked as segment 000000, the new rows 000001 (a
    # change that leaves a shard unsegmented: the test after this one).
    assert added.manifest.schema_version == 3
    assert [[s.name for s in unit.segment_entries] for unit in units_of(added)] == [["000000", "000001"]] * shards
    assert len(added.deleted) == len(gone)  # the old tombstones carried over
    expected.update(zip(items.ids, vectors, strict=True))
    taken_down = ["id00001", "id00599", "meanwhile-7"]  # old rows and one of the add's, after it
    remove_items(root, taken_down, "test", keep=1, max_deleted_fraction=1.0)
    for item_id in taken_down:
        del expected[item_id]
    meanwhile = IndexVersion.open(root)
    assert (root / artifacts.VERSIONS / snapshot.name).is_dir()  # pinned: not pruned under the merge

    compacted = paused.published_onto(meanwhile)
    assert compacted.manifest.schema_version == 3
    assert _live_ids(compacted) == set(expected) and compacted.size == len(expected)
    # Each unit: the merged segment (the snapshot's live rows), then the add's, numbered after both.
    for unit, was in zip(units_of(compacted), units_of(snapshot), strict=True):
        merged, appended = unit.segment_entries
        assert (merged.name, appended.name) == ("000002", "000003")
        assert merged.rows == len(was.items) - len(was.deleted) and appended.row_offset == merged.rows
    assert compacted.manifest.size == N - len(gone) + len(items)  # the old tombstones' rows dropped
    assert len(compacted.deleted) == len(taken_down)  # the meanwhile removal's, mapped
    for item_id in gone + taken_down:
        assert compacted.row_of(item_id) is None
    assert not set(gone) & set(compacted.items.ids)  # not masked: gone from the rows
    # Each added row that is live is found by its own vector, with the vector it was added with.
    live_added = [item_id for item_id in items.ids if item_id in expected]
    queries = np.stack([expected[item_id] for item_id in live_added])
    _, rows, _ = search_within(compacted.searchable(), compacted.vectors, queries, 1, compacted.live_mask)
    assert [compacted.items.ids[int(line[0])] for line in rows] == live_added
    ids = sorted(expected)  # every live row keeps the vector it was indexed or added with
    live_rows = np.array([compacted.row_of(item_id) for item_id in ids])
    np.testing.assert_array_equal(compacted.vectors[live_rows], np.stack([expected[i] for i in ids]))
    _answers_as_exact_search(compacted, expected)
    assert not list((root / artifacts.VERSIONS).glob(".staging-*"))
    # The next add numbers its segment after every segment the rebase kept.
    add_vectors(root, *_rows(3, seed=11, prefix="after"), max_segments=100)
    after = IndexVersion.open(root).load(dim=DIM)
    assert after.size == len(expected) + 3 and "000004" in [s.name for u in units_of(after) for s in u.segment_entries]


def test_a_compaction_is_rebased_onto_a_removal_that_left_a_shard_unsegmented(tmp_path):
    """Two unsegmented shards, both compacted; meanwhile a removal of one id touches one shard and
    links the other whole, still unsegmented. The rebase reads that shard's row files as the
    segment they are, as it read the snapshot's — it had called the compaction superseded and
    published nothing, every old tombstone left in place."""
    root = tmp_path / "index"
    expected, gone = _unsegmented(root, 2)
    paused = _Paused(root)
    remove_items(root, ["id00001"], "test", keep=1, max_deleted_fraction=1.0)
    del expected["id00001"]
    meanwhile = IndexVersion.open(root)
    touched = [bool(unit.segment_entries) for unit in units_of(meanwhile)]
    assert sorted(touched) == [False, True]  # one shard changed, the other linked as it was

    compacted = paused.published_onto(meanwhile)
    assert _live_ids(compacted) == set(expected) and compacted.size == len(expected)
    assert not set(gone) & set(compacted.items.ids)  # every shard's old tombstones dropped
    assert [[s.name for s in unit.segment_entries] for unit in units_of(compacted)] == [["000001"]] * 2
    assert len(compacted.deleted) == 1 and compacted.row_of("id00001") is None  # the removal, mapped
    _answers_as_exact_search(compacted, expected)


@pytest.mark.parametrize("restore", [True, False])
def test_a_compaction_superseded_by_a_rollback_publishes_nothing(tmp_path, restore):
    """Rolled back to the version before the removal, its takedowns restored (that version made
    live as it is), or to the one before the last add, its takedowns re-applied (a version made
    from it): the live version did not grow from the compaction's snapshot."""
    root = tmp_path / "index"
    _segmented(root, 1)
    versions = artifacts.list_versions(root)
    paused = _Paused(root)
    done = rollback(root, versions[-2] if restore else versions[-3], "test", restore_taken_down=restore)
    assert paused.go() is None
    assert artifacts.current_version(root) == done.version
    assert len(artifacts.list_versions(root)) == len(versions) + (0 if restore else 1)  # the rollback's alone
    assert not list((root / artifacts.VERSIONS).glob(".staging-*"))


def test_a_compaction_superseded_by_another_compaction_publishes_nothing(tmp_path):
    root = tmp_path / "index"
    expected = _segmented(root, 1)
    paused = _Paused(root)
    other = compact_version(root, on_ray=False)
    assert paused.go() is None and artifacts.current_version(root) == other.version.name
    assert _live_ids(IndexVersion.open(root)) == set(expected)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_removal_publishes_its_takedown_then_compacts_without_the_writer_lock(tmp_path, monkeypatch, shards):
    """`index remove --compact` (and a removal past --max-deleted-fraction) publishes its
    tombstones under the root's writer lock — the takedown in force before any merge — and
    merges after letting the lock go: an add made while it merges is published at once, and the
    compaction, rebased, keeps it. It merges the shards holding deleted rows, as `--compact` says."""
    from index.changes import lifecycle

    root = tmp_path / "index"
    expected = _segmented(root, shards)
    before = IndexVersion.open(root)
    staged, go = threading.Event(), threading.Event()
    compact = lifecycle.compact_version

    def paused(*args, **kwargs):  # the removal's compaction (of the shards it names) waits for the test
        def hold() -> None:
            staged.set()
            assert go.wait(60), "the test never let the compaction go on"

        if kwargs.get("units") is None:  # an add's compaction, when one is due
            return compact(*args, **kwargs)
        return compact(*args, **{**kwargs, "on_ray": False}, staged=hold)

    monkeypatch.setattr(lifecycle, "compact_version", paused)
    gone = ["id00005"]  # one shard's row
    done: dict = {}
    removal = threading.Thread(target=lambda: done.update(report=remove_items(root, gone, "test", compact=True)))
    removal.start()
    assert staged.wait(120), "the removal never started its compaction"
    removed = IndexVersion.open(root)
    assert removed.manifest.parent_version == before.name and not _live_ids(removed) & set(gone)
    assert _segment_counts(removed) == _segment_counts(before)  # tombstones alone, nothing merged yet
    vectors, items = _rows(10, seed=21, prefix="meanwhile")
    added = threading.Thread(target=add_vectors, args=(root, vectors, items), kwargs={"max_segments": 100})
    added.start()
    added.join(60)
    assert not added.is_alive(), "the add waited for the removal's compaction"
    go.set()
    removal.join(120)
    report = done["report"]
    assert report.version == removed.name and report.compacted_to == artifacts.current_version(root)
    compacted = IndexVersion.open(root)
    expected.update(zip(items.ids, vectors, strict=True))
    assert _live_ids(compacted) == set(expected) - set(gone) and report.size == compacted.size
    # A shard holding deleted rows: its merged segment, then what the add appended; the others
    # as the add left them.
    touched = {number for number, unit in enumerate(units_of(removed)) if len(unit.deleted)}
    assert 0 < len(touched) <= shards
    with_add = IndexVersion.open(root, compacted.manifest.parent_version)
    appended = [after - was for was, after in zip(_segment_counts(removed), _segment_counts(with_add), strict=True)]
    assert with_add.row_of("meanwhile-3") is not None and sum(appended) >= 1
    assert _segment_counts(compacted) == [
        1 + appended[n] if n in touched else count for n, count in enumerate(_segment_counts(with_add))
    ]


COMPACT = """
import sys, time
from index.changes.lifecycle import compact_version
started = time.perf_counter()
compact_version(sys.argv[1], on_ray=False)
print(f"{time.perf_counter() - started:.2f}", flush=True)
"""


@pytest.mark.slow
def test_a_writer_publishes_while_a_compaction_merges(tmp_path):
    """An HNSW graph over every row is the slow part of a compaction: an add published meanwhile,
    in another process, waits for none of it — and the compaction, published after, keeps it."""
    root = tmp_path / "index"
    rows = 40_000
    data = support.catalog(rows, DIM, 2_000)
    support.publish(root, data, support.model(tmp_path / "model", DIM), 1, "HNSW32", {"efSearch": 64})
    add_vectors(root, *_rows(200, seed=3, prefix="first"), max_segments=100)
    compaction = subprocess.Popen(
        [sys.executable, "-c", COMPACT, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    versions = root / artifacts.VERSIONS
    deadline = time.monotonic() + 120
    while not list(versions.glob(".staging-*")) and time.monotonic() < deadline:  # it has started
        time.sleep(0.02)
    vectors, items = _rows(20, seed=4, prefix="meanwhile")
    started = time.perf_counter()
    added = add_vectors(root, vectors, items, max_segments=100)
    waited = time.perf_counter() - started
    still_merging = compaction.poll() is None
    assert compaction.wait(300) == 0
    merged_in = float(compaction.stdout.read().strip())
    assert still_merging, f"the add ({waited:.2f} s) published after the compaction ({merged_in:.2f} s)"
    live = IndexVersion.open(root).load(dim=DIM)
    assert live.manifest.parent_version == added.version.name and len(live.manifest.segments) == 2
    assert live.size == rows + 220 and live.row_of("meanwhile-5") is not None
    print(f"add {waited:.2f} s beside a compaction of {merged_in:.2f} s")
