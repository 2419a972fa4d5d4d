"""The search service behind the gRPC servicers: plain classes, protobuf messages in and out, no
gRPC status or context in their logic (a failure is a `serving.errors.ServiceError`, which the
servicer turns into a status).

`SearchService` checks each request once at its entry (`serving.search.checks`: a `CheckedSearch`, which
the rest of the path trusts), prepares its query (where its image decodes, its parts combined),
hands it to the batcher, and builds the answer (neighbours, stage timings, what the recall
monitor and the Feedback log, `serving.monitoring.feedback`, keep of it). Reload, takedowns and the index
root's versions are `serving.api.admin_service.AdminService`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from core.data.preprocess import EncodedImage, ImageNotFound, load_pixels, open_image
from index.search import filters
from index.search.grouping import EXACT_PASS
from protos.simsearch.v1 import search_pb2 as pb
from serving.api.siblings import Siblings, merged_figures
from serving.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable, at_place, image_errors
from serving.logs import REQUEST_ID
from serving.monitoring.feedback import FeedbackLog
from serving.monitoring.monitor import RecallMonitor
from serving.search.answers import EVERY_ROW, NOTHING_EXCLUDED, Exclusion, Scope
from serving.search.batching import DynamicBatcher
from serving.search.checks import CheckedImage, CheckedPart, CheckedSearch, RequestChecks
from serving.search.engine import Limits, SearchEngine, ServingPair
from serving.search.executors import DecodePlacement
from serving.search.inference import Query, Result
from serving.telemetry.history import TrafficHistory
from serving.telemetry.metrics import ServiceMetrics

# The stage histograms' labels, in the order `_timings` observes them.
STAGES = ("decode", "queue", "embed", "search")
# A row's metadata when it has none: the items table's JSON text of an empty object.
NO_METADATA = "{}"

# An AddItems call's images in the queue at once: one batch's worth (the default
# --max-batch-size), where a thousand at once would fill the queue the queries need.
INGEST_IN_FLIGHT = 32


@asynccontextmanager
async def _deadline(timeout: float | None) -> AsyncIterator[float | None]:
    """The call's deadline over what it awaits: past it, DEADLINE_EXCEEDED. Yields the deadline
    as a `time.monotonic()` value (None without one), for the queries that must not start late."""
    try:
        async with asyncio.timeout(timeout):
            yield None if timeout is None else time.monotonic() + timeout
    except TimeoutError:
        raise DeadlineExceeded("deadline exceeded before the answer was ready") from None


class SearchService:
    """Search, SearchBatch, Embed, Feedback and GetInfo over the engine, batcher and monitor."""

    def __init__(
        self,
        engine: SearchEngine,
        batcher: DynamicBatcher,
        monitor: RecallMonitor,
        metrics: ServiceMetrics,
        decode_pool: Executor,
        inline_decode_pixels: int,
        inference_decode_pixels: int,
        feedback_window: int,
    ) -> None:
        self.engine = engine
        self.checks = RequestChecks(engine.limits)
        self.batcher = batcher
        self.monitor = monitor
        self.metrics = metrics
        self.decode_pool = decode_pool
        self.inline_decode_pixels = inline_decode_pixels
        self.inference_decode_pixels = inference_decode_pixels
        self.feedback_log = FeedbackLog(feedback_window)
        self.siblings: Siblings | None = None  # a worker's of `serve --processes N`: GetInfo merges their figures
        # The stage histograms' children, bound once: every answer observes up to four of them.
        self._stage_latency = tuple(metrics.stage_latency.labels(stage) for stage in STAGES)
        self._thumbnails: OrderedDict[tuple[int, str, int], tuple[bytes, str]] = OrderedDict()
        # serial of a load → requests still answering from it. Only the loop thread touches it.
        self._answering: Counter[int] = Counter()

    async def drained(self, live: int, timeout: float) -> bool:
        """Wait until no request is answering from a load other than `live` (the pair a takedown
        swapped in): what a takedown waits for before it says the removed items are gone — every
        earlier pair, not only the one its own swap replaced (a reload beside it, `--watch-current`
        loading the takedown's version first, may have swapped one out meanwhile). False past
        `timeout`."""
        deadline = time.monotonic() + timeout
        while any(serial != live for serial in self._answering):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    # -- query preparation ------------------------------------------------------------------

    def placement(self, pair: ServingPair, image: Image.Image) -> DecodePlacement:
        """Where an opened image's pixels are decoded: where it is embedded when the pair's
        embedder takes encoded images (`serve --ray`'s embedder deployment); on the loop when
        image and model input are both tiny (a thread hop costs more than decoding them); by the
        inference thread that embeds it when the image is small (the hop to a decode thread costs
        about what decoding it does, e.g. a 28×28 glyph PNG for a 224×224 model) or the batcher
        would take the query at once; else in a decode thread, in parallel with the others, while
        the query waits for its batch."""
        if pair.embedder.takes_encoded_images:
            return DecodePlacement.AT_EMBEDDER
        contract = pair.embedder.contract
        pixels = image.width * image.height
        if max(pixels, contract.height * contract.width) <= self.inline_decode_pixels:
            return DecodePlacement.ON_LOOP
        if pixels <= self.inference_decode_pixels:
            return DecodePlacement.IN_BATCHER
        return self.batcher.decode_placement

    async def _image_query(
        self,
        pair: ServingPair,
        image: CheckedImage,
        k: int,
        exclude: Exclusion,
        deadline: float | None,
        received: float,
        scope: Scope = EVERY_ROW,
    ) -> Query:
        """A query for a checked image (the region of it, when given): decoded here or in the
        decode pool, or left opened only, for the inference thread to decode."""
        started = time.perf_counter()
        placement = self.placement(pair, image.image)
        array = None
        if placement == DecodePlacement.AT_EMBEDDER:
            array = EncodedImage(image.data, image.crop)
        elif placement == DecodePlacement.ON_LOOP:
            array = self.engine.model_input(pair, image.image, image.crop)
        elif placement == DecodePlacement.IN_POOL:
            loop = asyncio.get_running_loop()
            array = await loop.run_in_executor(self.decode_pool, self.engine.model_input, pair, image.image, image.crop)
        return Query(
            pair,
            k,
            exclude,
            scope,
            array=array,
            image=image.image if array is None else None,
            region=image.crop,
            deadline=deadline,
            received=received,
            decode_s=time.perf_counter() - started,
        )

    async def _prepare(self, search: CheckedSearch, deadline: float | None, received: float) -> Query:
        pair, k, exclude, scope = search.pair, search.k, search.exclude, search.scope
        if search.parts:
            vector = await self._combined(search.parts, pair, deadline)
            return Query(pair, k, exclude, scope, vector=vector, deadline=deadline, received=received)
        if search.image is not None:
            return await self._image_query(pair, search.image, k, exclude, deadline, received, scope)
        if search.text_ids is not None:
            return Query(pair, k, exclude, scope, text_ids=search.text_ids, deadline=deadline, received=received)
        return Query(pair, k, exclude, scope, vector=search.vector, deadline=deadline, received=received)

    async def _combined(self, parts: tuple[CheckedPart, ...], pair: ServingPair, deadline: float | None) -> np.ndarray:
        """One query vector from several parts, Rocchio-style — normalise(sum of weight × unit
        embedding, negatives subtracted). An image part's error names the part."""

        async def vector_of(i: int, part: CheckedPart) -> np.ndarray:
            if part.text_ids is not None:
                query = Query(pair, 0, text_ids=part.text_ids, deadline=deadline)
                return (await self.batcher.run(query)).vector
            if part.image is None:
                return part.vector
            try:
                return await self._image_vector(pair, part.image, deadline)
            except InvalidArgument as exc:
                raise InvalidArgument(f"parts[{i}]: {exc}") from None

        found = await asyncio.gather(*(vector_of(i, p) for i, p in enumerate(parts)))
        combined = sum(p.weight * v.astype(np.float64) for p, v in zip(parts, found, strict=True))
        norm = float(np.linalg.norm(combined))
        if not norm > 1e-6:
            raise InvalidArgument("query parts cancel out: the weighted sum of their embeddings is zero")
        return (combined / norm).astype(np.float32)

    async def _image_vector(self, pair: ServingPair, image: CheckedImage, deadline: float | None) -> np.ndarray:
        """An image's embedding: a query that searches for nothing, batched with the others."""
        query = await self._image_query(pair, image, 0, NOTHING_EXCLUDED, deadline, time.perf_counter())
        return (await self.batcher.run(query)).vector

    async def item_vectors(self, pair: ServingPair, items: list[CheckedImage | np.ndarray]) -> np.ndarray:
        """The vectors of an AddItems call's checked items (`RequestChecks.new_items`), row for
        row: an embedding as it is, an image embedded by `pair`'s model in the batches and queue
        the queries share — INGEST_IN_FLIGHT at a time, so a call of many images leaves the
        queue to them. An image that does not decode names its item (`items[3]: …`)."""
        vectors = np.empty((len(items), pair.dim), dtype=np.float32)
        images = []
        for i, item in enumerate(items):
            if isinstance(item, CheckedImage):
                images.append((i, item))
            else:
                vectors[i] = item

        async def embedded(i: int, image: CheckedImage) -> None:
            with at_place(i, "items"):
                vectors[i] = await self._image_vector(pair, image, None)

        for start in range(0, len(images), INGEST_IN_FLIGHT):
            await asyncio.gather(*(embedded(i, image) for i, image in images[start : start + INGEST_IN_FLIGHT]))
        return vectors

    # -- answers ----------------------------------------------------------------------------

    async def _answer(
        self, search: CheckedSearch, deadline: float | None, received: float, background: bool = False
    ) -> pb.SearchResponse:
        query = await self._prepare(search, deadline, received)
        if background:
            query = dataclasses.replace(query, background=True)
        return self._respond(search, query, await self.batcher.run(query))

    def _respond(self, search: CheckedSearch, query: Query, result: Result) -> pb.SearchResponse:
        pair = query.pair
        if result.shards_missing and not search.allow_partial:  # never a silently short answer
            raise Unavailable(result.unavailable or f"shard {', '.join(result.shards_missing)} did not answer")
        request_id = search.request_id or uuid.uuid4().hex
        REQUEST_ID.set(request_id)  # the call's log lines (its access line, a failure) name it
        group_by = query.scope.group_by
        if group_by is not None and result.candidates is not None:
            self.metrics.group_candidates.observe(
                pair.index_version.size if result.candidates == EXACT_PASS else result.candidates
            )
        self.feedback_log.remember(request_id, pair.serial, [h.id for h in result.hits])
        if search.label is not None:
            source = "text" if search.kind == "text" else "traffic"  # text traffic's recall shown apart
            truths = [h.label if h.label is not None else h.item for h in result.hits]
            self.monitor.record_labelled(pair.serial, search.label, truths, source)
        if query.scope.min_score is None:  # the exact re-run compares against every row the filter allows
            self.monitor.maybe_sample_ann(pair.serial, result.vector, result.hits, query.exclude, query.scope)
        if result.path is not None:
            self.metrics.filtered_queries.labels(result.path).inc()
        response = pb.SearchResponse(
            truncated=result.truncated,
            group_by=group_by or "",
            request_id=request_id,
            index_version=pair.version,
            index_id=pair.index_id,
            model_id=pair.model_id,
            timings=self._timings(query, result),
            shards_answered=result.shards_answered,
            shards_missing=result.shards_missing,
        )
        # Each neighbour made in place: built apart and handed over as a list, every one was
        # copied into the response, twice the cost of making it.
        add = response.neighbors.add
        for h in result.hits:
            # float32 dot products of unit vectors land a hair outside the cosine's range
            score = min(1.0, max(-1.0, h.score))
            if h.metadata == NO_METADATA:  # no map to fill: parsing "{}" cost more than the rest of it
                add(id=h.id, score=score, label=h.label, group=h.group)
            else:
                add(id=h.id, score=score, label=h.label, metadata=json.loads(h.metadata), group=h.group)
        return response

    def _timings(self, query: Query, result: Result) -> pb.StageTimings:
        """The query's stage times, observed in the stage histograms and returned for its answer."""
        seconds = (result.decode_s, result.queue_s, result.embed_s, result.search_s)  # in STAGES' order
        for histogram, spent in zip(self._stage_latency, seconds, strict=True):
            if spent:
                histogram.observe(spent)
        return pb.StageTimings(
            decode_ms=result.decode_s * 1e3,
            queue_ms=result.queue_s * 1e3,
            embed_ms=result.embed_s * 1e3,
            search_ms=result.search_s * 1e3,
            total_ms=(time.perf_counter() - query.received) * 1e3,
        )

    # -- the calls --------------------------------------------------------------------------

    async def search_many(
        self, requests: list[pb.SearchRequest], timeout: float | None, named: bool = False, background: bool = False
    ) -> list[pb.SearchResponse]:
        """Queries answered on one pair (the one live when they arrived), batched with others;
        every one is checked before any is answered. `named`: a request's own error names its
        place in the list (`requests[3]: …`). `background`: the server's own queries (a probe
        round's), batched only while no user query waits (`serving.search.executors`)."""
        pair = self.engine.pair
        received = time.perf_counter()
        checked = self.checks.search_batch(requests, pair, named)
        self._answering[pair.serial] += 1
        try:
            async with _deadline(timeout) as deadline:
                answers = [
                    self._answer_at(i, c, deadline, received)
                    if named
                    else self._answer(c, deadline, received, background)
                    for i, c in enumerate(checked)
                ]
                if len(answers) == 1:
                    return [await answers[0]]
                tasks = [asyncio.ensure_future(answer) for answer in answers]
                try:
                    return list(await asyncio.gather(*tasks))
                except BaseException:  # one bad query fails the call: its siblings stop costing work
                    for task in tasks:
                        task.cancel()
                    raise
        finally:
            self._answering[pair.serial] -= 1
            if not self._answering[pair.serial]:
                del self._answering[pair.serial]

    async def _answer_at(
        self, i: int, search: CheckedSearch, deadline: float | None, received: float
    ) -> pb.SearchResponse:
        """Request `i` of a batch answered: what fails it once checked (an image that does not
        decode, parts that cancel out) names it too."""
        with at_place(i):
            return await self._answer(search, deadline, received)

    async def search(self, request: pb.SearchRequest, timeout: float | None) -> pb.SearchResponse:
        if request.request_id:
            REQUEST_ID.set(request.request_id)
        return (await self.search_many([request], timeout))[0]

    async def search_batch(self, request: pb.SearchBatchRequest, timeout: float | None) -> pb.SearchBatchResponse:
        self.checks.check_batch_size(len(request.requests))
        return pb.SearchBatchResponse(responses=await self.search_many(list(request.requests), timeout, named=True))

    async def embed(self, request: pb.EmbedRequest, timeout: float | None) -> pb.EmbedResponse:
        """An image embedded in a batch with the queries (a query searched for nothing)."""
        pair = self.engine.pair
        received = time.perf_counter()
        image = self.checks.image(pair, request.image)
        async with _deadline(timeout) as deadline:
            query = await self._image_query(pair, image, 0, NOTHING_EXCLUDED, deadline, received)
            result = await self.batcher.run(query)
        return pb.EmbedResponse(
            embedding=result.vector.tolist(),
            model_id=pair.model_id,
            request_id=request.request_id or uuid.uuid4().hex,
            timings=self._timings(query, result),
        )

    async def feedback(self, request: pb.FeedbackRequest) -> pb.FeedbackResponse:
        """A mark on an earlier answer: which ids were relevant to it — its own or other indexed
        ids it should have returned (a miss). Ids the index does not hold are refused, naming
        them; a second mark on the same request replaces the first. Not accepted when the
        answer came from a pair swapped out since: it no longer describes what is served."""
        pair = self.engine.pair
        serial, ids = self.feedback_log.returned_ids(request.request_id, pair)
        relevant = list(request.relevant_ids)
        if serial == pair.serial:
            returned = set(ids)
            unknown = [i for i in relevant if i not in returned and pair.index_version.locate(i) is None]
            if unknown:
                named = ", ".join(map(repr, unknown[:10]))
                if len(unknown) > 10:
                    named += f" and {len(unknown) - 10} more"
                raise InvalidArgument(
                    f"relevant_ids: {named} neither in the answer nor in index version {pair.version}; nothing counted",
                    "relevant_ids",
                )
        accepted = self.monitor.record_feedback(serial, ids, relevant, request.request_id)
        return pb.FeedbackResponse(accepted=accepted)

    async def info(self, whole_server: bool = True) -> pb.GetInfoResponse:
        """What is served and how well; `whole_server`: Recall@K over every worker of a server of
        several (`serving.api.siblings`), else this process's own."""
        own = self._info()
        if whole_server and self.siblings is not None:
            others = await self.siblings.infos()
            for field in ("recall_at_k", "ann_recall_at_k"):
                merged = merged_figures([getattr(own, field), *(getattr(other, field) for other in others)])
                own.ClearField(field)
                getattr(own, field).extend(merged)
        return own

    def _info(self) -> pb.GetInfoResponse:
        pair = self.engine.pair
        limits = self.engine.limits
        samples = self.monitor.samples()
        recall = [
            pb.RecallFigure(source=source, k=k, value=v, samples=samples.get(source, {}).get(k, 0))
            for source, values in self.monitor.figures().items()
            for k, v in values.items()
        ]
        ann = [
            pb.RecallFigure(source="ann", k=k, value=v, samples=samples["ann"].get(k, 0))
            for k, v in self.monitor.ann_values().items()
        ]
        return pb.GetInfoResponse(
            model_id=pair.model_id,
            index_version=pair.version,
            index_id=pair.index_id,
            index_size=pair.index_version.size,
            deleted_rows=pair.manifest.deleted_rows,
            embedding_dim=pair.dim,
            factory=pair.manifest.factory,
            providers=pair.embedder.session.get_providers(),
            limits=pb.Limits(
                max_k=limits.max_k,
                max_message_bytes=limits.max_message_bytes,
                max_image_pixels=limits.max_image_pixels,
                max_batch_queries=limits.max_batch_queries,
                max_query_parts=limits.max_query_parts,
                max_per_group=limits.max_per_group,
            ),
            item_field=pair.manifest.item_field or "",
            text_model_id=pair.text.text_model_id if pair.text is not None else "",
            text_context_length=pair.text.tokenizer.context_length if pair.text is not None else 0,
            recall_at_k=recall,
            ann_recall_at_k=ann,
            filterable=[
                pb.FilterableField(name=spec.name, type=spec.type)
                for spec in filters.specs_of(pair.manifest.filterable)
            ],
        )

    async def thumbnail(self, item_id: str, size: int) -> tuple[bytes, str]:
        """An indexed item's image scaled to at most `size` pixels a side, and its content type.
        Only the file the live version records for `item_id` is ever read."""
        pair = self.engine.pair
        key = (pair.serial, item_id, size)
        cached = self._thumbnails.get(key)
        if cached is None:
            found = pair.index_version.locate(item_id)
            if found is None:
                raise NotFound(f"no item {item_id!r} in index version {pair.version}")
            path = found.path
            loop = asyncio.get_running_loop()
            cached = await loop.run_in_executor(self.decode_pool, thumbnail_of, path, size, self.engine.limits)
            self._thumbnails[key] = cached
            while len(self._thumbnails) > 512:
                self._thumbnails.popitem(last=False)
        return cached

    def history(self, traffic: TrafficHistory) -> dict:
        """The console's Health page: the last hour of traffic, the live recall figures, the versions."""
        live = None
        if self.engine.loaded:
            pair = self.engine.pair
            live = {
                "indexVersion": pair.version,
                "modelId": pair.model_id,
                "indexSize": pair.index_version.size,
                "factory": pair.manifest.factory,
            }
        recall = {source: {str(k): v for k, v in values.items()} for source, values in self.monitor.figures().items()}
        recall["ann"] = {str(k): v for k, v in self.monitor.ann_values().items()}
        samples = {source: {str(k): n for k, n in counts.items()} for source, counts in self.monitor.samples().items()}
        return {
            "samples": samples,  # what each recall figure is a mean over
            "intervalS": traffic.interval_s,
            "points": [{"t": p.t, "qps": p.qps, "p50Ms": p.p50_ms, "p99Ms": p.p99_ms} for p in traffic.points()],
            "recall": recall,
            "live": live,
        }


def thumbnail_of(path: str, size: int, limits: Limits) -> tuple[bytes, str]:
    """The image at `path`, upright (EXIF orientation applied, as in the contact sheets), scaled
    to fit `size`: JPEG, or PNG where it has transparency. A large JPEG decodes at reduced scale."""
    with image_errors():
        try:
            image = open_image(Path(path), limits.max_image_pixels, load=False)
        except ImageNotFound:  # the catalog moved on since the build: not the request's fault
            raise NotFound(f"the image file of this item is gone: {Path(path).name}") from None
        image.draft(None, (size, size))
        image = ImageOps.exif_transpose(load_pixels(image))
    image.thumbnail((size, size))
    out = io.BytesIO()
    if image.mode in ("RGBA", "LA", "P"):
        image.save(out, "PNG", optimize=True)
        return out.getvalue(), "image/png"
    image.convert("RGB").save(out, "JPEG", quality=85)
    return out.getvalue(), "image/jpeg"
