"""`python -m serving serve --ray`: one Ray Serve application serving an index version's shards.

- `shard-000`, `shard-001`, …: one deployment per shard of the live version (`--shard-replicas`
  each), a replica holding its shard of the versions it was asked for, memory-mapped
  (`serving.shards.searcher.ShardSearcher`), answering global rows, scores and each hit's id, label,
  metadata and group value — never vectors;
- `embedder`: the model's ONNX Runtime sessions (`QueryEmbedder`), so embedding scales apart
  from search;
- `ingress`: the same server as `serve` — gRPC service, HTTP routes, console, metrics, on the
  configured ports, through the same service layer (`SearchApp`, on an event loop of its own in
  the replica) — with only its engine's search a fan-out to the shards and an exact merge
  (`ShardedSearch`), and its embedding the embedder's. It holds no row of the version
  (`IngressVersion`: the manifest only): its answers come whole from the shards' hits, and what
  needs rows — an id's row, a filter's mask, a grouped query's groups, the probe's sample — is
  done on the shards.

A reload (Reload, make-live, a takedown, --watch-current) opens the new version on every
replica of every shard deployment before the ingress swaps it in, and each shard call names
its version: an answer never mixes versions. A version with another shard count than the one
deployed is refused (redeploy: run `serve --ray` again). A shard call that fails or misses
`--shard-timeout-s` is tried again `--shard-retries` times (Ray Serve routes it to another
replica where there is one); then the shard is named missing, and the query fails UNAVAILABLE
unless it allowed a partial answer.

`app(args)` is the application builder a KubeRay RayService imports
(deploy/k8s/rayservice-serving.yaml); `run(config)` is the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import check_model_index_pair
from core.artifacts.layout import ArtifactError
from core.artifacts.model_manifests import ModelManifest
from index.versions.version import IndexVersion
from serving.config import ServerConfig
from serving.logs import Sink, failure_reason, relay, shard_label, ship_records
from serving.memory import arena_environment
from serving.ray_serve.cluster import check_ports, connect_ray, quiet_serve_shutdown
from serving.ray_serve.handles import RayShards, RemoteEmbedder, RemoteTextEncoder
from serving.ray_serve.ingress_version import IngressVersion
from serving.ray_serve.replicas import EMBEDDER, EmbedderReplica, EmbedderSettings, ShardReplica, shard_deployment
from serving.search.engine import ServingPair, text_model_dir
from serving.shards.fanout import ShardedEngine, ShardedSearch
from serving.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)

APP = "simsearch"
INGRESS = "ingress"


def _broadcast(handle: Any, method: str, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """`method(*args)` on every replica of a deployment (at least one): waits for a deployment
    still starting (the ingress's first load runs beside the other deployments' start)."""
    from ray.serve.exceptions import DeploymentUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            results = handle.broadcast(method, *args).results(timeout_s=timeout_s)
            if not results:
                results = [getattr(handle, method).remote(*args).result(timeout_s=timeout_s)]
            return results
        except DeploymentUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# -- the deployments -----------------------------------------------------------------------------


class IngressReplica:
    """The ingress: the server of `serve` (`SearchApp`) on an event loop of its own, its engine
    searching the shards, its loads opening each version on them first."""

    def __init__(
        self,
        config: ServerConfig,
        shards: list[Any],
        embedder: Any,
        first: str | None = None,
        log_sink: Sink | None = None,
    ) -> None:
        from serving.listen import loop_factory
        from serving.server import SearchApp

        ship_records(log_sink, INGRESS, logging.INFO)  # what `serve` writes: loads, reloads, the access log
        self.config = config
        self._first = first  # the version the command read and deployed: the first load's
        self.embedder = embedder
        self.shards = shards
        metrics = ServiceMetrics()
        sharding = config.sharding
        self.sharded = ShardedSearch(RayShards(shards, sharding.shard_timeout_s, sharding.shard_retries, metrics))
        self.metrics = metrics
        self.app = SearchApp(config, ShardedEngine(config.limits, self.sharded), self._load, metrics)
        self.app.monitor.exact_top = self.sharded.exact_top
        self.loop = loop_factory(config.runtime.event_loop)
        threading.Thread(target=self.loop.run_forever, name="ingress-loop", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.app.bind(), self.loop).result()
        self.app.bind_metrics()
        self._started = asyncio.run_coroutine_threadsafe(self.app.start(), self.loop)

    def _load(
        self, version: str | None = None, model_dir: str | None = None, previous: ServingPair | None = None,
        progress=None,
    ) -> ServingPair:  # fmt: skip
        """A version for the ingress: checked, its model's, opened on every replica of every
        shard deployment (refused naming the shard that cannot open it), then the embedder
        warmed — only then is it swapped in."""
        config = self.config
        version, self._first = version or self._first, None
        opened = IngressVersion(artifacts.version_dir(config.index_root, version), self.sharded.shards)
        count = len(opened.units())
        if count != len(self.shards):
            raise ArtifactError(
                f"version {opened.name} has {count} shard{'s' if count > 1 else ''}; this deployment serves "
                f"{len(self.shards)}: deploy it anew (serve --ray) to serve it"
            )
        model = Path(model_dir or config.model or opened.manifest.model_dir or "")
        if not (model / artifacts.MANIFEST).is_file():
            raise ArtifactError(f"model directory {model} has no {artifacts.MANIFEST}")
        model_manifest = ModelManifest.read(model)
        check_model_index_pair(model_manifest, opened.manifest)
        opened.check()
        for number, handle in enumerate(self.shards):
            if progress is not None:
                progress(f"opening shard {shard_label(number)} on its replicas")
            try:
                for held in _broadcast(handle, "warm", opened.name):
                    self.sharded.shards.warmed(opened.name, held)
                    opened.warmed(held)
                    self.metrics.shard_rows.labels(held["shard"]).set(held["rows"])
                    self.metrics.shard_memory.labels(held["shard"]).set(held["memory_bytes"])
            except Exception as exc:  # a replica's error arrives wrapped: its message names the shard
                raise ArtifactError(_cause(exc, shard_label(number), opened.name)) from None
        if previous is not None and previous.embedder.model_dir.resolve() == model.resolve():
            embedder = previous.embedder
        else:
            if progress is not None:
                progress("loading the model on the embedder")
            providers = _broadcast(self.embedder, "warm", str(model))[0]
            embedder = RemoteEmbedder(
                self.embedder, model, max(60.0, config.sharding.shard_timeout_s), providers,
                max_image_pixels=config.limits.max_image_pixels,
            )  # fmt: skip
        text = None
        text_dir = text_model_dir(opened.manifest, model_manifest)
        if text_dir is not None:
            kept = previous.text if previous is not None else None
            if isinstance(kept, RemoteTextEncoder) and kept.text_dir == text_dir:
                text = kept
            else:
                if progress is not None:
                    progress("loading the text model on the embedder")
                _broadcast(self.embedder, "warm_text", str(text_dir))
                text = RemoteTextEncoder(self.embedder, text_dir, max(60.0, config.sharding.shard_timeout_s))
        return ServingPair(embedder, None, opened, text)  # type: ignore[arg-type]  # the shards hold the index

    async def ports(self) -> dict:
        """The ports it serves on, once its first load is done (or failed: it then waits, unhealthy)."""
        await asyncio.wrap_future(self._started)
        metrics_port = self.config.transport.metrics_port
        return {"port": self.app.port, "metrics_port": metrics_port, "http_port": self.app.http_port}

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None and loop.is_running():
            with contextlib.suppress(BaseException):
                asyncio.run_coroutine_threadsafe(self.app.stop(grace=5.0), loop).result(10)


def _cause(exc: Exception, shard: str, version: str) -> str:
    """A replica's error as one line naming the shard (Ray wraps it in its own traceback)."""
    text = failure_reason(getattr(exc, "cause", None) or exc, typed=False).split("ArtifactError: ", 1)[-1]
    return text if f"shard {shard}" in text else f"shard {shard} of version {version}: {text}"


# -- the application -----------------------------------------------------------------------------


def build(config: ServerConfig, version: IndexVersion, log_sink: Sink | None = None) -> Any:
    """The Serve application for `version`: the ingress over its shard deployments and the
    embedder; the ingress loads `version` first (what was read is what is deployed). `log_sink`:
    where every replica ships its records (the command's `relay`), else they stay in Ray's logs."""
    from ray import serve

    # No cores asked: replicas share the machine's as threads do (a cluster sets resources).
    cpus = {"num_cpus": 0, "runtime_env": {"env_vars": arena_environment()}}
    units = len(version.units())
    search_threads = config.runtime.search_threads_of(units * config.sharding.shard_replicas)
    shard_apps = [
        serve.deployment(ShardReplica)
        .options(
            name=shard_deployment(n),
            num_replicas=config.sharding.shard_replicas,
            ray_actor_options=cpus,
            max_ongoing_requests=64,
            health_check_period_s=2.0,
        )
        .bind(config.index_root, n, log_sink, search_threads)
        for n in range(units)
    ]
    embedder = (
        serve.deployment(EmbedderReplica)
        .options(name=EMBEDDER, num_replicas=config.sharding.embedder_replicas, ray_actor_options=cpus)
        .bind(EmbedderSettings.of(config), log_sink)
    )
    ingress = serve.deployment(IngressReplica).options(name=INGRESS, num_replicas=1, ray_actor_options=cpus)
    return ingress.bind(config, shard_apps, embedder, version.name, log_sink)


def live_version(config: ServerConfig) -> IndexVersion:
    """The version CURRENT names, read once: its shards are the deployments. With
    --watch-current, an index root with none yet is waited on (as `serve` waits), saying so once."""
    said = False
    while True:
        version = IndexVersion.live(config.index_root)
        if version is not None:
            return version
        if not config.watch_current:
            raise ValueError(
                f"serve --ray needs a live version in {config.index_root} (its shards are the deployments); "
                "publish one (index build), or pass --watch-current to wait for one"
            )
        if not said:
            log.warning(
                "no live version in %s yet: waiting for CURRENT to name one (--watch-current)", config.index_root
            )
            said = True
        time.sleep(config.watch_interval_s)


def app(args: dict[str, Any]) -> Any:
    """The application builder a RayService imports (`serving.ray_serve.deployment:app`): `args` are the
    `serve` options by name (`index_root`, `port`, `shard_replicas`, ...)."""
    config = ServerConfig.flat(**{"ray": True, **args})
    return build(config, live_version(config))


def check_not_deployed() -> None:
    """One `serve --ray` a cluster: a second one would replace the first's application under it
    (Serve redeploys an application by name), so it is refused before anything is deployed."""
    from ray import serve

    found = serve.status().applications.get(APP)
    if found is not None and str(getattr(found.status, "value", found.status)) != "DELETING":
        where = os.environ.get("RAY_ADDRESS") or "this machine's Ray"
        state = str(getattr(found.status, "value", found.status)).lower()
        raise ValueError(
            f"Ray Serve application {APP!r} is already {state} on the cluster at {where}: another `serve --ray` "
            f"serves it; stop that one first (or, if nothing serves it, delete it: serve delete {APP})"
        )


def deploy(config: ServerConfig, version: IndexVersion, log_sink: Sink | None = None) -> dict:
    """Deploy the application for `version` on the Ray this process is connected to; its ports
    once it serves."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    handle = serve.run(build(config, version, log_sink), name=APP, route_prefix=None)
    return handle.ports.remote().result(timeout_s=600)


def run(config: ServerConfig) -> None:
    """`serve --ray`: deploy, print the ports (one JSON line), serve until SIGTERM or SIGINT, then
    delete the application. The inputs are checked and CURRENT read once: the shards printed are
    the shards deployed."""

    config.check_inputs()
    check_ports(config)
    version = live_version(config)
    connect_ray()
    check_not_deployed()  # before the try: a refused command must not delete the other's application
    from ray.util.queue import Queue

    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    # Every replica's records reach this command's own log stream, in its format: a failure's
    # trace is where the operator looks, not only in a worker's file under Ray's session folder.
    log_sink = Queue(maxsize=1000, actor_options={"num_cpus": 0})
    relaying = threading.Event()
    threading.Thread(target=relay, args=(log_sink, relaying), name="log-relay", daemon=True).start()
    try:
        ports = deploy(config, version, log_sink)
        print(json.dumps({**ports, "shards": len(version.units()), "version": version.name}), flush=True)
        stopped.wait()
    finally:
        relaying.set()
        cleanup = threading.Thread(target=_leave_cluster, name="leave-cluster", daemon=True)
        cleanup.start()
        cleanup.join(CLEANUP_S)
        if cleanup.is_alive():
            # A terminal's Ctrl-C (or a service manager's stop) signals the whole process group,
            # the local Ray this command started included: its GCS is gone, and Ray's core would
            # hold the process a minute and end it with status 1 (the server did stop as asked).
            log.warning("the Ray cluster stopped before the application was deleted: exiting without it")
            logging.shutdown()
            os._exit(0)


CLEANUP_S = 20.0  # the application's deletion and Ray's shutdown, at most


def _leave_cluster() -> None:
    """Delete the application; on a local Ray this command started, stop Serve and Ray too."""
    import ray
    from ray import serve

    log.info("deleting the Serve application")
    with contextlib.suppress(BaseException):
        serve.delete(APP)
    with contextlib.suppress(BaseException):
        if not os.environ.get("RAY_ADDRESS"):
            quiet_serve_shutdown()
            serve.shutdown()
        ray.shutdown()
