"""The threads one search may use in a server process (issue 62): by default the CPUs less one a
process for its event loop, shared out among the processes; set on the loop's thread and in
every pool whose threads search (OpenMP keeps the count a thread), and for the BLAS libraries
(one count a process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.config import Runtime, available_cpus

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_leaves_a_core_a_process_for_its_event_loop():
    cpus = available_cpus()
    assert Runtime().search_threads_of(1) == max(1, cpus - 1)
    assert Runtime().search_threads_of(cpus) == 1  # serve's default: a process a CPU
    assert Runtime().search_threads_of(cpus * 4) == 1  # never none
    assert Runtime(search_threads=3).search_threads_of(cpus) == 3  # the operator's count wins
    with pytest.raises(ValueError, match="search_threads must be positive, got 0"):
        Runtime(search_threads=0)


# Run in a process of its own: the counts are the process's and its threads', not a test's to change.
PROBE = """
import json, threading
from concurrent.futures import ThreadPoolExecutor
import faiss
from threadpoolctl import threadpool_info
from serving.search.threads import SearchThreads

default = faiss.omp_get_max_threads()
SearchThreads.set(1)
plain = []
thread = threading.Thread(target=lambda: plain.append(faiss.omp_get_max_threads()))
thread.start(); thread.join()
with ThreadPoolExecutor(1, "inference", SearchThreads.apply) as pool:
    pooled = pool.submit(faiss.omp_get_max_threads).result()
blas = {i["filepath"].rsplit("/", 1)[-1]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
loop = faiss.omp_get_max_threads()
print(json.dumps({"default": default, "loop": loop, "plain": plain[0], "pooled": pooled, "blas": blas}))
"""


def test_the_count_holds_on_the_setting_thread_in_pools_that_apply_it_and_for_blas():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["default"] == 2 and seen["loop"] == 1 and seen["pooled"] == 1
    # Why every searching pool applies it: a thread of its own starts from OpenMP's default.
    assert seen["plain"] == 2
    assert seen["blas"] and set(seen["blas"].values()) == {1}, seen  # numpy's OpenBLAS and faiss's
