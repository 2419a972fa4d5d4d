"""What `serve --ray`'s ingress reaches over Serve's deployment handles: the model on the
embedder deployment (`RemoteEmbedder`, `RemoteTextEncoder`), and the shard deployments
(`RayShards`: the `ShardSet` that `serving.shards.fanout.ShardedSearch` asks), each shard call
tried again on failure within one deadline."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from core.artifacts.layout import ArtifactError
from core.artifacts.model_manifests import ModelManifest, TextModelManifest
from core.data.preprocess import DEFAULT_MAX_PIXELS, EncodedImage, pixels_of
from core.data.text import TOKENIZER_FILE, TextTokenizer
from index.versions.version import ItemLocation
from serving.errors import Unavailable, image_error
from serving.logs import failure_reason, shard_label
from serving.search.engine import UndecodedImages
from serving.shards.messages import ShardAnswer, ShardRequest
from serving.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)


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
        answers = self._tried(method, version, request, range(len(self.handles)), deadline)
        if self.metrics is not None:
            for answer in answers:
                if isinstance(answer, ShardAnswer):
                    self._observe(answer)
        return answers

    def _observe(self, answer: ShardAnswer) -> None:
        """A shard's answer in the server's per-shard metrics: its search's time, the rows and the
        memory its replica holds."""
        self.metrics.shard_search.labels(answer.shard).observe(answer.search_s)
        self.metrics.shard_rows.labels(answer.shard).set(answer.rows_held)
        self.metrics.shard_memory.labels(answer.shard).set(answer.memory_bytes)

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
