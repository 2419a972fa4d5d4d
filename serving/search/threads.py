"""The threads one search may use in a server process (`SearchThreads`): set once a process,
by `serve`'s workers and `serve --ray`'s shard replicas alike."""

from __future__ import annotations

import faiss
from threadpoolctl import threadpool_limits


class SearchThreads:
    """The threads one search may use in this process: faiss's OpenMP threads and the BLAS
    libraries' (numpy's OpenBLAS, for the exact scores and reranks around faiss; faiss's own).
    A BLAS library keeps one count a process (`threadpoolctl` sets it); OpenMP keeps one a
    thread — `omp_set_num_threads` sets the calling thread's, and a thread starts from
    OMP_NUM_THREADS, by default every CPU — so a server sets both on its loop's thread (`set`)
    and makes every pool whose threads search apply OpenMP's as they start (`apply`, their
    initializer). Why it matters: numpy's OpenBLAS threads spin after each call, taking the core
    the other worker or the event loop needs (2 workers on 2 CPUs, HNSW at c = 8: 531 q/s with
    the libraries' own counts, 882 with one thread each; docs/benchmarks.md)."""

    count: int | None = None  # None: the libraries' own

    @classmethod
    def set(cls, count: int) -> None:
        cls.count = count
        threadpool_limits(count, user_api="blas")
        cls.apply()

    @classmethod
    def described(cls) -> str:
        """The count as a server's log says it."""
        return f"faiss searches on {cls.count} thread{'' if cls.count == 1 else 's'} a search"

    @classmethod
    def apply(cls) -> None:
        if cls.count is not None:
            faiss.omp_set_num_threads(cls.count)
