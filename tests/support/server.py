"""A `SearchApp` behind a blocking API, for tests: `SearchServer(config)` binds its port,
`start()` loads and serves, `stop(grace)` drains — each run on the process's one event loop,
in a thread of its own, while the test's thread waits. The production entry point is
`serving.server.serve`, which owns its loop (`python -m serving serve`)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TypeVar

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient
from serving.config import EVENT_LOOPS, ServerConfig
from serving.listen import loop_factory
from serving.server import SearchApp

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

    def reload_now(self, version: str | None = None) -> None:
        """A reload as the server makes one by itself (CURRENT watched), with no call to it."""
        self._call(self.reload(version))


# -- loopback servers over an index root, as the serving tests start them ---------------------


def config(index_root: Path, **overrides) -> ServerConfig:
    """A loopback server's configuration; probe rounds off (a test that needs one runs it)."""
    defaults = dict(index_root=str(index_root), port=0, metrics_port=None, probe_interval_s=0, probe_size=100)
    return ServerConfig.flat(**{**defaults, **overrides})


def connect(server: SearchServer, admin_token: str | None = None) -> SearchClient:
    # Deadlines far beyond any answer's time even on a machine busy with other work: they end
    # a hung call, they do not time a healthy one.
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60, admin_token=admin_token)
    client.wait_ready(60)
    return client


def start(index_root: Path, **overrides) -> tuple[SearchServer, SearchClient]:
    server = SearchServer(config(index_root, **overrides))
    server.start()
    return server, connect(server, overrides.get("admin_token"))


def derived_version(root: Path, mutate) -> str:
    """A new (not live) version built from the live one, changed by `mutate(staging_dir)`."""
    live = artifacts.version_dir(root)
    staging = artifacts.index_staging_dir(root)
    for name in ("index.faiss", "items.parquet", "embeddings.npy", "manifest.json"):
        shutil.copy2(live / name, staging / name)
    manifest = json.loads((staging / "manifest.json").read_text())
    mutate(staging, manifest)
    version = artifacts.new_version_name(manifest["index_id"])
    manifest["version"] = version
    artifacts.write_json_atomic(staging / "manifest.json", manifest)
    artifacts.publish_version(root, staging, version, make_current=False)
    return version


def image_requests(root: Path, n: int, k: int = 5) -> list[pb.SearchRequest]:
    items = ItemTable.read(artifacts.version_dir(root) / "items.parquet")
    return [
        pb.SearchRequest(image=Path(items.paths[i]).read_bytes(), k=k, exclude_ids=[items.ids[i]]) for i in range(n)
    ]


def wait_for(predicate, timeout: float = 60.0):
    """`predicate()` once it is truthy: a wait for a condition, the timeout only a bound on a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")
