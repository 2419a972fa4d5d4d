"""Progress of long stages, readable where it lands: a bar on a terminal, and in a log (CI, a
container, `make demo | tee`) a line every ~30 s — done/total, rate, ETA — since a bar redrawn
with carriage returns is one unreadable line there."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
LINE_INTERVAL_S = 30.0
# A long stage's first line, with its estimate, comes after its first batches rather than a whole
# interval in: a user deciding whether to wait learns it within seconds.
FIRST_ESTIMATE_S = 10.0
# A stage says that it started only once it has run this long: a quick one is one line (its
# "done"), and a slow one is not silent meanwhile.
STAGE_START_LINE_S = 5.0

log = logging.getLogger("simsearch.progress")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """Counts work done; shows it as a tqdm bar (`mode="bar"`), as log lines every `every_s`
    seconds and at the end (`"lines"`), or not at all (`"off"`). `"auto"`: a bar when stderr
    is a terminal, lines otherwise. `first_s`: lines mode's first line after that many seconds
    (default `every_s`). `closing_line=False`: no "done" line in lines mode (a caller whose
    own line sums up the work, such as a training epoch's)."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "img",
        mode: str = "auto",
        every_s: float = LINE_INTERVAL_S,
        logger: logging.Logger | None = None,
        first_s: float | None = None,
        closing_line: bool = True,
    ) -> None:
        if mode not in ("auto", "bar", "lines", "off"):
            raise ValueError(f"progress mode must be auto, bar, lines or off, got {mode!r}")
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.total, self.desc, self.unit, self.mode, self.every_s = total, desc, unit, mode, every_s
        self.done = 0
        self.closing_line = closing_line
        self.log = logger or log
        self.started = time.monotonic()
        self._next = self.started + (every_s if first_s is None else min(first_s, every_s))
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = _duration((self.total - self.done) / rate) if rate > 0 and self.total else "?"
        return (
            f"{self.desc}: {self.done:,}/{self.total:,} {self.unit}{share}, {rate:,.0f} {self.unit}/s, "
            f"elapsed {_duration(elapsed)}, eta {eta}"
        )

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines":
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.every_s
                self.log.info("%s", self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "lines" and self.done and self.closing_line:
            self.log.info("%s", self.line().rsplit(", eta", 1)[0] + " — done")
            self.mode = "off"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(
    items: Iterable[T],
    total: int,
    desc: str,
    unit: str = "img",
    mode: str = "auto",
    logger: logging.Logger | None = None,
    closing_line: bool = True,
) -> Iterator[T]:
    """`items`, counted one by one into a `Progress`."""
    with Progress(total, desc, unit, mode, logger=logger, closing_line=closing_line) as progress:
        for item in items:
            yield item
            progress.update()


@contextmanager
def stage(desc: str, enabled: bool = True, logger: logging.Logger | None = None) -> Iterator[None]:
    """A long step with nothing to count (loading weights, tracing a graph): a line with its time
    as it ends, on a terminal and in a log alike, and one as it starts once it has run
    `STAGE_START_LINE_S` — a bar of one step says no more, and a user should not wait in silence."""
    if not enabled:
        yield
        return
    out = logger or log
    started = time.monotonic()
    started_line = threading.Timer(STAGE_START_LINE_S, out.info, args=("%s …", desc))
    started_line.daemon = True
    started_line.start()
    try:
        yield
    finally:
        started_line.cancel()
    elapsed = time.monotonic() - started
    out.info("%s — done in %s", desc, f"{elapsed:.1f}s" if elapsed < 60 else _duration(elapsed))
