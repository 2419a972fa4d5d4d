"""The replicas of `serve --ray`'s shard and embedder deployments (`serving.ray_serve.deployment` deploys
them), in a module of their own: a replica process imports what its work needs and no more — a
shard replica faiss and its rows, never ONNX Runtime or the server's gRPC, HTTP and metrics
stack; an embedder replica ONNX Runtime, never faiss (docs/operations.md, memory a replica)."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from core.memory import pin_mmap_threshold
from serving.logs import Sink, shard_label, ship_records

T = TypeVar("T")

if TYPE_CHECKING:
    from core.data.preprocess import EncodedImage, ImageDecodeError
    from index.embedder import OnnxTextEmbedder
    from index.versions.version import ItemLocation, SampledItem
    from serving.config import ServerConfig
    from serving.search.query_embedder import QueryEmbedder
    from serving.shards.messages import ShardAnswer, ShardRequest
    from serving.shards.searcher import ShardSearcher

EMBEDDER = "embedder"


def shard_deployment(number: int) -> str:
    """A shard's deployment name ("shard-000", ...): its label (`shard_label`) as a deployment."""
    return f"shard-{shard_label(number)}"


class ShardReplica:
    """A shard deployment's replica: a `ShardSearcher` over its shard of the index root."""

    def __init__(self, index_root: str, number: int, log_sink: Sink | None = None, search_threads: int = 1) -> None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        ship_records(log_sink, shard_deployment(number))
        from serving.search.threads import SearchThreads
        from serving.shards.searcher import ShardSearcher

        # As a `serve` worker's (serving.search.threads says why): the BLAS libraries' count is the
        # process's, set here; OpenMP's is a thread's, applied on the thread the searches run on.
        SearchThreads.set(search_threads)
        self._apply_threads = SearchThreads.apply
        self._on_search_thread = threading.local()
        self.searcher = ShardSearcher(index_root, number)
        logging.getLogger(__name__).info("shard %s: %s", shard_label(number), SearchThreads.described())

    def _searching(self) -> ShardSearcher:
        """The searcher, OpenMP's thread count applied on the calling thread (once a thread)."""
        if not getattr(self._on_search_thread, "applied", False):
            self._apply_threads()
            self._on_search_thread.applied = True
        return self.searcher

    def warm(self, version: str) -> dict:
        return self.searcher.warm(version)

    # The query methods are coroutines that block: Serve runs a sync method on a thread pool,
    # a hop that cost ~1.2 ms a call (S = 1 at concurrency 1: p50 4.3 → 3.1 ms; S = 4 at 32:
    # 780 → 915 q/s, docs/benchmarks.md). A replica then answers one call at a time (faiss
    # spreads a batch over the cores; more replicas, `--shard-replicas`, add calls at once);
    # `warm` stays sync, so opening a version runs beside the searches. Serve's health checks
    # run on the replica's own loop, not the one user code blocks.
    async def search(self, version: str, request: ShardRequest) -> ShardAnswer:
        return self._searching().search(version, request)

    async def exact(self, version: str, request: ShardRequest) -> ShardAnswer:
        return self._searching().exact(version, request)

    async def fill(self, version: str, request: ShardRequest) -> ShardAnswer:
        return self._searching().fill(version, request)

    async def locate(self, version: str, asked: tuple[str, str | None]) -> ItemLocation | None:
        return self._searching().locate(version, asked)

    async def probe_sample(self, version: str, asked: tuple[int, str | None]) -> list[SampledItem]:
        return self._searching().probe_sample(version, asked)


@dataclass(frozen=True)
class EmbedderSettings:
    """What an embedder replica needs of the server's configuration (the whole of it would
    import the server's stack into the replica): its sessions' runtime, as one server tunes them."""

    provider: str
    intra_op_threads: int | None
    ort_spinning: bool
    runs_at_once: int
    run_rows: int | None
    largest_run: int
    run_rows_budget_s: float

    @classmethod
    def of(cls, config: ServerConfig) -> EmbedderSettings:
        runtime = config.runtime
        return cls(
            runtime.provider, runtime.intra_op_threads, runtime.ort_spinning, config.runs_at_once, runtime.run_rows,
            config.largest_run, runtime.run_rows_budget_s,
        )  # fmt: skip


class EmbedderReplica:
    """The embedder deployment's replica: the model's sessions, by model directory (the last
    two asked for), tuned as one server tunes them (`--run-rows`)."""

    def __init__(self, settings: EmbedderSettings, log_sink: Sink | None = None) -> None:
        ship_records(log_sink, EMBEDDER)
        # Each call makes a batch's floats from its pixels (600 kB an image): with glibc's dynamic
        # mmap threshold those blocks came from per-thread heaps that grew for good (the soak's
        # embedder: +10 MB in 15 minutes; flat with the threshold pinned, as `serve` pins it).
        pin_mmap_threshold()
        self.settings = settings
        self._models: OrderedDict[str, QueryEmbedder] = OrderedDict()
        self._texts: OrderedDict[str, OnnxTextEmbedder] = OrderedDict()
        self._lock = threading.Lock()
        self._decoders = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="decode")

    def _kept(self, cache: OrderedDict[str, T], key: str, make: Callable[[], T]) -> T:
        """`cache`'s entry for `key`, made by `make` the first time; the two last asked for kept."""
        with self._lock:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
                while len(cache) > 2:
                    cache.popitem(last=False)
            return found

    def _embedder(self, model_dir: str) -> QueryEmbedder:
        from serving.search.query_embedder import QueryEmbedder

        def make() -> QueryEmbedder:
            settings = self.settings
            made = QueryEmbedder(
                model_dir, settings.provider, settings.intra_op_threads, settings.ort_spinning,
                runs_at_once=settings.runs_at_once,
            )  # fmt: skip
            if settings.run_rows is not None:
                made.set_run_rows(settings.run_rows or None, settings.run_rows or None)
            else:
                side = -(-settings.largest_run // settings.runs_at_once)
                made.tune_run_rows(settings.largest_run, side, total_budget_s=settings.run_rows_budget_s)
            return made

        return self._kept(self._models, model_dir, make)

    def warm(self, model_dir: str) -> list[str]:
        return list(self._embedder(model_dir).session.get_providers())

    def _text(self, text_dir: str) -> OnnxTextEmbedder:
        from index.embedder import OnnxTextEmbedder

        settings = self.settings
        return self._kept(
            self._texts,
            text_dir,
            lambda: OnnxTextEmbedder(text_dir, settings.provider, settings.intra_op_threads, settings.ort_spinning),
        )

    def warm_text(self, text_dir: str) -> str:
        return self._text(text_dir).text_model_id

    def embed_text(self, text_dir: str, ids: np.ndarray) -> np.ndarray:
        """Embeddings of texts' token ids (tokenized and checked by the ingress) by a text model."""
        return self._text(text_dir).embed_ids(ids)

    def embed_images(
        self, model_dir: str, images: list[EncodedImage], max_pixels: int, side_by_side: bool = False
    ) -> tuple[np.ndarray, dict[int, ImageDecodeError]]:
        """Embeddings of encoded images, decoded here beside each other (Pillow decodes and
        resizes without the GIL), and the error of each that did not decode, by its place (its
        row zeros)."""
        from core.data.preprocess import ImageDecodeError, decode, open_image

        embedder = self._embedder(model_dir)

        def model_input(image: EncodedImage) -> np.ndarray | ImageDecodeError:
            try:
                return decode(open_image(image.data, max_pixels, load=False), embedder.contract, image.region)
            except ImageDecodeError as exc:
                return exc

        inputs = list(self._decoders.map(model_input, images))
        errors = {i: x for i, x in enumerate(inputs) if isinstance(x, ImageDecodeError)}
        vectors = np.zeros((len(images), embedder.dim), dtype=np.float32)
        decoded = [i for i in range(len(images)) if i not in errors]
        if decoded:
            vectors[decoded] = embedder.embed(np.stack([inputs[i] for i in decoded]), side_by_side=side_by_side)
        return vectors, errors

    def embed(self, model_dir: str, batch: np.ndarray, side_by_side: bool = False) -> np.ndarray:
        """Embeddings of a batch of model inputs, or of the uint8 pixels they are made of."""
        from core.data.preprocess import scaled_pixels

        embedder = self._embedder(model_dir)
        if batch.dtype == np.uint8:
            batch = scaled_pixels(batch, embedder.contract)
        return embedder.embed(batch, side_by_side=side_by_side)
