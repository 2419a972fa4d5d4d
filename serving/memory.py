"""Giving a swapped-out model+index pair's memory back to the operating system.

A reloaded server must not grow: the old pair is freed once the requests that took it finish,
but two things delay or hide that. Requests that failed leave reference cycles (exception →
traceback → frame → the pair) that only the cyclic collector breaks, whenever its thresholds
next trip; and glibc keeps freed heap pages in its arenas rather than returning them, so RSS
stays at its high-water mark. After a reload, `reclaim` waits for the old pair to be collected and then trims the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)


def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_trim = _malloc_trim()


def return_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`); False where the C
    library has none (musl, macOS), which return pages by themselves or not at all."""
    if _trim is None:
        return False
    _trim(0)
    return True


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
