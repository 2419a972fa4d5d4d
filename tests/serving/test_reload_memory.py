"""A reloaded server lets go of what it replaced, and a reload that cannot load fails precisely
while the live pair keeps serving. Real servers on loopback over the demo chain's artifacts."""

from __future__ import annotations

import gc
import platform
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from core.memory import return_free_heap
from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.memory import reclaim
from tests.support.index import write_catalog_index
from tests.support.server import SearchServer, config, derived_version, image_requests, start, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def index_root(demo_run, tmp_path) -> Path:
    root = tmp_path / "index"
    shutil.copytree(demo_run / "index", root)
    return root


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_what_stays_referenced_is_named_by_its_holders(caplog):
    """The warning names what holds a released pair: an object's attribute (through a list), and
    a thread waiting with it in a local — without the names, nobody can find the holder."""

    class Keeper:
        def __init__(self, kept) -> None:
            self.kept = [kept]

    def waiting_with(pair, release: threading.Event) -> None:
        release.wait(10)
        del pair

    node = Node()
    keeper = Keeper(node)
    release = threading.Event()
    waiter = threading.Thread(target=waiting_with, args=(node, release))
    waiter.start()
    try:
        with caplog.at_level("WARNING", logger="serving.memory"):
            assert not reclaim(weakref.ref(node), timeout_s=0.2)
        said = caplog.text
        assert "still referenced" in said and "Keeper.kept" in said, said
        assert "waiting_with (test_reload_memory.py:" in said, said
    finally:
        release.set()
        waiter.join()
    del keeper


def test_reclaim_collects_cycles_and_reports_what_stays_referenced():
    gc.disable()  # the collector must not run by itself meanwhile: reclaim is what runs it
    try:
        node = Node()
        ref = weakref.ref(node)
        del node
        assert ref() is not None
        assert reclaim(ref, timeout_s=5) and ref() is None
        held = Node()
        assert not reclaim(weakref.ref(held), timeout_s=0.2)
        stop = threading.Event()
        stop.set()
        assert not reclaim(weakref.ref(held), timeout_s=60, stop=stop)  # a stopping server does not wait
    finally:
        gc.enable()


def test_the_heap_is_trimmed_where_the_c_library_is_glibc():
    assert return_free_heap() == (platform.libc_ver()[0] == "glibc")


# A fresh process each: the threshold is process-wide. Prints the MiB held in mapped blocks
# while the second of two 5 MiB buffers is alive.
SECOND_BUFFER = """
import ctypes, sys
import numpy as np
from serving.memory import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold()
first = np.ones(5 << 17)
del first  # a freed mapped block: glibc's dynamic threshold rises to its size
second = np.ones(5 << 17)
print(libc.mallinfo2().hblkhd >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator and its mallinfo2")
def test_large_buffers_keep_their_own_mapping_once_a_reload_has_freed_one():
    """What made every reload grow the heap: after the first pair's buffers were freed, glibc
    carved the next pair's from its arenas. Pinned, they are mapped (and unmapped on free)."""

    def mapped_mib(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", SECOND_BUFFER, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    assert mapped_mib("dynamic") == 0  # glibc's default: the second buffer came from the heap
    assert mapped_mib("pinned") == 5


# A fresh process each: Arrow's pool and the huge-page arena are process-wide. Reads an items
# table 12 times, each on a thread of its own with the new table replacing the old, as reloads
# do; prints, after each read, the MiB resident in mappings marked for transparent huge pages.
ITEMS_READS = """
import sys, tempfile, threading
from core.data.items import ItemTable

def marked_mib():
    marked = rss = 0
    for line in open("/proc/self/smaps"):
        field, *rest = line.split()
        if field == "Rss:":
            rss = int(rest[0])
        elif field == "VmFlags:" and "hg" in rest:
            marked += rss
    return marked >> 10

if sys.argv[1] == "server":
    from serving.config import ServerConfig
    from serving.server import SearchApp
    SearchApp(ServerConfig.flat(index_root=tempfile.mkdtemp(), watch_current=True))  # no index yet: wait for one
live, figures = [None], []
for _ in range(12):
    reader = threading.Thread(target=lambda: live.__setitem__(0, ItemTable.read(sys.argv[2])))
    reader.start()
    reader.join()
    figures.append(marked_mib())
print(" ".join(map(str, figures)))
"""


def _transparent_huge_pages() -> bool:
    """Whether the kernel backs memory a process marks (madvise) with huge pages."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/smaps")
def test_the_items_table_a_reload_reads_is_not_held_in_huge_pages(tmp_path):
    """What still grew in 2 MiB steps across reloads: Arrow's bundled mimalloc keeps its arena in
    transparent huge pages and each thread that allocates gets pages of its own, so every items
    table read (a ~1.5 MB table here) held 2 MiB ranges, 20–40 MiB in all. The server routes
    Arrow to the C heap."""
    n = 10_000
    path = tmp_path / "items.parquet"
    ItemTable(
        [f"c{i % 58}/face{i}.png" for i in range(n)],
        [f"c{i % 58}" for i in range(n)],
        [f"/data/glyphs/c{i % 58}/face{i}.png" for i in range(n)],
        [{"font": f"face{i}"} for i in range(n)],
    ).write(path)

    def marked_mib(mode: str) -> list[int]:
        done = subprocess.run(
            [sys.executable, "-c", ITEMS_READS, mode, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return [int(x) for x in done.stdout.split()]

    if _transparent_huge_pages() and pa.default_memory_pool().backend_name == "mimalloc":
        assert marked_mib("default")[-1] >= 16  # Arrow's default: the table's reads in huge pages
    served = marked_mib("server")
    # What is left: the few hundred KB Parquet's reader takes from Arrow's C++ default pool
    # whatever the pool in use — a huge page or two, that do not multiply with reads.
    assert max(served) <= 6, served


@pytest.mark.slow
def test_a_swapped_out_pair_is_freed_once_the_requests_that_took_it_finish(index_root):
    requests = image_requests(index_root, 8)
    server, client = start(index_root, admin_token="tok", ann_sample_rate=1.0, max_batch_size=4)
    try:
        answered = [client.search(r) for r in requests]  # feedback window and sampled ANN checks
        for bad in (
            pb.SearchRequest(image=b"not an image", k=3),
            pb.SearchRequest(item_id="no-such-item", k=3),
            pb.SearchRequest(embedding=pb.Embedding(values=[float("nan")] * server.engine.pair.dim), k=3),
        ):  # failed requests leave reference cycles through their tracebacks
            with pytest.raises(grpc.RpcError):
                client.search(bad)
        old = weakref.ref(server.engine.pair)
        server.batcher.pause()
        held: list[pb.SearchResponse] = []
        waiting = threading.Thread(target=lambda: held.append(client.search(requests[0])))
        waiting.start()
        wait_for(lambda: server.batcher.queued == 1)
        client.reload()
        gc.collect()
        assert old() is not None and old() is not server.engine.pair, "a queued request still holds the old pair"
        server.batcher.resume()
        waiting.join(60)
        assert held and held[0].neighbors
        # The server's own reclaim thread frees it: no collection run by the test.
        wait_for(lambda: old() is None)
        # The Feedback window still knows the request the old pair answered, and refuses to
        # count feedback on it (it does not describe what is served), without keeping the pair.
        assert client.feedback(answered[0].request_id, [answered[0].neighbors[0].id]).accepted is False
        fresh = client.search(requests[1])
        assert client.feedback(fresh.request_id, [fresh.neighbors[0].id]).accepted is True
    finally:
        client.close()
        server.stop(0)


def test_an_aborted_call_keeps_no_pair_alive(tmp_path):
    """Issue 47: grpc.aio keeps the AbortError of a call it aborted past the call (its latest until
    its next call; the first of a server whose call found no registered method, for as long as the
    server runs). Raised while the call's failure was being handled, it carried that failure as its
    context — the request's frames, the pair that answered it — so `serve --ray`'s ingress warned
    `ServingPair(…, serial=1) is still referenced 60 s after it was released` after a reload. The
    abort is raised apart from the failure: the pair swapped out is freed by the server's own
    reclaim thread, no call after the failed one needed."""
    server = SearchServer(config(write_catalog_index(tmp_path)))
    server.start()
    try:
        nan = pb.SearchRequest(embedding=pb.Embedding(values=[float("nan")] * server.engine.pair.dim), k=3)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.SimilaritySearchStub(channel).Search(nan, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        old = weakref.ref(server.engine.pair)
        server.reload_now()  # not a call: grpc still holds the failed one's AbortError
        assert old() is not server.engine.pair
        wait_for(lambda: old() is None, timeout=10)
    finally:
        server.stop(0)


def truncated(name: str):
    def mutate(staging: Path, manifest: dict) -> None:
        path = staging / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])

    return mutate


def garbled(name: str):
    def mutate(staging: Path, manifest: dict) -> None:
        (staging / name).write_bytes(b"\x00garbage\xff" * 64)

    return mutate


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (truncated(artifacts.INDEX_FILE), "index.faiss is damaged"),
        (garbled(artifacts.INDEX_FILE), "index.faiss is damaged"),
        (garbled(artifacts.ITEMS_FILE), "items.parquet is damaged"),
        (lambda staging, manifest: (staging / artifacts.ITEMS_FILE).unlink(), "items.parquet is missing"),
        (truncated(artifacts.EMBEDDINGS_FILE), "embeddings.npy is damaged"),
        ("model", "model.onnx is damaged"),
        ("missing", "does not exist"),
        (
            lambda staging, manifest: manifest.update(model_id="another-model"),
            "was built with model another-model, not with model",
        ),
    ],
    ids=[
        "index-truncated",
        "index-garbage",
        "items-garbage",
        "items-missing",
        "vectors-truncated",
        "model-damaged",
        "version-missing",
        "another-model",
    ],
)
def test_a_reload_that_cannot_load_fails_precisely_and_the_live_pair_keeps_serving(
    index_root, tmp_path, demo_run, damage, named
):
    live = artifacts.current_version(index_root)
    model_dir = ""
    if damage == "missing":
        version = "20991231T000000000000-nosuchversion00"
    elif damage == "model":
        version = live
        shutil.copytree(demo_run / "model", tmp_path / "model")
        truncated(artifacts.MODEL_FILE)(tmp_path / "model", {})
        model_dir = str(tmp_path / "model")
    else:
        version = derived_version(index_root, damage)
    (request,) = image_requests(index_root, 1)
    server, client = start(index_root, admin_token="tok")
    try:
        before = client.search(request)
        with pytest.raises(grpc.RpcError) as err:
            client.reload(index_version=version, model_dir=model_dir)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "still serving the old pair" in err.value.details() and named in err.value.details()
        # The refused candidate and the pair still serving, each by name.
        model = server.engine.pair.model_id
        assert f"reload of index {version}" in err.value.details() and "the loaded model" not in err.value.details()
        assert f"still serving the old pair (index {live} with model {model})" in err.value.details()
        after = client.search(request)
        assert after.index_version == live and [n.id for n in after.neighbors] == [n.id for n in before.neighbors]
        assert server.metrics.reload_failures._value.get() == 1
    finally:
        client.close()
        server.stop(0)
