"""kill -9 at random moments of adds, removals and compactions of a segmented version — a
compaction in a process of its own too, merging without the root's lock beside the writer and
rebasing onto what it published: the live version stays whole (it loads, its files agree with
its manifest, every id it held before a round is there or was removed by a round that
published), a second writer waits its turn, and the next writer removes what a killed one left
in staging. A server killed mid-ingest, and mid group commit (issue 61): no item of a call it
answered is lost."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
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


def _serve(root: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """`python -m serving serve` over `root` with an admin token (and `options`, which override
    the defaults here), and its gRPC port once serving."""
    import json

    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "serve", "--index-root", str(root), "--port", "0", "--metrics-port", "none",
         "--admin-token", "crash", "--probe-interval-s", "0", "--max-segments", "4", "--processes", "1", *options],
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


GROUP_CALLS, CALL_ITEMS = 4, 2
WINDOW_MS = 500  # wide: the calls of a group, released together, all land in its window on a busy machine
# No merges after the writes: a merge process outlives the server that started it, and its own
# kill -9 is another test's. The group commit alone writes.
NO_MERGES = ("--merges", "whole", "--max-segments", "100000")


def _staging(root: Path) -> set[str]:
    return {path.name for path in (root / artifacts.VERSIONS).glob(".staging-*")}


def _live_ids(version: IndexVersion) -> set[str]:
    rows = range(len(version.items)) if version.live_mask is None else np.flatnonzero(version.live_mask)
    return {version.items.ids[int(r)] for r in rows}


class _Group:
    """GROUP_CALLS AddItems calls of CALL_ITEMS items each, sent together on threads of their own
    so that the server commits them as one group; each call's items, and whether it was answered.
    With `search_after`, each call searches its own items the moment it is answered."""

    def __init__(self, client, name: str, seed: int, search_after: bool = False) -> None:
        from protos.simsearch.v1 import search_pb2 as pb

        rows = np.random.default_rng(seed).standard_normal((GROUP_CALLS, CALL_ITEMS, DIM))
        rows /= np.linalg.norm(rows, axis=2, keepdims=True)
        self.calls = [{f"{name}-{call}-{i}": rows[call, i] for i in range(CALL_ITEMS)} for call in range(GROUP_CALLS)]
        self.answered = [False] * GROUP_CALLS
        self.answered_at = [0.0] * GROUP_CALLS  # time.monotonic() of each answer
        self.found: list[list[str]] = [[] for _ in range(GROUP_CALLS)]
        gate = threading.Barrier(GROUP_CALLS)

        def send(call: int) -> None:
            items = [
                pb.NewItem(id=i, embedding=pb.Embedding(values=v), metadata={"item": i, "shade": "0"})
                for i, v in self.calls[call].items()
            ]
            gate.wait()
            try:
                client.add_items(items, timeout=60)
            except Exception:  # noqa: BLE001 — the kill ends the calls in flight
                return
            self.answered_at[call], self.answered[call] = time.monotonic(), True
            if search_after:
                self.found[call] = [_nearest(client, vector) for vector in self.calls[call].values()]

        self.threads = [threading.Thread(target=send, args=(call,)) for call in range(GROUP_CALLS)]
        for thread in self.threads:
            thread.start()

    def ids(self) -> set[str]:
        return {item_id for call in self.calls for item_id in call}

    def answered_items(self) -> dict[str, np.ndarray]:
        return {i: v for call, done in zip(self.calls, self.answered, strict=True) if done for i, v in call.items()}

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)
            assert not thread.is_alive()


def _nearest(client, vector: np.ndarray) -> str:
    """The id of the row nearest `vector`, ungrouped (the index groups by its item field)."""
    from protos.simsearch.v1 import search_pb2 as pb

    reply = client.search(pb.SearchRequest(k=1, group_by="", embedding=pb.Embedding(values=vector)), timeout=60)
    return reply.neighbors[0].id


def _once_staged(root: Path, earlier: set[str], group: _Group, timeout: float = 120.0) -> float | None:
    """The moment the group's commit made its staging folder (one not among `earlier`); None when
    a call was answered before one was seen."""
    deadline = time.monotonic() + timeout
    while not _staging(root) - earlier:
        if any(group.answered):
            return None
        assert time.monotonic() < deadline, "the group's commit wrote nothing"
        time.sleep(0.001)
    return time.monotonic()


@pytest.mark.slow
def test_kill_9_of_a_server_mid_group_commit_loses_no_answered_item_and_leaves_the_live_version_whole(tmp_path):
    """Concurrent AddItems calls committed as one group, the server killed while it writes,
    publishes, loads or answers the group: the live version loads whole, holds the group all or
    not at all, and holds every item of every call answered before the kill, which the next
    server finds by search; the next writer clears what the killed one left in staging. In each
    round, first a group the server answers: a search right after each call's answer finds its
    items."""
    from serving.client import SearchClient

    data = support.catalog(N, DIM, 100)
    root = tmp_path / "index"
    support.publish(root, data, support.model(tmp_path / "model", DIM), 1)
    original = set(IndexVersion.open(root).items.ids)
    answered: dict[str, np.ndarray] = {}  # every answered call's items, with their embeddings
    unconfirmed: dict[str, np.ndarray] = {}  # the last killed server's answered items, not yet searched
    rng = random.Random(61)
    commit_s = 0.0  # how long a group takes from its staging folder to its last answer: the last one seen
    kills_mid_group = 0
    proc = None
    try:
        for round_number in range(22):
            proc, port = _serve(root, "--ingest-window-ms", str(WINDOW_MS), *NO_MERGES)
            client = SearchClient(f"127.0.0.1:{port}", timeout=60, admin_token="crash")
            for item_id, vector in unconfirmed.items():
                assert _nearest(client, vector) == item_id, (round_number, item_id)
            # A group the server answers: each call's items found by a search right after its answer.
            before = _staging(root)
            up = _Group(client, f"up-{round_number}", seed=2 * round_number, search_after=True)
            staged = _once_staged(root, before, up)
            up.join()
            commit_s = max(up.answered_at) - staged if staged is not None else commit_s
            assert all(up.answered) and up.found == [list(call) for call in up.calls], round_number
            answered |= up.answered_items()
            assert not _staging(root), round_number  # its writer cleared what the last kill left
            # A group killed from its staging folder to its last answer.
            killed = _Group(client, f"killed-{round_number}", seed=2 * round_number + 1)
            staged = _once_staged(root, set(), killed)
            time.sleep(rng.uniform(0.0, 0.9) * commit_s if staged is not None else 0.0)
            proc.send_signal(signal.SIGKILL)
            kills_mid_group += not all(killed.answered)
            proc.wait()
            killed.join()
            client.close()
            unconfirmed = killed.answered_items()
            answered |= unconfirmed
            live = IndexVersion.open(root).load(dim=DIM)  # whole: its files agree with its manifest
            held = _live_ids(live)
            assert len(held) == live.manifest.live_size, round_number
            assert original <= held and set(answered) <= held, (round_number, sorted(set(answered) - held)[:5])
            assert killed.ids() <= held or not killed.ids() & held, round_number  # one version: all or nothing
        assert kills_mid_group >= 20, kills_mid_group
        # The last killed server's answered items, and every other answered one, found by search.
        proc, port = _serve(root, *NO_MERGES)
        with SearchClient(f"127.0.0.1:{port}", timeout=60, admin_token="crash") as client:
            missed = [item_id for item_id, vector in answered.items() if _nearest(client, vector) != item_id]
        assert not missed, missed[:5]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc is not None and proc.poll() is None:  # a failed round's server
            proc.kill()
            proc.wait()
