"""The C heap of a long-lived process that allocates large buffers over and over (a server
reloading indexes, an image decoder streaming a catalog): glibc's mmap threshold is dynamic — it
starts at 128 KiB, but each time a mapped block is freed it rises to that block's size (up to
32 MiB) — so once the first large buffer is freed, the next ones are carved from the heap arenas,
between small blocks that outlive them, and the heap grows with every buffer instead of being
reused. `pin_mmap_threshold` fixes the threshold, so large blocks always get their own mapping
and go back to the OS the moment they are freed.

Measured: a server's arenas 49 → 191 MB in 3 minutes of reloads every 20 s (serving/memory.py);
a training DataLoader process decoding 224-px images grew ~370 KB an image without it (SOP's
63,800 test images: 9+ GB per decoding process, until the OOM killer) and stays at 0.5 GB with it.

Arrow is the other allocator in these processes: its wheel's default pool is a bundled mimalloc,
which reserves a 1 GiB arena marked for transparent huge pages (`madvise(MADV_HUGEPAGE)`) and
gives each thread pages of its own. Where the kernel honours that mark (THP mode `madvise` or
`always`), the first block a thread takes in a 2 MiB range makes the whole range resident, and
the kernel's khugepaged later re-fills ranges mimalloc had partly returned: a 100-byte Arrow
buffer costs 2 MiB, and a process that reads a Parquet file now and then from changing threads
(a server reloading its items table) grows in 2 MiB steps at the kernel's pace. `arrow_on_c_heap`
sends Arrow's allocations to the C heap instead, where the pinned threshold and
`return_free_heap` apply to them like to everything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any


def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name, None) if library else None
    except OSError:
        return None


_trim = _libc_function("malloc_trim")
_mallopt = _libc_function("mallopt")
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept from then on


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Blocks of `nbytes` or more always get their own mapping (setting the threshold switches
    glibc's dynamic adjustment off). Process-wide; False where the C library has no mallopt."""
    if _mallopt is None:
        return False
    return bool(_mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def return_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim`); False where the C
    library has none (musl, macOS), which return pages by themselves or not at all."""
    if _trim is None:
        return False
    _trim(0)
    return True


def arrow_on_c_heap() -> None:
    """Arrow's default memory pool becomes the C library's allocator (Parquet reads, the buffers
    of the tables they return), in place of its bundled mimalloc and its huge-page arena (see
    above). Process-wide, for what is allocated from now on. Parquet's reader still takes a few
    hundred KB from Arrow's C++ default pool, which only `ARROW_DEFAULT_MEMORY_POOL=system`
    set before pyarrow loads would change: a huge page or two, that do not multiply."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
