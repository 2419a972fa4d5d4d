"""The monitor's sliding windows of scored answers (`serving.monitoring.monitor`): Recall@K over
the last N labelled answers or Feedback marks, and the sample behind each K's figure."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class SlidingRecall:
    """Recall@K over the last `window` scored answers: each answer's first-hit rank and length.
    An answer counts towards Recall@K only for K within its length (a 3-row answer says nothing
    of R@10), and a K no answer reaches has no figure. Answers scored under a key (Feedback's
    request id) count once: scoring the same key again replaces its mark."""

    def __init__(self, ks: Sequence[int], window: int) -> None:
        self.ks = tuple(ks)
        self.window = window
        self._marks: OrderedDict[object, tuple[int, int]] = OrderedDict()  # key → (first-hit rank, length)
        self._unkeyed = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._marks)

    def add(self, first_hit_rank: int | None, length: int, key: object = None) -> None:
        mark = (first_hit_rank if first_hit_rank is not None else 1 << 30, length)
        with self._lock:
            self._marks[key if key is not None else ("unkeyed", next(self._unkeyed))] = mark
            while len(self._marks) > self.window:
                self._marks.popitem(last=False)

    def values(self) -> dict[int, float] | None:
        with self._lock:
            if not self._marks:
                return None
            ranks, lengths = np.array(list(self._marks.values()), dtype=np.int64).T
        found = {k: float(np.mean(ranks[lengths >= k] < k)) for k in self.ks if np.any(lengths >= k)}
        return found or None

    def counts(self) -> dict[int, int]:
        """Answers behind each K's figure: those reaching K."""
        with self._lock:
            lengths = np.fromiter((length for _, length in self._marks.values()), dtype=np.int64)
        return {k: int(np.sum(lengths >= k)) for k in self.ks if np.any(lengths >= k)}

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()
