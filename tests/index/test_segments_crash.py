"""kill -9 at random moments of adds, removals and compactions of a segmented version: the live
version stays whole (it loads, its files agree with its manifest, every id it held before a
round is there or was removed by a round that published), a second writer waits its turn, and
the next writer removes what a killed one left in staging."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from core import artifacts
from core.items import ItemTable
from index.add import add_vectors
from index.version import IndexVersion
from tests.support import shards as support

ROOT = Path(__file__).resolve().parents[2]
N, DIM = 400, 16

# One writer that never stops: adds of a few rows, removals of one of them, compactions, each
# published, until it is killed.
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from core.items import ItemTable
    from core.vectors import l2_normalized
    from index.add import add_vectors
    from index.lifecycle import compact_version, remove_items

    root, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    print("ready", flush=True)
    for step in range(10**6):
        first = 100_000 * seed + 10 * step
        ids = [f"new-{first + i}" for i in range(5)]
        items = ItemTable(ids, None, [f"/new/{i}.png" for i in ids], [{"item": i, "shade": "0"} for i in ids])
        add_vectors(root, l2_normalized(rng.standard_normal((5, 16)).astype(np.float32)), items, max_segments=4)
        remove_items(root, [ids[0]], "crash-test")
        if step % 3 == 2:
            compact_version(root, on_ray=False)
    """
)


def _new_rows(count: int, seed: int) -> tuple[np.ndarray, ItemTable]:
    vectors, table = support.catalog(count, DIM, count, seed=seed)
    return vectors, ItemTable(
        [f"extra-{seed}-{i}" for i in range(count)], None, list(table.paths), list(table.metadata)
    )


@pytest.mark.slow
def test_kill_9_mid_change_leaves_the_live_version_whole(tmp_path):
    data = support.catalog(N, DIM, 100)
    model = support.model(tmp_path / "model", DIM)
    root = tmp_path / "index"
    support.publish(root, data, model, 1)
    original = set(IndexVersion.open(root).items.ids)
    rng = random.Random(11)
    kills = 0
    for round_number in range(24):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(round_number + 1)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.5))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        live = IndexVersion.open(root).load(dim=DIM)  # whole: its files agree with its manifest
        held = set(live.items.ids[r] for r in np.flatnonzero(live.live_mask)) if live.live_mask is not None else set(
            live.items.ids)  # fmt: skip
        assert original <= held  # the writer removes only rows it added
    assert kills >= 20
    # What killed writers left in staging goes with the next writer's turn.
    add_vectors(root, *_new_rows(3, seed=5))
    assert not list((root / artifacts.VERSIONS).glob(".staging-*"))


def _holding(root: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the root's writer lock for `seconds`, once it says so."""
    code = (
        "import sys, time\nfrom core import artifacts\n"
        f"with artifacts.writer_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep({seconds})"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_waits_its_turn(tmp_path):
    data = support.catalog(N, DIM, 100)
    model = support.model(tmp_path / "model", DIM)
    root = tmp_path / "index"
    support.publish(root, data, model, 1)
    vectors, items = _new_rows(2, seed=8)
    # Another process holds the root: this add waits, then publishes from the version that is
    # live when its turn comes, losing nothing.
    holder = _holding(root, 2)
    started = time.perf_counter()
    report = add_vectors(root, vectors, items)
    assert time.perf_counter() - started >= 1.0 and holder.wait() == 0
    assert IndexVersion(report.version).size == N + 2
    # Past the wait: one precise error naming the holder.
    holder = _holding(root, 5)
    with pytest.raises(artifacts.WriterBusyError, match=rf"another writer \(pid {holder.pid}\) has held"):
        with artifacts.writer_lock(root, wait_s=0.5):
            pass
    holder.wait()
