"""Merges in tiers (issue 61): the policy's choices, segments bounded over a stream of adds, Flat
answers equal to exact search after tiered merges, a merge rebased onto what was published while
it ran, an add that returns before its background merge ends, one merge a root at a time, and
kill -9 of a background merge or of a base merge leaving the live version whole. Real faiss, real
files."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.changes.add import add_vectors
from index.changes.lifecycle import remove_items
from index.changes.merges import merge_lock, merge_records, merge_snapshot, merge_tiers, tiered_changes
from index.search.faiss_search import search_within
from index.versions.merge_policy import BASE, DELETED, Merge, SegmentSize, TieredMergePolicy, segment_sizes
from index.versions.merge_rows import MergedLayout
from index.versions.version import IndexVersion
from tests.support import shards as support

ROOT = Path(__file__).resolve().parents[2]
N, DIM = 400, 16
SMALL = TieredMergePolicy(tier_factor=3, segments_per_tier=3, base_merge_share=100.0)  # no base merge


def _rows(count: int, first: int, seed: int) -> tuple[np.ndarray, ItemTable]:
    vectors = l2_normalized(np.random.default_rng(seed).standard_normal((count, DIM)).astype(np.float32))
    ids = [f"new-{first + i}" for i in range(count)]
    return vectors, ItemTable(ids, None, [f"/new/{i}.png" for i in ids], [{"item": i, "shade": "0"} for i in ids])


def _built(tmp_path: Path, factory: str = "Flat") -> tuple[Path, dict[str, np.ndarray]]:
    data = support.catalog(N, DIM, 100)
    root = tmp_path / "index"
    support.publish(root, data, support.model(tmp_path / "model", DIM), 1, factory)
    return root, dict(zip(data[1].ids, data[0], strict=True))


def _live_ids(version: IndexVersion) -> set[str]:
    rows = range(len(version.items)) if version.live_mask is None else np.flatnonzero(version.live_mask)
    return {version.items.ids[int(r)] for r in rows}


def _segments(version: IndexVersion) -> list[str]:
    return [entry.name for entry in version.unit(0).segment_entries]


def _answers_as_exact_search(version: IndexVersion, expected: dict[str, np.ndarray], k: int = 10) -> None:
    """Top-k ids of the version's search equal exact search over the rows that should be live."""
    ids = sorted(expected)
    matrix = np.stack([expected[i] for i in ids])
    queries = matrix[:: max(1, len(ids) // 40)]
    allowed = version.live_mask if version.live_mask is not None else np.ones(len(version.items), dtype=bool)
    _, rows, _ = search_within(version.searchable(), version.vectors, queries, k, allowed)
    exact = np.argsort(-(queries @ matrix.T), axis=1, kind="stable")[:, :k]
    for found, want in zip(rows, exact, strict=True):
        assert {version.items.ids[int(r)] for r in found} == {ids[int(c)] for c in want}


def test_the_policy_merges_a_size_class_the_base_past_its_share_and_a_deleted_heavy_segment_alone():
    policy = TieredMergePolicy(tier_factor=10, segments_per_tier=4, base_merge_share=0.5, max_deleted_share=0.2)
    assert [policy.size_class(rows) for rows in (0, 9, 10, 99, 100, 999, 1000)] == [0, 0, 1, 1, 2, 2, 3]
    base = SegmentSize(10_000)
    # Three segments of the 100s class and three of the 10s: nothing full yet.
    sizes = [base] + [SegmentSize(100)] * 3 + [SegmentSize(20)] * 3
    assert policy.choose(sizes) is None
    # A fourth of the 10s class: those four merge, not into the base nor with the 100s.
    assert policy.choose([*sizes, SegmentSize(15)]) == Merge((4, 5, 6, 7), "tier 1")
    # A segment past its deleted share merges on its own (the base too).
    assert policy.choose([base, SegmentSize(100, deleted=30), SegmentSize(20)]) == Merge((1,), DELETED)
    assert policy.choose([SegmentSize(10_000, deleted=2_500), SegmentSize(20)]) == Merge((0,), DELETED)
    # New rows past half the base's: the whole unit merges.
    assert policy.choose([base, SegmentSize(3_000), SegmentSize(2_001)]) == Merge((0, 1, 2), BASE)
    assert policy.choose([base]) is None and policy.choose([]) is None
    sizes = segment_sizes([5, 3, 4], np.array([0, 4, 5, 11]))
    assert sizes == [SegmentSize(5, 2), SegmentSize(3, 1), SegmentSize(4, 1)]
    with pytest.raises(ValueError, match="tier_factor must be at least 2"):
        TieredMergePolicy(tier_factor=1)


def test_a_merge_layout_moves_rows_with_their_segments():
    # Segments of 3, 4, 2 and 5 rows; the second and fourth merge, rows 4 and 11 deleted.
    layout = MergedLayout.of([3, 4, 2, 5], [1, 3], np.array([4, 11]))
    assert layout.order() == [0, None, 2] and list(layout.kept) == [3, 5, 6, 9, 10, 12, 13]
    assert layout.new_starts() == {0: 0, None: 3, 2: 10}
    # Row 1 stays, 4 is dropped, 5 is the merged segment's second row, 7 (third segment) moves to 10.
    assert list(layout.rows(np.array([1, 4, 5, 7, 11, 13]))) == [1, 4, 10, 9]


def test_segments_stay_bounded_over_a_long_stream_and_flat_answers_equal_exact_search(tmp_path):
    root, expected = _built(tmp_path)
    most, first = 0, 0
    for step in range(90):
        count = 1 + step % 3
        vectors, items = _rows(count, first, seed=step)
        add_vectors(root, vectors, items, keep=2, max_segments=10_000)
        expected.update(zip(items.ids, vectors, strict=True))
        if step % 10 == 9:  # takedowns among the new rows: merges drop them
            gone = [f"new-{first - 3}", f"new-{first}"]
            remove_items(root, gone, "test", keep=2, max_deleted_fraction=1.0)
            for item_id in gone:
                expected.pop(item_id, None)
        first += count
        most = max(most, len(_segments(IndexVersion.open(root))))
        merge_tiers(root, 2, SMALL)
    bound = SMALL.most_segments(len(expected))
    assert most <= bound, (most, bound)
    live = IndexVersion.open(root).load(dim=DIM)
    names = _segments(live)
    assert names == sorted(names) and len(names) < 90  # numbers grow along the list; merged
    assert _live_ids(live) == set(expected)
    _answers_as_exact_search(live, expected)
    assert merge_records(root) and not list((root / artifacts.VERSIONS).glob(".staging-*"))


def test_a_tiered_merge_is_rebased_onto_adds_and_removals_published_while_it_ran(tmp_path):
    root, expected = _built(tmp_path)
    for step in range(3):  # three 5-row segments: the 3s class full
        vectors, items = _rows(5, 5 * step, seed=step)
        add_vectors(root, vectors, items, max_segments=10_000)
        expected.update(zip(items.ids, vectors, strict=True))
    snapshot = IndexVersion.open(root)
    assert tiered_changes(snapshot, SMALL)[0][0].merge == (1, 2, 3)

    def meanwhile() -> None:  # another writer, between the merge and its publish
        vectors, items = _rows(4, 100, seed=9)
        add_vectors(root, vectors, items, max_segments=10_000)
        expected.update(zip(items.ids, vectors, strict=True))
        gone = ["new-3", "new-101", "id00007"]  # a merged row, an appended row, a base row
        remove_items(root, gone, "test", max_deleted_fraction=1.0)
        for item_id in gone:
            del expected[item_id]

    merged = merge_snapshot(root, 5, lambda live: tiered_changes(live, SMALL), staged=meanwhile)
    assert merged is not None and artifacts.current_version(root) == merged.version.name
    live = IndexVersion.open(root).load(dim=DIM)
    # The base kept its name; the merged segment and the add's numbered after the add's.
    assert _segments(live) == ["000000", "000005", "000006"]
    assert [entry.rows for entry in live.unit(0).segment_entries] == [N, 15, 4]
    assert _live_ids(live) == set(expected)
    assert len(live.deleted) == 3
    ids = sorted(expected)
    rows = np.array([live.row_of(item_id) for item_id in ids])
    np.testing.assert_array_equal(live.vectors[rows], np.stack([expected[i] for i in ids]))
    _answers_as_exact_search(live, expected)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_add_returns_before_its_background_merge_which_publishes_later(tmp_path):
    root, expected = _built(tmp_path)
    policy = TieredMergePolicy(tier_factor=3, segments_per_tier=3, base_merge_share=100.0)
    reports = []
    for step in range(3):
        vectors, items = _rows(5, 5 * step, seed=step)
        reports.append(add_vectors(root, vectors, items, tiers=policy))
        expected.update(zip(items.ids, vectors, strict=True))
    added = reports[-1]
    assert [r.merge_pid is None for r in reports] == [True, True, False]  # the third add made a merge due
    # The add answered with its own version live and the merge still running (a process of its own).
    assert artifacts.current_version(root) == added.version.name and _alive(added.merge_pid)
    assert psutil.Process(added.merge_pid).nice() >= psutil.Process().nice()  # a lower priority, once set
    # An add meanwhile: published at once; the running merge merges what it makes due.
    vectors, items = _rows(2, 100, seed=7)
    meanwhile = add_vectors(root, vectors, items, tiers=policy)
    expected.update(zip(items.ids, vectors, strict=True))
    # That add may start a merge too: whichever of the two takes the root's merge lock merges what
    # is due, and the other ends at once. Both are waited for.
    for pid in {added.merge_pid, meanwhile.merge_pid} - {None}:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(120)
    live = IndexVersion.open(root).load(dim=DIM)
    assert live.name != meanwhile.version.name and len(_segments(live)) == 3  # base, merged, the last add's
    assert _live_ids(live) == set(expected)
    assert [record["version"] for record in merge_records(root)][-1] == live.name
    _answers_as_exact_search(live, expected)


def test_one_merge_a_root_at_a_time(tmp_path):
    root, _ = _built(tmp_path)
    for step in range(3):
        add_vectors(root, *_rows(5, 5 * step, seed=step), max_segments=10_000)
    before = artifacts.current_version(root)
    with merge_lock(root) as held:
        assert held
        assert merge_tiers(root, 5, SMALL) == []  # another holds the root's merges: nothing merged
        with merge_lock(root) as second:
            assert not second
    assert artifacts.current_version(root) == before
    assert len(merge_tiers(root, 5, SMALL)) == 1 and artifacts.current_version(root) != before


def _background(root: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "index", "compact", "--index-root", str(root), "--tiered", "--tier-factor", "3",
               "--segments-per-tier", "3", "--base-merge-share", "100", "--no-progress"]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _fill_a_class(root: Path, expected: dict[str, np.ndarray], first: int) -> int:
    for _ in range(3):  # three segments of one size class: a merge due
        vectors, items = _rows(200, first, seed=first)
        add_vectors(root, vectors, items, max_segments=10_000)
        expected.update(zip(items.ids, vectors, strict=True))
        first += 200
    return first


def _staging(root: Path) -> set[str]:
    return {path.name for path in (root / artifacts.VERSIONS).glob(".staging-*")}


def _killed(merging: subprocess.Popen) -> bool:
    """Whether `merging` was still running and was killed (kill -9); either way, it has ended."""
    running = merging.poll() is None
    if running:
        merging.send_signal(signal.SIGKILL)
    merging.wait()
    return running


@pytest.mark.slow
def test_kill_9_of_a_background_merge_leaves_the_live_version_whole(tmp_path):
    root, expected = _built(tmp_path, "HNSW8")
    first = _fill_a_class(root, expected, 0)
    started = time.perf_counter()
    assert _background(root).wait() == 0  # one left to finish: how long a merge process lives
    lifetime = time.perf_counter() - started
    rng = random.Random(5)
    kills = 0
    for round_number in range(20):
        first = _fill_a_class(root, expected, first)
        merging = _background(root)
        # Late in its life, past the imports: merging, rebasing or publishing.
        time.sleep(rng.uniform(0.5, 1.0) * lifetime)
        kills += _killed(merging)
        live = IndexVersion.open(root).load(dim=DIM)  # whole: its files agree with its manifest
        assert _live_ids(live) == set(expected), round_number
    assert kills >= 10
    add_vectors(root, *_rows(2, 10**6, seed=1), max_segments=10_000)  # the next writer clears staging
    assert not _staging(root)


def test_index_compact_below_the_thresholds_says_what_each_shard_holds_and_prints_no_version(tmp_path, capsys, caplog):
    from index.__main__ import main

    root, _ = _built(tmp_path)
    for step in range(2):
        add_vectors(root, *_rows(5, 5 * step, seed=step), max_segments=10_000)
    remove_items(root, ["id00003"], "test", max_deleted_fraction=1.0)
    live = artifacts.current_version(root)
    with caplog.at_level("INFO"):
        assert main(["compact", "--index-root", str(root), "--max-segments", "16", "--no-progress"]) in (0, None)
    assert capsys.readouterr().out == ""  # nothing published: no version on stdout
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nothing to compact")]
    assert said == [
        f"nothing to compact in {live}: the index holds 3 segments, 1 of 410 rows deleted (0%) — none past "
        "--max-segments 16 or --max-deleted-fraction 0.2; nothing published"
    ]
    assert artifacts.current_version(root) == live


def test_a_compaction_says_rebased_only_when_it_was(tmp_path, caplog):
    from index.changes.lifecycle import compact_version

    root, _ = _built(tmp_path)
    add_vectors(root, *_rows(5, 0, seed=0), max_segments=10_000)
    with caplog.at_level("INFO", logger="index.versions.change"):
        compact_version(root, on_ray=False)
    [published] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("published index")]
    assert "compacted 1 of 1 shard, wrote" in published and "rebased" not in published
    add_vectors(root, *_rows(5, 5, seed=1), max_segments=10_000)
    caplog.clear()
    snapshot = artifacts.current_version(root)
    with caplog.at_level("INFO", logger="index.versions.change"):
        compact_version(root, on_ray=False, staged=lambda: add_vectors(root, *_rows(2, 50, seed=2)))
    rebased = [r.getMessage() for r in caplog.records if "compacted 1 of 1 shard" in r.getMessage()]
    assert len(rebased) == 1 and f"(rebased from {snapshot} onto " in rebased[0]


def _once(merging: subprocess.Popen, condition: Callable[[], bool], timeout: float = 120.0) -> float:
    """The moment `condition` held, polled while the merge process runs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert merging.poll() is None or condition(), "the merge exited first"
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.002)
    return time.monotonic()


def _base_merge(root: Path, tiered: bool) -> subprocess.Popen:
    """`index compact` of the whole shard, or a tiered run whose base is past its share at once:
    either rewrites the shard's base, its graph rebuilt and its deleted rows dropped."""
    command = [sys.executable, "-m", "index", "compact", "--index-root", str(root), "--keep", "2", "--no-progress"]
    if tiered:
        command += ["--tiered", "--base-merge-share", "0.001"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.slow
def test_kill_9_of_a_base_merge_leaves_the_live_version_whole_with_all_its_rows(tmp_path):
    """A base merge rewrites every row of the shard, the costliest merge to lose midway: killed at
    random moments from its first staged file to its publish, or just after its publish (pruning,
    recording), the live version loads whole and holds the rows it held before, and the next
    writer clears what the killed merge left in staging."""
    data = support.catalog(6000, DIM, 100)
    root = tmp_path / "index"
    support.publish(root, data, support.model(tmp_path / "model", DIM), 1, "HNSW8")
    writing = 0.0  # how long a merge writes, from its staging folder to its publish: the last one seen whole
    rng = random.Random(61)
    kills = published = 0
    for round_number in range(24):
        # A segment, and a takedown in the base: a merge has rows to move and a row to drop.
        vectors, items = _rows(20, 20 * round_number, seed=round_number)
        add_vectors(root, vectors, items, max_segments=10_000)
        assert not _staging(root), round_number  # this writer cleared what the last kill left
        remove_items(root, [f"id{round_number:05d}"], "test", max_deleted_fraction=1.0, compact_when_due=False)
        before = IndexVersion.open(root)
        merging = _base_merge(root, tiered=bool(round_number % 2))
        staged = _once(merging, lambda: bool(_staging(root)))
        if not writing or round_number % 4 == 3:
            # Past the publish, while it prunes and records; and how long its writing took.
            _once(merging, lambda live=before.name: artifacts.current_version(root) != live)
            writing = time.monotonic() - staged
            time.sleep(rng.uniform(0.0, 0.1))
        else:
            time.sleep(rng.uniform(0.0, 0.95) * writing)
        kills += _killed(merging)
        live = IndexVersion.open(root).load(dim=DIM)  # whole: its files agree with its manifest
        assert _live_ids(live) == _live_ids(before), round_number
        assert live.manifest.live_size == before.manifest.live_size == len(_live_ids(before)), round_number
        published += live.name != before.name
    assert kills >= 20 and published >= 6, (kills, published)
    add_vectors(root, *_rows(2, 10**6, seed=1), max_segments=10_000)  # the next writer clears staging
    assert not _staging(root)
