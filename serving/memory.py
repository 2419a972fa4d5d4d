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
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

from core.memory import pin_mmap_threshold, return_free_heap

__all__ = ["pin_mmap_threshold", "reclaim", "return_free_heap"]

log = logging.getLogger(__name__)


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
