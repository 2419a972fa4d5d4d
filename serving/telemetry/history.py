"""The last hour of the server's own traffic, kept in memory for the console's Health page (no
Prometheus needed): per interval, queries per second and the p50/p99 latency of the calls that
finished in it."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Point:
    t: float  # the interval's end, Unix seconds
    qps: float
    p50_ms: float | None
    p99_ms: float | None


class TrafficHistory:
    """A ring buffer of `Point`s, one per `interval_s`, `span_s` long. `observe` is called once a
    call finishes, from any thread; intervals close when read or when the next call lands."""

    def __init__(self, interval_s: float = 10.0, span_s: float = 3600.0, clock=time.time) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._points: deque[Point] = deque(maxlen=max(1, round(span_s / interval_s)))
        self._lock = threading.Lock()
        self._start = clock()
        self._latencies: list[float] = []

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._close_intervals(self._clock())
            self._latencies.append(seconds)

    def points(self) -> list[Point]:
        with self._lock:
            self._close_intervals(self._clock())
            return list(self._points)

    def _close_intervals(self, now: float) -> None:
        while now - self._start >= self.interval_s:
            end = self._start + self.interval_s
            latencies = np.asarray(self._latencies) * 1e3
            p50, p99 = np.percentile(latencies, [50, 99]).tolist() if len(latencies) else (None, None)
            self._points.append(Point(end, len(latencies) / self.interval_s, p50, p99))
            self._latencies = []
            # After a long idle stretch, empty intervals up to now (at most a ring's worth).
            self._start = end if now - end < self.interval_s * self._points.maxlen else now - self.interval_s
