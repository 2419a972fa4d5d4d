"""The search server: its parts put together, its lifecycle, and `serve()`, the process's entry
point (`python -m serving serve` runs it in `asyncio.run`), in the shape of grpc's asyncio
examples.

One asyncio event loop takes every RPC; nothing on it blocks. Tiny images are decoded on the
loop; small ones, and any the inference thread would take at once (batching off, or the batcher
idle), by the inference thread that embeds them; the rest in a worker pool while they wait.
Embedding and search run in the batcher's inference threads (a batch per stream), reloads in
the loop's default executor. `SearchApp` owns the parts — engine, batcher, decode pool, recall
monitor and its probe runner, the service layer and its thin servicers, health, the metrics
endpoint — and reloads (on request, or when CURRENT changes); the servicers only translate
(`serving.transport.servicer`), the logic is plain classes (`serving.api.search_service`,
`serving.api.admin_service`). What it is told to do is `serving.config.ServerConfig`; where it
listens, `serving.listen`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2

from core.artifacts import layout as artifacts
from core.artifacts.layout import ArtifactError
from index.changes.lifecycle import RollbackReport, rollback
from serving.api.admin_service import AdminService
from serving.api.search_service import SearchService
from serving.api.siblings import Siblings
from serving.api.writes import IndexWrites, WriteOptions
from serving.config import ServerConfig
from serving.listen import (
    PortInUse,
    bind_grpc,
    claim_port,
    loop_factory,
    new_grpc_server,
    worker_slot,
    worker_socket,
    worker_sockets,
    workers_folder,
)
from serving.memory import reclaim, steady_heap
from serving.monitoring.lineage import grew_from
from serving.monitoring.monitor import RecallMonitor
from serving.monitoring.probe import ProbeRunner
from serving.search.batching import DynamicBatcher
from serving.search.engine import SearchEngine, ServingPair
from serving.search.threads import SearchThreads
from serving.telemetry.history import TrafficHistory
from serving.telemetry.metrics import ServiceMetrics
from serving.transport.auth import Tokens
from serving.transport.calls import CallRecorder
from serving.transport.http import HttpApi, tls_context
from serving.transport.servicer import SEARCH_SERVICE

log = logging.getLogger(__name__)


class SearchApp:
    """Owns the engine, batcher, recall monitor, gRPC server, health status and metrics endpoint.
    Its lifecycle runs on the loop that serves it: `await start()`, `await stop()`."""

    def __init__(
        self,
        config: ServerConfig,
        engine: SearchEngine | None = None,
        load: Callable[..., ServingPair] | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        """`engine`, `load` and `metrics`: a sharded server's (`serving.ray_serve.deployment`) — its engine
        searches the shards, its load opens the version on them; by default the one-index engine
        and `config.load`."""
        config.check_inputs()
        self.config = config
        steady_heap()  # before the first pair: see serving/memory.py
        # One of a server's worker processes (`serving.workers`): its ports shared with its siblings
        self.slot = worker_slot()
        self.metrics = metrics or ServiceMetrics(worker=self.slot[0] if self.slot else None)
        self.engine = engine or SearchEngine(config.limits)
        self._load = load or config.load
        self._stopping = threading.Event()  # ends the reclaim threads' and compactions' waits
        self._wire_search()
        self._wire_front()
        self.health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.http_port: int | None = None
        self._reload_lock = asyncio.Lock()
        self._watcher: asyncio.Task | None = None
        self._watched_failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once bound
        self._metrics_bound = False

    def _wire_search(self) -> None:
        """The search's parts: batcher, decode pool, recall monitor, the service and its probe runner."""
        config, workers, batching = self.config, self.config.runtime.worker_threads, self.config.batching
        self.batcher = DynamicBatcher(
            self.engine,
            self.metrics,
            batching.max_batch_size,
            batching.max_wait_ms / 1e3,
            batching.max_queue,
            enabled=batching.enabled,
            workers=workers,
            streams=batching.batch_streams,
        )
        self.decode_pool = ThreadPoolExecutor(workers, "decode", SearchThreads.apply)
        self.monitor = RecallMonitor(config.monitor, self.metrics)
        self.service = SearchService(
            self.engine,
            self.batcher,
            self.monitor,
            self.metrics,
            self.decode_pool,
            config.runtime.inline_decode_pixels,
            config.runtime.inference_decode_pixels,
            config.monitor.feedback_window,
        )
        self.prober = ProbeRunner(
            self.service,
            self.engine,
            config.monitor.ks,
            config.monitor.probe_size,
            config.limits.max_batch_queries,
            config.monitor.probe_catalog,
            config.monitor.probe_filter_message(),
        )

    def _wire_front(self) -> None:
        """What the transports answer with: tokens, the call recorder, the admin service, the HTTP API."""
        config = self.config
        self.tokens = Tokens(config.transport.admin_token, config.transport.search_token)
        options = WriteOptions(
            config.index_root,
            config.keep_versions,
            config.max_segments,
            config.drain_timeout_s,
            config.ingest_window_ms / 1e3,
            config.merges,
        )
        # One of a server's workers relays its reloads to its siblings and merges their figures
        # into its GetInfo (serving.api.siblings).
        transport = config.transport
        self.siblings = (
            Siblings(self.slot[0], worker_sockets(self.slot), transport.admin_token, transport.search_token)
            if self.slot is not None and worker_socket(self.slot[0]) is not None
            else None
        )
        self.service.siblings = self.siblings
        # A write's reload finds its version live when the CURRENT watcher loaded it first: nothing to load again.
        reload = functools.partial(self.reload_server, unless_live=True)
        self.writes = IndexWrites(options, reload, self.service, self.metrics, self._stopping)
        self.recorder = CallRecorder(self.metrics, TrafficHistory(), config.access_log)
        shared = workers_folder()
        if self.slot is not None and shared is not None:  # the console's last hour is the whole server's
            self.recorder.history.share(shared / "history", f"worker-{self.slot[0]}")
        self.admin = AdminService(
            self.reload_server,
            self.writes.remove_items,
            config.index_root,
            rollback=self.rollback,
            live=lambda: self.engine.pair if self.engine.loaded else None,
            add=self.writes.add_items,
            checks=self.service.checks,
            reload_here=self.reload,
        )
        self.http = HttpApi(
            self.service,
            self.admin,
            self.tokens,
            self.recorder,
            config.limits.max_message_bytes,
            config.transport.http_cors_origin,
        )

    async def bind(self) -> int:
        """Create the grpc.aio server on the running loop (it belongs to the loop it was made on)
        and bind its port, not yet serving; the port."""
        config, transport = self.config, self.config.transport
        self._loop = asyncio.get_running_loop()
        shared = self.slot is not None
        self.grpc_server = new_grpc_server(
            config, self.tokens, self.recorder, self.service, self.admin, self.health, shared=shared
        )
        await self._set_health(False)
        port = bind_grpc(self.grpc_server, config, shared=shared)
        self.port = port
        if transport.http_port is not None:
            if not shared:
                claim_port("HTTP", transport.host, transport.http_port, "--http-port")
            tls = tls_context(transport.tls_cert, transport.tls_key) if transport.tls_cert else None
            try:
                self.http_port = await self.http.start(transport.host, transport.http_port, tls, shared=shared)
            except OSError as exc:
                raise PortInUse("HTTP", transport.host, transport.http_port, "--http-port", exc.strerror) from None
        return port

    def bind_metrics(self) -> None:
        """Listen on the metrics port (when there is one), before any model loads: a port in use
        is a `PortInUse` at once, not a failure after the load."""
        transport = self.config.transport
        if transport.metrics_port is None or self._metrics_bound:
            return
        claim_port("metrics", transport.host, transport.metrics_port, "--metrics-port")
        try:
            self.metrics.serve(transport.metrics_port, transport.host)
        except OSError as exc:
            raise PortInUse("metrics", transport.host, transport.metrics_port, "--metrics-port", exc.strerror) from None
        self._metrics_bound = True

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SEARCH_SERVICE):
            await self.health.set(service, status)

    async def reload(
        self, version: str | None = None, model_dir: str | None = None, unless_live: bool = False
    ) -> tuple[ServingPair | None, ServingPair]:
        """Load a pair off the loop and swap it in; on failure the old pair keeps serving.
        `unless_live`: nothing to do when `version` is live by the time the lock is taken, or an
        ancestor of the live one — the CURRENT watcher's reload, a write's own and a sibling
        worker's relayed one, each of which may find another's done, or a later version's (two
        workers' writes published back to back: loading the earlier after the later went back
        a version and cleared the monitor's figures). A `Reload` call loads what it names."""
        async with self._reload_lock:
            engine = self.engine
            if unless_live and engine.loaded and model_dir is None and _holds(engine.pair, version):
                return engine.pair, engine.pair
            what = f"loading index {version}" if version else "loading the index CURRENT names"

            def progress(step: str) -> None:  # until a pair is live, UNAVAILABLE says why
                engine.loading = f"{what}: {step}"

            engine.loading = what
            previous = engine.pair if engine.loaded else None
            load = functools.partial(self._load, version, model_dir, previous, progress)
            try:  # loading takes seconds: the loop keeps answering queries meanwhile
                new = await asyncio.get_running_loop().run_in_executor(None, load)
            except Exception:
                self.metrics.reload_failures.inc()
                raise
            finally:
                engine.loading = None
            # Under a stream of ingests the monitor keeps what it measured: a version grown from
            # the live one by changes alone is still described by its figures.
            grown = previous is not None and await asyncio.get_running_loop().run_in_executor(
                None, grew_from, self.config.index_root, previous.manifest, new.manifest
            )
            old = self.engine.swap(new)
        self.metrics.reloads.inc()
        self.metrics.set_live(new.version, new.index_id, new.model_id, new.manifest.factory, new.index_version.size)
        self.metrics.set_build_figures(new.manifest)
        self.monitor.reset(new, grown)
        await self._set_health(True)
        log.info(
            "serving index %s with model %s (%d items)",
            new.version,
            new.model_id,
            new.index_version.size,
            extra={"index_version": new.version, "model_id": new.model_id},
        )
        # probe_interval_s 0: probes are off; a grown version keeps the last round's figures until the next
        if old is not None and not grown and self.monitor.config.probes:
            threading.Thread(target=self._probe_now, name="probe-after-reload", daemon=True).start()
        if old is not None:  # its memory goes back to the OS once the requests that took it finish
            released = weakref.ref(old)
            threading.Thread(target=reclaim, args=(released, 60.0, self._stopping), name="reclaim", daemon=True).start()
        return old, new

    async def reload_server(
        self, version: str | None = None, model_dir: str | None = None, unless_live: bool = False
    ) -> tuple[ServingPair | None, ServingPair]:
        """`reload` here, then in every sibling worker (`serve --processes N`) before it returns:
        the version this worker loaded, by name (CURRENT may move meanwhile)."""
        old, new = await self.reload(version, model_dir, unless_live)
        if self.siblings is not None:
            await self.siblings.reload(new.version, model_dir, fresh=not unless_live)
        return old, new

    async def rollback(
        self, version: str, model_dir: str | None, who: str, via: str, restore: bool, make_current: bool
    ) -> tuple[RollbackReport, ServingPair | None, ServingPair]:
        """Serve `version` again without republishing what was taken down since it was built
        (`index.changes.lifecycle.rollback`: re-applied as a new version, or restored when asked), then
        load what it left live. One at a time with takedowns, off the loop."""
        async with self.writes.lock:
            roll = functools.partial(
                rollback,
                self.config.index_root,
                version,
                who,
                via,
                restore,
                keep=self.config.keep_versions,
                make_current=make_current,
            )
            try:
                report = await asyncio.get_running_loop().run_in_executor(None, roll)
            except Exception:  # a version that is not there, say: a reload that failed
                self.metrics.reload_failures.inc()
                raise
            self.metrics.items_removed.inc(len(report.reapplied))
            old, new = await self.reload_server(report.version, model_dir)
            return report, old, new

    def run_probe(self) -> dict[int, float] | None:
        """One probe round's Recall@K (None with nothing to score) — and, where the live version
        has items, its item Recall@K, recorded as source probe_items; blocks: call it from
        another thread than the loop (the monitor's, a test's)."""
        figures = self.prober.run(self._loop)
        self.prober.item_round(self._loop)
        return figures

    def probe_changes(self) -> dict[int, float] | None:
        """The probe's last round brought up to a live version grown from its own
        (`ProbeRunner.changes_round`); blocks, as `run_probe` does."""
        return self.prober.changes_round(self._loop)

    def _probe_now(self) -> None:
        try:
            self.monitor.run_probe(self.run_probe)
        except Exception:
            log.exception("probe after reload failed")

    async def _watch_current(self) -> None:
        """Reload whenever CURRENT comes to name a version other than the live one — a change of
        CURRENT, not any difference: a Reload naming another version stays until CURRENT moves."""
        loop = asyncio.get_running_loop()
        seen = None  # what CURRENT named at the last look
        while True:
            await asyncio.sleep(self.config.watch_interval_s)
            target = await loop.run_in_executor(None, artifacts.current_version, self.config.index_root)
            live = self.engine.pair.version if self.engine.loaded else None
            moved = target != seen or live is None  # nothing loaded yet: CURRENT is what to load
            seen = target
            if target is None or not moved or target == live or target == self._watched_failure:
                continue
            try:
                await self.reload(target, unless_live=True)
                self._watched_failure = None
            except Exception as exc:
                self._watched_failure = target  # retried only once CURRENT names something else
                log.error("CURRENT names %s but it cannot be loaded: %s", target, exc)

    async def start(self) -> None:
        """Load the live pair (or start without one, unhealthy), then serve."""
        if self.grpc_server is None:
            await self.bind()
        self.bind_metrics()  # every port claimed before the seconds a model takes to load
        # gRPC answers while the model loads — health NOT_SERVING, a call UNAVAILABLE saying
        # what the load is doing — as HTTP does, rather than refusing connections meanwhile.
        self.batcher.start()
        await self.grpc_server.start()
        try:
            await self.reload()
        except (ArtifactError, FileNotFoundError) as exc:
            waiting = "; waiting for CURRENT to name a version (--watch-current)" if self.config.watch_current else ""
            log.warning("starting without a loaded index: %s%s", exc, waiting)
        transport = self.config.transport
        self.monitor.start(self.run_probe, self.probe_changes)  # probe rounds only where probe_interval_s > 0
        if self.config.watch_current:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_current(), name="watch-current")
        searching = f"; {SearchThreads.described()}" if SearchThreads.count else ""
        log.info("listening on %s:%d%s", transport.host, self.port, searching)
        if self.http_port is not None:
            log.info(
                "HTTP API and console on http%s://%s:%d/",
                "s" if transport.tls_cert else "",
                transport.host,
                self.http_port,
            )

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop taking RPCs, let in-flight ones finish (up to `grace` seconds), then stop workers."""
        self._stopping.set()
        # First: a probe round the batcher's stop fails below must read as the stop, not as an error.
        self.monitor.stop()
        if self._watcher is not None:
            self._watcher.cancel()
        self.writes.cancel()
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.grpc_server.stop(grace), self.http.stop(grace))
        await self.batcher.stop()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        self.recorder.history.stop()
        if self.siblings is not None:
            await self.siblings.close()


def _holds(pair: ServingPair, version: str | None) -> bool:
    """Whether `pair` serves `version` or a version descended from it by changes."""
    return version is not None and (pair.version == version or version in (pair.manifest.ancestors or ()))


# SIGTERM's drain: in-flight calls get SHUTDOWN_GRACE_S to finish, and the process is gone
# SHUTDOWN_DEADLINE_S after the signal whatever is still running — a batch in an inference
# thread, a load or an ingest in the loop's executor, which the interpreter's exit would
# otherwise wait for (a SIGTERM on a loaded machine once took 113 s).
SHUTDOWN_GRACE_S = 10.0
SHUTDOWN_DEADLINE_S = 15.0


def exit_by(deadline_s: float) -> threading.Thread:
    """A daemon thread that ends the process (status 0: it was asked to stop) `deadline_s` from
    now if it is still alive, logging what it cut short."""

    def cut() -> None:
        time.sleep(deadline_s)
        busy = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        log.warning("stop took past its %.0f s deadline: exiting with %s still running", deadline_s, busy or "nothing")
        logging.shutdown()  # flush the handlers: os._exit skips them
        os._exit(0)

    thread = threading.Thread(target=cut, name="exit-deadline", daemon=True)
    thread.start()
    return thread


async def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain: in-flight calls get SHUTDOWN_GRACE_S to
    finish, and the process exits within SHUTDOWN_DEADLINE_S of the signal. Prints the ports,
    one JSON line, once listening."""
    stopped = asyncio.Event()

    def shutdown(signum: int) -> None:  # drain in-flight requests, then exit
        if stopped.is_set():
            return
        log.info("signal %d: draining and stopping", signum)
        stopped.set()
        exit_by(SHUTDOWN_DEADLINE_S)  # armed first: what follows, and the interpreter's exit, are bounded by it

    # Before the start, not after: a signal that arrives as the server starts (a supervisor
    # stopping its workers, an orchestrator's rollout) drains it rather than killing it.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, shutdown, signum)
    slot = worker_slot()
    threads = config.runtime.search_threads_of(slot[1] if slot else 1)
    SearchThreads.set(threads)  # this loop's thread, where lone searches run
    loop.set_default_executor(ThreadPoolExecutor(None, "default", SearchThreads.apply))
    app = SearchApp(config)
    await app.start()
    print(
        json.dumps({"port": app.port, "metrics_port": config.transport.metrics_port, "http_port": app.http_port}),
        flush=True,
    )
    await stopped.wait()
    try:
        async with asyncio.timeout(SHUTDOWN_DEADLINE_S):
            await app.stop(grace=SHUTDOWN_GRACE_S)
    except TimeoutError:
        log.warning("stop took past its %.0f s deadline: exiting", SHUTDOWN_DEADLINE_S)


def run(config: ServerConfig) -> None:
    """`asyncio.run(serve(config))` on the loop `config.runtime.event_loop` names."""
    with asyncio.Runner(loop_factory=functools.partial(loop_factory, config.runtime.event_loop)) as runner:
        runner.run(serve(config))
