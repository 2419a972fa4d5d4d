"""The last hour of the server's own traffic, kept in memory for the console's Health page (no
Prometheus needed): per interval, queries per second and the p50/p99 latency of the calls that
finished in it — the whole server's, however many worker processes answer.

Each interval keeps its calls' latencies as counts in log-spaced buckets (10% wide), not the
latencies themselves: counts add up across processes, so the workers of `serve --processes N`
each write their last hour to a file under the metrics directory (`share`), and the worker a
console asks merges every file with its own; a percentile read from them is within a bucket's
width (±5%) of the exact one. Intervals are aligned to the clock (multiples of `interval_s`), so
every worker's line up.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FLOOR_S = 1e-5  # the first bucket's upper edge: every faster call counts in it
RATIO = 1.1  # each bucket's upper edge over its lower
BUCKETS = 224  # up to FLOOR_S × RATIO**224 ≈ 19 minutes; a slower call counts in the last


@dataclass(frozen=True)
class Point:
    t: float  # the interval's end, Unix seconds
    qps: float
    p50_ms: float | None
    p99_ms: float | None


def bucket_of(seconds: float) -> int:
    """The bucket a call of `seconds` counts in."""
    if seconds <= FLOOR_S:
        return 0
    return min(BUCKETS - 1, 1 + int(math.log(seconds / FLOOR_S) / math.log(RATIO)))


def percentile_ms(counts: np.ndarray, q: float) -> float | None:
    """The `q` quantile (0..1) of the latencies counted in `counts`, in ms: the geometric middle
    of the bucket it falls in (None: no call)."""
    total = int(counts.sum())
    if not total:
        return None
    bucket = int(np.searchsorted(np.cumsum(counts), max(1, math.ceil(q * total))))
    if bucket == 0:
        return FLOOR_S * 1e3
    return FLOOR_S * RATIO ** (bucket - 0.5) * 1e3


class TrafficHistory:
    """A ring of intervals, one per `interval_s`, `span_s` long, each its calls' latency counts.
    `observe` is called once a call finishes, from any thread; intervals close when read, when
    the next call lands, or when the sharing thread writes them (`share`)."""

    def __init__(self, interval_s: float = 10.0, span_s: float = 3600.0, clock=time.time) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._ring: deque[tuple[float, np.ndarray]] = deque(maxlen=max(1, round(span_s / interval_s)))
        self._lock = threading.Lock()
        self._start = self._aligned(clock())
        self._counts = np.zeros(BUCKETS, dtype=np.int64)
        self._shared: Path | None = None  # where the workers write their rings (`share`)
        self._name = ""  # this process's file there
        self._stopped = threading.Event()

    def observe(self, seconds: float) -> None:
        bucket = bucket_of(seconds)
        with self._lock:
            self._close_intervals(self._clock())
            self._counts[bucket] += 1

    def points(self) -> list[Point]:
        """The closed intervals, oldest first: this process's, plus every other worker's that
        shares them (`share`), counted together."""
        with self._lock:
            self._close_intervals(self._clock())
            merged = {end: counts.copy() for end, counts in self._ring}
        if self._shared is not None:
            for end, counts in self._siblings():
                if end in merged:
                    merged[end] += counts
                elif self._ring and end >= self._ring[0][0]:  # not older than this ring reaches
                    merged[end] = counts
        return [
            Point(end, int(counts.sum()) / self.interval_s, percentile_ms(counts, 0.5), percentile_ms(counts, 0.99))
            for end, counts in sorted(merged.items())
        ]

    def share(self, directory: Path, name: str) -> None:
        """Write this process's closed intervals to `directory`/`name`.npz shortly after each
        interval ends (a daemon thread, until `stop`), and count the other files there in
        `points`: how the workers of one server show one history."""
        directory.mkdir(parents=True, exist_ok=True)
        self._shared, self._name = directory, name
        threading.Thread(target=self._write_each_interval, name="history-share", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _write_each_interval(self) -> None:
        while True:
            now = self._clock()
            # Just after the interval ends, so that a reader elsewhere finds it written.
            if self._stopped.wait(self._aligned(now) + self.interval_s - now + 0.05 * self.interval_s):
                return
            with self._lock:
                self._close_intervals(self._clock())
                ends = np.array([end for end, _ in self._ring], dtype=np.float64)
                counts = np.stack([c for _, c in self._ring]) if self._ring else np.zeros((0, BUCKETS), np.int64)
            target = self._shared / f"{self._name}.npz"
            staging = target.with_suffix(".tmp.npz")
            np.savez(staging, ends=ends, counts=counts)
            os.replace(staging, target)  # a reader sees the last whole file

    def _siblings(self) -> list[tuple[float, np.ndarray]]:
        found = []
        for path in self._shared.glob("*.npz"):
            if path.stem == self._name or path.name.endswith(".tmp.npz"):
                continue
            try:
                with np.load(path) as stored:
                    found += list(zip(stored["ends"].tolist(), stored["counts"], strict=True))
            except (OSError, ValueError, KeyError):  # a worker's file gone or half there: its figures wait
                continue
        return found

    def _aligned(self, t: float) -> float:
        return math.floor(t / self.interval_s) * self.interval_s

    def _close_intervals(self, now: float) -> None:
        while now - self._start >= self.interval_s:
            end = self._start + self.interval_s
            self._ring.append((end, self._counts))
            self._counts = np.zeros(BUCKETS, dtype=np.int64)
            # After a long idle stretch, empty intervals up to now (at most a ring's worth).
            behind = now - end
            self._start = end if behind < self.interval_s * self._ring.maxlen else self._aligned(now) - self.interval_s
