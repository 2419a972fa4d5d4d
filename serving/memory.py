"""Giving a swapped-out model+index pair's memory back to the operating system.

A reloaded server must not grow: the old pair is freed once the requests that took it finish,
but three things delay or hide that. Requests that failed leave reference cycles (exception →
traceback → frame → the pair) that only the cyclic collector breaks, whenever its thresholds
next trip. glibc keeps freed heap pages in its arenas rather than returning them, so RSS stays
at its high-water mark. And glibc's mmap threshold is dynamic: it starts at 128 KiB, but each
time a mapped block is freed it rises to that block's size (up to 32 MiB) — so once the first
reload frees a pair, the next pair's multi-megabyte buffers (faiss's vectors and codes, ONNX
Runtime's weights, Arrow columns) are carved from the heap arenas instead, between small
blocks that outlive them, and every reload leaves the arenas bigger and more fragmented
(measured: arenas 49 → 191 MB in 3 minutes of reloads every 20 s, 107 MB of it free).

`core.memory.pin_mmap_threshold` fixes the threshold, so large blocks always get their own
mapping and go back to the OS the moment they are freed; after a reload, `reclaim` waits for the
old pair to be collected and then trims the heap.

The last creep was Arrow's: each reload reads the version's items table (Parquet), and Arrow
allocated it from its bundled mimalloc, whose 1 GiB arena is marked for transparent huge pages —
every thread that read a table (the loader, Arrow's own pool threads) held whole 2 MiB pages for
a few KB, and ranges mimalloc had partly returned were re-filled by the kernel's khugepaged
minutes later. Measured, 20 s reloads under the soak's traffic: that arena 32 → 40 MB resident
for 1.3 MB of live Arrow data, the server's minute medians 350 → 360 MB in 9 minutes (308 → 311
with Arrow on the C heap). `steady_heap` also sends Arrow to the C heap
(`core.memory.arrow_on_c_heap`), where the pinned threshold and the trim apply to it.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref

from core.memory import arrow_on_c_heap, pin_mmap_threshold, return_free_heap

__all__ = ["arena_environment", "pin_mmap_threshold", "reclaim", "return_free_heap", "steady_heap"]

log = logging.getLogger(__name__)


def steady_heap() -> None:
    """What a server that swaps pairs needs of its allocators, set before its first pair: large
    C blocks keep their own mappings (`pin_mmap_threshold`), and Arrow — the items table every
    load reads — allocates from the C heap rather than its huge-page arena (`arrow_on_c_heap`).
    Process-wide."""
    pin_mmap_threshold()
    arrow_on_c_heap()


def arena_environment() -> dict[str, str]:
    """The environment a `serve --ray` replica process starts with: two malloc arenas, unless
    the operator sets another count. glibc gives threads arenas of their own (up to 8 a core),
    read once at process start, and a replica's gRPC, decoding and search threads fragment them:
    the ingress's RSS crept 0.8 MB a minute under `make soak` while its heap in use stayed flat
    (mallinfo2 over 4 minutes of load and reloads: 58 MB in use, free heap 10 → 17 MB; with two
    arenas 4 → 6 MB)."""
    return {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}


def reclaim(released: weakref.ref, timeout_s: float = 60.0, stop: threading.Event | None = None) -> bool:
    """Wait until the object behind `released` is collected — running the cyclic collector, as
    requests that failed on it may hold it in cycles — then trim the heap. False when `stop` is
    set first, or when it is still referenced after `timeout_s` (logged: something holds on to
    what it should have let go)."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while released() is not None:
        gc.collect()
        if released() is None:
            break
        if time.monotonic() > deadline:
            log.warning("%r is still referenced %.0f s after it was released", released(), timeout_s)
            return False
        if stop.wait(0.5):
            return False
    return_free_heap()
    return True
