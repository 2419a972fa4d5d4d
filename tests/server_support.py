"""A `SearchApp` behind a blocking API, for tests: `SearchServer(config)` binds its port,
`start()` loads and serves, `stop(grace)` drains — each run on the process's one event loop,
in a thread of its own, while the test's thread waits. The production entry point is
`serving.server.serve`, which owns its loop (`python -m serving serve`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TypeVar

from serving.server import EVENT_LOOPS, SearchApp, ServerConfig, loop_factory

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_loop_kind: str | None = None
_loop_lock = threading.Lock()


def event_loop(kind: str = "uvloop") -> asyncio.AbstractEventLoop:
    """The process's event loop for its servers, running on its own thread. One for every server
    in the process: grpc.aio shares one completion queue between loops, and each extra loop is
    woken for every event."""
    global _loop, _loop_kind
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {kind!r}")
    with _loop_lock:
        if _loop is None:
            _loop, _loop_kind = loop_factory(kind), kind
            threading.Thread(target=_loop.run_forever, name="grpc-aio", daemon=True).start()
        elif kind != _loop_kind:
            raise ValueError(f"this process already runs its servers on a {_loop_kind} loop, not {kind}")
        return _loop


class SearchServer(SearchApp):
    """A search server a test drives from its own thread: construction binds the port."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self._call(self.bind())

    def _call(self, coroutine: Coroutine[object, object, T], timeout: float | None = None) -> T:
        """Run a coroutine on the servers' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, event_loop(self.config.runtime.event_loop)).result(timeout)

    def start(self) -> None:  # type: ignore[override]  # the blocking form of SearchApp.start
        self._call(super().start())

    def stop(self, grace: float | None = 5.0) -> None:  # type: ignore[override]
        self._call(super().stop(grace))
