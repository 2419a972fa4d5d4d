"""kill -9 at random moments of adds, removals and compactions of a segmented version — a
compaction in a process of its own too, merging without the root's lock beside the writer and
rebasing onto what it published: the live version stays whole (it loads, its files agree with
its manifest, every id it held before a round is there or was removed by a round that
published), a second writer waits its turn, and the next writer removes what a killed one left
in staging."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from index.changes.add import add_vectors
from index.versions.version import IndexVersion
from tests.support import shards as support

ROOT = Path(__file__).resolve().parents[2]
N, DIM = 400, 16

# One writer that never stops: adds of a few rows, removals of one of them, compactions, each
# published, until it is killed.
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from core.data.items import ItemTable
    from core.retrieval.vectors import l2_normalized
    from index.changes.add import add_vectors
    from index.changes.lifecycle import compact_version, remove_items

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


# A compaction that never stops, beside the writer: each merges what is live as it starts and is
# rebased onto what the writer published meanwhile (or superseded by the writer's own compaction).
COMPACTOR = textwrap.dedent(
    """
    import sys, time
    from index.changes.lifecycle import compact_version

    print("ready", flush=True)
    while True:
        compact_version(sys.argv[1], on_ray=False)
        time.sleep(0.02)
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
        compactor = subprocess.Popen(
            [sys.executable, "-c", COMPACTOR, str(root)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "ready" and compactor.stdout.readline().strip() == "ready"
        # Each killed at a moment of its own: the compactor mid-merge, mid-rebase or mid-publish.
        for victim in sorted((proc, compactor), key=lambda _: rng.random()):
            time.sleep(rng.uniform(0.05, 0.8))
            if victim.poll() is None:
                victim.send_signal(signal.SIGKILL)
                kills += victim is proc
            victim.wait()
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
        "import sys, time\nfrom core.artifacts import layout as artifacts\n"
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


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _serve(root: Path) -> tuple[subprocess.Popen, int]:
    """`python -m serving serve` over `root` with an admin token, and its gRPC port once serving."""
    import json

    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", "0", "--metrics-port", "none",
         "--admin-token", "crash", "--probe-interval-s", "0", "--max-segments", "4", "--processes", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    assert line, "the server exited before it served"
    return proc, json.loads(line)["port"]


@pytest.mark.slow
def test_kill_9_of_a_server_mid_ingest_leaves_the_live_version_whole(tmp_path):
    """AddItems while the server is killed: whatever moment the kill lands on (embedding, writing
    the segment, publishing, compacting, swapping), the live version loads whole and holds every
    row it held before and every item an AddItems call said it added."""
    import threading

    from protos.simsearch.v1 import search_pb2 as pb
    from serving.client import SearchClient

    data = support.catalog(N, DIM, 100)
    model = support.model(tmp_path / "model", DIM)
    root = tmp_path / "index"
    support.publish(root, data, model, 1)
    original = set(IndexVersion.open(root).items.ids)
    confirmed: set[str] = set()
    rng = random.Random(13)
    vectors = np.random.default_rng(13)
    kills = 0
    left: list[psutil.Process] = []  # the killed servers' child processes
    for round_number in range(20):
        proc, port = _serve(root)
        client = SearchClient(f"127.0.0.1:{port}", timeout=30, admin_token="crash")
        stop = threading.Event()

        def ingest(first: int, client: SearchClient, stop: threading.Event) -> None:
            for call in range(10**6):
                if stop.is_set():
                    return
                ids = [f"ingest-{first}-{call}-{i}" for i in range(3)]
                rows = vectors.standard_normal((3, DIM))
                rows /= np.linalg.norm(rows, axis=1, keepdims=True)
                items = [
                    pb.NewItem(id=i, embedding=pb.Embedding(values=v), metadata={"item": i, "shade": "0"})
                    for i, v in zip(ids, rows, strict=True)
                ]
                try:
                    client.add_items(items, timeout=30)
                except Exception:  # noqa: BLE001 — the kill ends the calls
                    return
                confirmed.update(ids)

        caller = threading.Thread(target=ingest, args=(round_number, client, stop))
        caller.start()
        time.sleep(rng.uniform(0.2, 2.5))
        if proc.poll() is None:
            left.extend(_descendants(proc.pid))  # its local Ray, which a compaction runs on
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        stop.set()
        caller.join(60)
        client.close()
        live = IndexVersion.open(root).load(dim=DIM)  # whole: its files agree with its manifest
        held = (
            set(live.items.ids)
            if live.live_mask is None
            else {live.items.ids[r] for r in np.flatnonzero(live.live_mask)}
        )
        assert original <= held and confirmed <= held, sorted(confirmed - held)[:5]
    assert kills >= 20 and len(confirmed) >= 3 * 20  # the kills landed on servers that were ingesting
    # A killed server's Ray workers outlive it until Ray's reaper ends them (seconds on a busy
    # machine), and one still writing a compaction's unit holds its staging folder: what the
    # killed ones left is what is there once they are all gone.
    _, alive = psutil.wait_procs(left, timeout=120)
    assert not alive, [p.pid for p in alive]
    add_vectors(root, *_new_rows(3, seed=6))  # the next writer clears what the killed ones left
    assert not list((root / artifacts.VERSIONS).glob(".staging-*"))
