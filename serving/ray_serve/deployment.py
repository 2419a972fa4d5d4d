"""`python -m serving serve --ray`: one Ray Serve application serving an index version's shards.

- `shard-000`, `shard-001`, …: one deployment per shard of the live version (`--shard-replicas`
  each), a replica holding its shard of the versions it was asked for, memory-mapped
  (`serving.shards.sharded.ShardSearcher`), answering global rows, scores and each hit's id, label,
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
import socket
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from core import artifacts
from core.artifacts import ArtifactError
from core.index_manifest import check_model_index_pair
from core.model_manifests import ModelManifest, TextModelManifest
from core.preprocess import DEFAULT_MAX_PIXELS, EncodedImage, pixels_of
from core.text import TOKENIZER_FILE, TextTokenizer
from index.versions.version import IndexVersion, ItemLocation, SampledItem
from serving.config import ServerConfig
from serving.errors import Unavailable, image_error
from serving.logs import Sink, one_line, relay, shard_label, ship_records
from serving.memory import arena_environment
from serving.monitoring.metrics import ServiceMetrics
from serving.ray_serve.replicas import EMBEDDER, EmbedderReplica, EmbedderSettings, ShardReplica, shard_deployment
from serving.search.engine import SearchEngine, ServingPair, UndecodedImages, text_model_dir
from serving.shards.sharded import ShardAnswer, ShardedSearch, ShardRequest, failure_reason

log = logging.getLogger(__name__)

APP = "simsearch"
INGRESS = "ingress"


# -- what the ingress holds of a version -------------------------------------------------------


class IngressVersion(IndexVersion):
    """A version as the ingress holds it: its manifest and no row — no items, filters,
    tombstones, vectors or faiss index (each raises, so a read left on the ingress's path fails
    rather than loading every shard's rows here). The shards answer for their rows: hits named
    (`ShardAnswer`), exclusions resolved, an item located (`locate`: the shard its id places it
    in where ids are the shard key, else every shard at once), the probe's sample gathered
    (`probe_sample`); whether the rows are labelled, each shard says when it opens the version."""

    holds_rows = False

    def __init__(self, directory: str | Path, shards: RayShards | None = None) -> None:
        super().__init__(directory)
        self._reach = shards
        self._labelled: bool | None = None  # its shards' rows', as they say when they open it

    @property
    def labelled(self) -> bool:
        if self._labelled is None:
            raise RuntimeError(f"version {self.name} is not open on its shards yet")
        return self._labelled

    def warmed(self, held: dict) -> None:
        """A shard replica's `warm` answer for this version: its rows labelled or not."""
        self._labelled = bool(held["labelled"]) and self._labelled is not False

    def probe_sample(self, size: int, item_field: str | None = None) -> list[SampledItem]:
        """Every shard's part of the sample merged by key: the whole version's sample (rows are
        placed by item, so an item's rows, and its size, are all in one shard)."""
        if self._reach is None:
            raise RuntimeError("this ingress version reaches no shards")
        parts = self._reach.gathered("probe_sample", self.name, (size, item_field))
        return sorted((s for part in parts for s in part), key=lambda s: (s.key, s.row))[:size]

    @property
    def vectors(self) -> np.ndarray:  # type: ignore[override]
        raise _no_rows("vectors")

    @property
    def index(self):  # type: ignore[override]
        raise _no_rows("faiss index")

    @property
    def items(self):  # type: ignore[override]
        raise _no_rows("items")

    @property
    def filters(self):  # type: ignore[override]
        raise _no_rows("filters")

    @property
    def deleted(self) -> np.ndarray:  # type: ignore[override]
        raise _no_rows("tombstones")

    @property
    def live_mask(self):  # type: ignore[override]
        raise _no_rows("tombstones")

    def groups(self, name: str):  # type: ignore[override]
        raise _no_rows(f"groups of {name!r}")

    def row_of(self, item_id: str) -> int | None:
        raise _no_rows("id lookup")

    def locate(self, item_id: str, field: str | None = None) -> ItemLocation | None:
        if self._reach is None:
            raise RuntimeError("this ingress version reaches no shards")
        return self._reach.locate(self.name, item_id, field, self.units_for_id(item_id))

    def check(self) -> IngressVersion:
        """Its manifest's shards are there and their counts add up (each shard's files are
        checked where they load, in the shard replicas)."""
        if self.shard_names:
            self.check_shard_list()
        return self


def _no_rows(what: str) -> RuntimeError:
    return RuntimeError(f"the ingress of a sharded server holds no {what}: its shards answer for their rows")


class RemoteEmbedder:
    """The model as the ingress sees it: its input contract and ids from its manifest, its
    embeddings from the embedder deployment (`QueryEmbedder.embed`'s contract).

    A query's image crosses as its request sent it (`EncodedImage`), decoded on the embedder:
    the ingress, one process for every caller, spent most of an image query's cost decoding
    it and sending its pixels (docs/benchmarks.md, "Sharded versions"). A batch of model inputs
    (the probe's, a catalog's) crosses as the uint8 pixels it was made from (a quarter of its
    float bytes). Either goes in calls of at most `message_bytes` sent at once: Serve's
    inter-deployment gRPC refuses a message over its limit (4 MiB by default; 32 float images
    of 224 px are 18 MB). A row larger than a message alone goes through the object store."""

    takes_encoded_images = True

    def __init__(
        self,
        handle: Any,
        model_dir: str | Path,
        timeout_s: float,
        providers: list[str],
        message_bytes: int | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.handle = handle
        self._embed = _direct(handle, "embed")
        self._by_reference = handle.options(method_name="embed")
        self._embed_images = _direct(handle, "embed_images")
        self._images_by_reference = handle.options(method_name="embed_images")
        self.max_image_pixels = max_image_pixels
        self.model_dir = Path(model_dir)
        manifest = ModelManifest.read(self.model_dir)
        self.contract = manifest.input
        self.model_id = manifest.model_id
        self.dim = manifest.embedding_dim
        self.timeout_s = timeout_s
        self.message_bytes = message_bytes or call_bytes()
        self.session = _Providers(providers)

    def embed(self, batch: np.ndarray, side_by_side: bool = False) -> np.ndarray:
        pixels = pixels_of(batch, self.contract)
        payload = batch if pixels is None else pixels
        if not len(payload):
            return np.empty((0, self.dim), dtype=np.float32)
        row_bytes = payload[0].nbytes
        send = self._embed if row_bytes <= self.message_bytes else self._by_reference
        calls = max(1, -(-len(payload) * row_bytes // self.message_bytes))
        parts = np.array_split(payload, min(calls, len(payload)))
        deadline = time.monotonic() + self.timeout_s
        pending = [send.remote(str(self.model_dir), part, side_by_side) for part in parts]
        return np.concatenate([p.result(timeout_s=max(0.0, deadline - time.monotonic())) for p in pending])

    def embed_encoded(self, images: Sequence[EncodedImage], side_by_side: bool = False) -> np.ndarray:
        """Embeddings of encoded images, decoded on the embedder; UndecodedImages names those
        that did not decode there, with the error `serve` gives each."""
        deadline = time.monotonic() + self.timeout_s
        pending = []
        for part in _parts_within(images, self.message_bytes):
            fits = sum(len(image.data) for image in part) <= self.message_bytes
            send = self._embed_images if fits else self._images_by_reference
            pending.append(send.remote(str(self.model_dir), part, self.max_image_pixels, side_by_side))
        answers = [p.result(timeout_s=max(0.0, deadline - time.monotonic())) for p in pending]
        vectors = np.concatenate([vectors for vectors, _ in answers])
        failed, start = {}, 0
        for part_vectors, errors in answers:
            failed.update({start + i: image_error(error) for i, error in errors.items()})
            start += len(part_vectors)
        if failed:
            raise UndecodedImages(vectors, failed)
        return vectors


def _parts_within(images: Sequence[EncodedImage], most_bytes: int) -> list[list[EncodedImage]]:
    """`images` in order, in runs of at most `most_bytes` of image data (an image larger alone is
    a run of its own)."""
    parts: list[list[EncodedImage]] = []
    size = most_bytes
    for image in images:
        if size + len(image.data) > most_bytes:
            parts.append([])
            size = 0
        parts[-1].append(image)
        size += len(image.data)
    return parts


class RemoteTextEncoder:
    """The text model as the ingress sees it: its tokenizer here (a query's text is checked where
    it arrives), its embeddings from the embedder deployment's session of it (token ids cross,
    a few hundred bytes a text)."""

    def __init__(self, handle: Any, text_dir: str | Path, timeout_s: float) -> None:
        self.text_dir = Path(text_dir)
        manifest = TextModelManifest.read(self.text_dir)
        self.text_model_id = manifest.text_model_id
        self.tokenizer = TextTokenizer(self.text_dir / TOKENIZER_FILE, manifest.context_length)
        self._embed = _direct(handle, "embed_text")
        self.timeout_s = timeout_s

    def embed_ids(self, ids: np.ndarray) -> np.ndarray:
        return self._embed.remote(str(self.text_dir), ids).result(timeout_s=self.timeout_s)


def call_bytes() -> int:
    """The most bytes of array one call to another deployment carries: three quarters of Serve's
    inter-deployment message limit (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH, 4 MiB by default),
    the rest left to the call's other arguments and its envelope."""
    limit = int(os.environ.get("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH") or 4 * 1024 * 1024)
    return max(1, limit * 3 // 4)


class _Providers:
    """What GetInfo asks of a session: the providers it runs on (the embedder replica's)."""

    def __init__(self, providers: list[str]) -> None:
        self._providers = providers

    def get_providers(self) -> list[str]:
        return list(self._providers)


class ShardedEngine(SearchEngine):
    """The one-index engine with its search a fan-out to the shards (`ShardedSearch`)."""

    def __init__(self, limits, sharded: ShardedSearch) -> None:
        super().__init__(limits)
        self.sharded = sharded

    def search(self, pair, vectors, k, exclude, scopes=None, ks=None, deadline=None):  # type: ignore[override]
        return self.sharded.search(pair, vectors, k, exclude, scopes, ks, deadline)


FINAL: tuple[type[Exception], ...] = (ArtifactError, ValueError)  # a shard call's failures no retry mends


class RayShards:
    """The shard deployments through their handles: every shard asked at once; a call that
    fails or misses `timeout_s` is sent again (Ray Serve picks a live replica) up to `retries`
    times, then answered by its exception. The whole fan-out keeps one deadline — the caller's,
    or the budget of `timeout_s` × (`retries` + 1) from its start, whichever comes first — past
    which a shard still unanswered is answered by a `ShardDeadline`."""

    def __init__(self, handles: list[Any], timeout_s: float, retries: int, metrics: ServiceMetrics | None) -> None:
        self.handles = handles
        self.names = [shard_label(n) for n in range(len(handles))]
        self.timeout_s = timeout_s
        self.retries = retries
        self.metrics = metrics
        self._calls: dict[tuple[str, bool], list[Any]] = {}  # by method, and answer in the reply or not
        self.hit_bytes: dict[str, int] = {}  # by version: the most bytes a hit of it takes (`warm`)
        self.reply_bytes = call_bytes()

    @property
    def budget_s(self) -> float:
        return self.timeout_s * (self.retries + 1)

    def call(
        self, method: str, version: str, request: ShardRequest, deadline: float | None = None
    ) -> list[ShardAnswer | Exception]:
        return self._tried(method, version, request, range(len(self.handles)), deadline)

    def locate(self, version: str, item_id: str, field: str | None, numbers: Sequence[int]) -> ItemLocation | None:
        """Item `item_id` of `version` as the shards of `numbers` hold it (`ShardSearcher.locate`;
        asked at once, each tried again on failure as every shard call is, within the budget): the
        one that holds it live — ids are unique among live rows —, or None when none does. The
        ingress maps no vectors file. The calls run on a thread of their own, so they may be made
        from the ingress's event loop (Serve refuses a sync call there); the loop waits for them
        as it waits for a page of a memory map in `serve`. UNAVAILABLE when no shard that
        answered holds it and one did not answer."""
        answers = _OFF_LOOP.submit(self._tried, "locate", version, (item_id, field), numbers).result()
        found = [a for a in answers if isinstance(a, ItemLocation)]
        if found:
            return min(found, key=lambda located: located.row)
        for number, answer in zip(numbers, answers, strict=True):
            if isinstance(answer, FINAL):
                raise answer
            if isinstance(answer, Exception):
                reason = failure_reason(answer)
                raise Unavailable(f"shard {self.names[number]} did not answer for item {item_id!r}: {reason}")
        return None

    def _tried(
        self,
        method: str,
        version: str,
        argument: Any,
        numbers: Sequence[int],
        deadline: float | None = None,
        final: tuple[type[Exception], ...] = FINAL,
    ) -> list[Any]:
        """`method(version, argument)` of each shard of `numbers`, asked at once: a call that fails
        or misses `timeout_s` is sent again up to `retries` times, one of a `final` type (the
        version is bad: no other replica helps) never; each shard's answer, or the exception it
        ended with (a `ShardDeadline` past the deadline), in the order of `numbers`."""
        started = time.monotonic()
        budget = started + self.budget_s
        end = budget if deadline is None else min(deadline, budget)
        answers: dict[int, Any] = {}
        pending = {n: (self._send(n, method, version, argument), started, 0) for n in numbers}
        while pending:  # each pass waits on every shard in turn: a retry runs beside the others' waits
            for number, (response, sent, tries) in list(pending.items()):
                now = time.monotonic()
                try:
                    answers[number] = response.result(timeout_s=max(0.0, min(sent + self.timeout_s, end) - now))
                    if self.metrics is not None:
                        self.metrics.shard_latency.labels(self.names[number], method).observe(time.monotonic() - sent)
                    del pending[number]
                    continue
                except Exception as exc:  # noqa: BLE001 - a dead replica, a timeout, the shard's own error
                    failure = exc
                if isinstance(failure, final):
                    answers[number] = failure
                    del pending[number]
                    continue
                if self.metrics is not None:
                    self.metrics.shard_failures.labels(self.names[number]).inc()
                with contextlib.suppress(BaseException):
                    response.cancel()
                now = time.monotonic()
                if now >= end:
                    answers[number] = ShardDeadline(now - started, caller=end < budget)
                elif tries >= self.retries:
                    answers[number] = failure
                else:
                    log.warning(
                        "shard %s: %s failed (%s); trying again",
                        self.names[number],
                        method,
                        failure_reason(failure),
                        extra={"shard": self.names[number], "index_version": version},
                    )
                    pending[number] = (self._send(number, method, version, argument), now, tries + 1)
                    continue
                del pending[number]
        return [answers[n] for n in numbers]

    def _send(self, number: int, method: str, version: str, argument: Any) -> Any:
        """A shard call, its answer in the reply — or through the object store where the answer
        may pass Serve's message limit (a batch of large k, rows with long metadata): the most
        hits it can hold times the version's most bytes a hit."""
        direct = not (
            isinstance(argument, ShardRequest)
            and argument.most_hits() * self.hit_bytes.get(version, 0) > self.reply_bytes
        )
        calls = self._calls.get((method, direct))
        if calls is None:
            made = [_direct(h, method) if direct else h.options(method_name=method) for h in self.handles]
            calls = self._calls[(method, direct)] = made
        return calls[number].remote(version, argument)

    def gathered(self, method: str, version: str, argument: Any) -> list[Any]:
        """`method(version, argument)` of every shard (each tried again as every shard call is,
        from a thread of its own: it may be called from the ingress's loop); UNAVAILABLE naming a
        shard that did not answer."""
        answers = _OFF_LOOP.submit(self._tried, method, version, argument, range(len(self.handles))).result()
        for name, answer in zip(self.names, answers, strict=True):
            if isinstance(answer, Exception):
                raise Unavailable(f"shard {name} did not answer {method}: {failure_reason(answer)}")
        return answers

    def warmed(self, version: str, held: dict) -> None:
        """A replica's `warm` answer for `version`: its hits' size bounds the version's calls."""
        self.hit_bytes[version] = max(self.hit_bytes.get(version, 0), int(held["hit_bytes"]))
        while len(self.hit_bytes) > 8:  # the versions recently served
            self.hit_bytes.pop(next(iter(self.hit_bytes)))


_OFF_LOOP = ThreadPoolExecutor(4, thread_name_prefix="shard-call")


class ShardDeadline(TimeoutError):
    """A shard that had not answered when the call's deadline came."""

    def __init__(self, waited_s: float, caller: bool) -> None:
        whose = "the caller's deadline" if caller else "the shard budget (--shard-timeout-s × (--shard-retries + 1))"
        super().__init__(f"no answer within {waited_s:.1f} s, {whose}")


def _direct(handle: Any, method: str) -> Any:
    """`handle`'s `method` called over Serve's inter-deployment gRPC (`_by_reference=False`)
    rather than as a Ray actor task: the answer comes back in the reply, not through the
    object store — at a batch a call, the hop's cost (docs/benchmarks.md, "Sharded versions").
    A Serve without that option (before its inter-deployment gRPC) gets actor tasks."""
    try:
        return handle.options(method_name=method, _by_reference=False)
    except TypeError:
        return handle.options(method_name=method)


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
        from serving.server import SearchApp, loop_factory

        ship_records(log_sink, INGRESS, logging.INFO)  # what `serve` writes: loads, reloads, the access log
        self.config = config
        self._first = first  # the version the command read and deployed: the first load's
        self.embedder = embedder
        self.shards = shards
        metrics = ServiceMetrics()
        sharding = config.sharding
        self.sharded = ShardedSearch(
            RayShards(shards, sharding.shard_timeout_s, sharding.shard_retries, metrics), self._observe
        )
        self.metrics = metrics
        self.app = SearchApp(config, ShardedEngine(config.limits, self.sharded), self._load, metrics)
        self.app.monitor.exact_top = self.sharded.exact_top
        self.loop = loop_factory(config.runtime.event_loop)
        threading.Thread(target=self.loop.run_forever, name="ingress-loop", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.app.bind(), self.loop).result()
        self.app.bind_metrics()
        self._started = asyncio.run_coroutine_threadsafe(self.app.start(), self.loop)

    def _observe(self, answer: ShardAnswer) -> None:
        self.metrics.shard_search.labels(answer.shard).observe(answer.search_s)
        self.metrics.shard_rows.labels(answer.shard).set(answer.rows_held)
        self.metrics.shard_memory.labels(answer.shard).set(answer.memory_bytes)

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
    shard_apps = [
        serve.deployment(ShardReplica)
        .options(
            name=shard_deployment(n),
            num_replicas=config.sharding.shard_replicas,
            ray_actor_options=cpus,
            max_ongoing_requests=64,
            health_check_period_s=2.0,
        )
        .bind(config.index_root, n, log_sink)
        for n in range(len(version.units()))
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


def _local_ray(address: str) -> bool:
    """Whether RAY_ADDRESS names this machine's Ray (or none): the ingress then listens here. An
    address is this machine's when a socket can bind it."""
    if address in ("", "auto", "local"):
        return True
    host = address.split("://", 1)[-1].rpartition(":")[0] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def check_ports(config: ServerConfig) -> None:
    """Every port the ingress will listen on, claimed here first when it will listen on this
    machine: one `error:` line naming the port before anything is deployed (Serve's own failure,
    after half a minute of retries, names the deployment, not the port)."""
    from serving.server import claim_port

    if not _local_ray(os.environ.get("RAY_ADDRESS", "")):
        return
    transport = config.transport
    for what, port, flag in (
        ("gRPC", transport.port, "--port"),
        ("HTTP", transport.http_port, "--http-port"),
        ("metrics", transport.metrics_port, "--metrics-port"),
    ):
        if port is not None:
            claim_port(what, transport.host, port, flag)


# Ray's own settings for a cluster that serves, given to a local one this command starts (an
# operator sets them on the head of theirs: docs/operations.md, deploy/k8s/rayservice-serving.yaml).
# - Ray starts its workers at nice 15, for batch work beside interactive use; here the workers
#   are the server (its shards, embedder and ingress), so they run as one would.
# - The GCS keeps the events of the last 100,000 tasks by default, for `ray list tasks`. Serve's
#   own calls (the controller's health checks and long polls, ~9 a second at S = 4) fill it at
#   ~2 kB an event: the GCS grew +1.2 MB/min and would have for ~3 hours, ~200 MB, before
#   levelling. A serving cluster keeps the last 1,000, reached in its first minutes.
SERVING_CLUSTER_ENV = {"RAY_worker_niceness": "0", "RAY_task_events_max_num_task_in_gcs": "1000"}


def connect_ray() -> None:
    """Join the cluster at RAY_ADDRESS, or start a local Ray: an address that does not answer is
    a ValueError (one `error:` line), not a minute of retries."""
    from core.cli import init_ray, verbose

    address = os.environ.get("RAY_ADDRESS", "")
    if address and address not in ("auto", "local") and "://" not in address:
        host, colon, port = address.rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"RAY_ADDRESS={address} is not host:port (a Ray head's GCS address, such as 10.0.0.5:6379), "
                "auto, or ray://host:port"
            )
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
                pass
        except OSError as exc:
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {exc}") from None
    _cluster_errors_as_records()
    if not address:
        for name, value in SERVING_CLUSTER_ENV.items():  # the user's own setting wins
            os.environ.setdefault(name, value)
    with _core_warnings_held() as held:
        try:
            # Ray's "Connecting to existing Ray cluster" and Serve's progress lines are INFO: the
            # command's own output is its ports (or one error line), so they show with --verbose only.
            init_ray(log_to_driver=False, logging_level=logging.INFO if verbose() else logging.WARNING)
        except ConnectionError as exc:
            if "InvalidAuthToken" in held.text():
                raise ValueError(
                    f"the Ray cluster at RAY_ADDRESS={address} refused this process's token (InvalidAuthToken): "
                    "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, or start the cluster "
                    "with RAY_AUTH_MODE=disabled"
                ) from None
            reason = failure_reason(exc, typed=False, first=True)
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {reason}") from None
    _ray_lines_as_ours()


def _ray_lines_as_ours() -> None:
    """Ray's and Serve's lines in this command's log format, not their own, and their INFO lines
    with --verbose only. Serve configures its logger as it is imported: imported here first."""
    import ray.serve  # noqa: F401 - its logger configured, then made ours

    from core.cli import verbose

    for name in ("ray", "ray.serve"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
        if not verbose():  # Serve's logger has a level of its own, not the "ray" logger's
            logger.setLevel(logging.WARNING)


def _cluster_errors_as_records() -> None:
    """The errors the cluster publishes to its drivers (a worker that died or was killed, with its
    ids and likely causes; a task that failed and is retried) as records of the `ray.raylet`
    logger, one line each in this command's format. Ray's driver prints them to stdout, a
    coloured paragraph each, whatever `log_to_driver` says: its error listener
    (`ray._private.worker.listen_error_messages`) calls the module's `print_to_stdstream`, which
    Ray 2.60 has no option for, so that function is replaced here — this command's stdout is its
    ports line alone. Other output (workers' own lines, which `log_to_driver=False` keeps off)
    goes to Ray's function as before."""
    from ray._private import worker

    printed = worker.print_to_stdstream
    if getattr(printed, "as_records", False):
        return

    def as_records(data: dict, ignore_prefix: bool) -> None:
        source = data.get("pid")
        if source not in ("raylet", "autoscaler"):
            printed(data, ignore_prefix)
            return
        for message in data.get("lines") or ():
            if text := one_line(str(message)):
                logging.getLogger(f"ray.{source}").warning("%s", text)

    as_records.as_records = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = as_records


class _core_warnings_held:
    """Ray's core (C++) writes a warning to file descriptor 2 for every failed try to reach a
    cluster, a score of lines before the Python error: held here while Ray starts or joins, and
    written out after only when it started (a refusal is then said in one line, naming why)."""

    def __enter__(self) -> _core_warnings_held:
        import tempfile

        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def text(self) -> str:
        self._file.seek(0)
        return self._file.read().decode(errors="replace")

    def __exit__(self, kind: object, *_: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if kind is None:
            sys.stderr.write(self.text())
        self._file.close()


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
            serve.shutdown()
        ray.shutdown()
