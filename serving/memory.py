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
import inspect
import logging
import os
import sys
import threading
import time
import weakref

from core.memory import arrow_on_c_heap, pin_mmap_threshold, return_free_heap

__all__ = ["arena_environment", "holders", "pin_mmap_threshold", "reclaim", "return_free_heap", "steady_heap"]

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
            held = released()
            log.warning(
                "%r is still referenced %.0f s after it was released, held by: %s",
                held, timeout_s, "; ".join(holders(held)) or "nothing it can name",
            )  # fmt: skip
            del held
            return False
        if stop.wait(0.5):
            return False
    return_free_heap()
    return True


def holders(target: object, depth: int = 4, most: int = 8) -> list[str]:
    """What keeps `target` alive, as far as it can be named: the frames (function, file:line) and
    the objects' attributes (`Class.attribute`) that refer to it, followed up through containers
    (dicts, lists, tuples, deques, cells) for `depth` links — what a warning that a released pair
    is still referenced needs to say for anyone to find the holder. At most `most` of them."""
    mine = inspect.currentframe()
    # The collector does not see what an executing frame holds: each running thread's frames'
    # locals are looked through apart.
    running = [frame for top in sys._current_frames().values() for frame in _stack(top) if frame is not mine]
    found: list[str] = []
    seen = {id(target), id(running)}
    level = [target]
    for _ in range(depth):
        above: list[object] = []
        for obj in level:
            holding = [frame for frame in running if any(value is obj for value in frame.f_locals.values())]
            for ref in [*holding, *gc.get_referrers(obj)]:
                if id(ref) in seen or ref is level or ref is above or ref is mine:
                    continue
                seen.add(id(ref))
                named = _named_holder(ref, obj)
                if named is not None:
                    found.append(named)
                    if len(found) >= most:
                        return found
                elif not (inspect.isframe(ref) or inspect.iscoroutine(ref) or inspect.isgenerator(ref)):
                    above.append(ref)
        level = above
    return found


def _named_holder(ref: object, held: object) -> str | None:
    """`ref` named, when it names a place: a frame, or an object's attribute holding `held`."""
    if inspect.isframe(ref) or inspect.iscoroutine(ref) or inspect.isgenerator(ref):
        frame = ref if inspect.isframe(ref) else getattr(ref, "cr_frame", None) or getattr(ref, "gi_frame", None)
        code = frame.f_code if frame is not None else getattr(ref, "cr_code", None) or ref.gi_code
        if code.co_filename == __file__:
            return None
        line = f":{frame.f_lineno}" if frame is not None else ""
        return f"{code.co_qualname} ({os.path.basename(code.co_filename)}{line})"
    if isinstance(ref, dict):
        owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        if owners:
            key = next((k for k, v in ref.items() if v is held), "?")
            return f"{type(owners[0]).__qualname__}.{key}"
        return None
    attributes = getattr(ref, "__dict__", None)  # an instance whose attributes are inline (no dict object)
    if isinstance(attributes, dict) and not isinstance(ref, type):
        key = next((k for k, v in attributes.items() if v is held), None)
        if key is not None:
            return f"{type(ref).__qualname__}.{key}"
    return None


def _stack(frame: object) -> list[object]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames
