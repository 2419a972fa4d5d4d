"""The search service behind the gRPC servicers: plain classes, protobuf messages in and out, no
gRPC status or context in their logic (a failure is a `serving.errors.ServiceError`, which the
servicer turns into a status).

`SearchService` prepares each query (checks, exclusions, where its image decodes), hands it to
the batcher, and builds the answer (neighbours, stage timings, what the recall monitor and the
Feedback log keep of it). `AdminService` reloads and says what changed.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
import uuid
from array import array
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from core import artifacts
from core.artifacts import ArtifactError
from core.manifests import IndexManifest
from core.preprocess import ImageNotFound, load_pixels, open_image
from index import filters
from index.duplicates import GROUPS_FILE, SUMMARY_FILE, runs_of
from index.grouping import EXACT_PASS
from index.lifecycle import RemovalReport, RollbackReport, audit_entries
from protos.simsearch.v1 import search_pb2 as pb
from serving.batching import DecodePlacement, DynamicBatcher, Query, Result
from serving.checks import RequestChecks
from serving.engine import EVERY_ROW, Hit, Limits, Scope, SearchEngine, ServingPair
from serving.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    Unavailable,
    image_errors,
)
from serving.history import TrafficHistory
from serving.metrics import ServiceMetrics
from serving.monitor import RecallMonitor


@asynccontextmanager
async def _deadline(timeout: float | None) -> AsyncIterator[float | None]:
    """The call's deadline over what it awaits: past it, DEADLINE_EXCEEDED. Yields the deadline
    as a `time.monotonic()` value (None without one), for the queries that must not start late."""
    try:
        async with asyncio.timeout(timeout):
            yield None if timeout is None else time.monotonic() + timeout
    except TimeoutError:
        raise DeadlineExceeded("deadline exceeded before the answer was ready") from None


class FeedbackLog:
    """The last `window` answers by request id, for Feedback calls naming one of them.

    Each answer is kept as (serial of the load that gave it, rows it returned): the serial, not
    the pair, or the log would keep every pair it saw answering alive; rows, not ids, one small
    array an answer instead of a list of strings (the log holds thousands of answers, and churns
    with every query). Only the loop thread touches it: no lock."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: OrderedDict[str, tuple[int, array]] = OrderedDict()

    def remember(self, request_id: str, serial: int, rows: list[int]) -> None:
        self._recent[request_id] = (serial, array("l", rows))
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)

    def returned_ids(self, request_id: str, live: ServingPair) -> tuple[int, list[str]]:
        """(serial of the load that answered `request_id`, the ids it returned); no ids when
        that load is not `live` (its rows may name other items now)."""
        answer = self._recent.get(request_id)
        if answer is None:
            raise InvalidArgument(f"unknown or expired request_id {request_id!r}")
        serial, rows = answer
        return serial, [live.items.ids[r] for r in rows] if live.serial == serial else []


def to_filter(message: pb.Filter) -> filters.Filter:
    """The protocol's filter as the index layer's (which checks it against the version's fields)."""

    def condition(c: pb.Condition) -> filters.Condition:
        kind = c.WhichOneof("match")
        if kind is None:
            raise InvalidArgument(f"filter field {c.field!r}: a condition needs one of value, any_of or range")
        if kind == "value":
            return filters.Condition(c.field, value=c.value)
        if kind == "any_of":
            return filters.Condition(c.field, any_of=tuple(c.any_of.values))
        bounds = {b: getattr(c.range, b) if c.range.HasField(b) else None for b in ("gte", "gt", "lte", "lt")}
        return filters.Condition(c.field, range=filters.Range(**bounds))

    return filters.Filter(
        must=tuple(map(condition, message.must)),
        should=tuple(map(condition, message.should)),
        must_not=tuple(map(condition, message.must_not)),
    )


class FilterMasks:
    """The rows of recent filters, by (load serial, the filter's bytes): a filter repeated by
    many queries ("only this category") is turned into its mask once, and its queries carry
    the same array, so the engine searches those of one batch together. Masks are read-only.
    Only the loop thread touches it: no lock."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._masks: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()

    def mask(self, pair: ServingPair, message: pb.Filter) -> np.ndarray:
        key = (pair.serial, message.SerializeToString(deterministic=True))
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            return mask
        index = pair.index_version.filters
        if index is None:
            raise InvalidArgument("filter: this index version declares no filterable fields (index build --filterable)")
        try:
            mask = index.mask(to_filter(message))
        except filters.FilterError as exc:
            raise InvalidArgument(str(exc)) from None
        mask.flags.writeable = False
        self._masks[key] = mask
        while len(self._masks) > self.size:
            self._masks.popitem(last=False)
        return mask


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
        self._thumbnails: OrderedDict[tuple[int, int, int], tuple[bytes, str]] = OrderedDict()
        # serial of a load → requests still answering from it. Only the loop thread touches it.
        self._answering: Counter[int] = Counter()
        self.filter_masks = FilterMasks()

    async def drained(self, serial: int, timeout: float) -> bool:
        """Wait until no request is answering from the load `serial` (a pair swapped out): what
        a takedown waits for before it says the removed items are gone. False past `timeout`."""
        deadline = time.monotonic() + timeout
        while self._answering.get(serial):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    # -- query preparation ------------------------------------------------------------------

    def placement(self, pair: ServingPair, image: Image.Image) -> DecodePlacement:
        """Where an opened image's pixels are decoded: on the loop when image and model input are
        both tiny (a thread hop costs more than decoding them); by the inference thread that
        embeds it when the image is small (the hop to a decode thread costs about what decoding
        it does, e.g. a 28×28 glyph PNG for a 224×224 model) or the batcher would take the
        query at once; else in a decode thread, in parallel with the others, while the query
        waits for its batch."""
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
        data: bytes,
        k: int,
        exclude: frozenset[int],
        deadline: float | None,
        received: float,
        scope: Scope = EVERY_ROW,
        region: pb.Region | None = None,
    ) -> Query:
        """A query for an image (the region of it, when given): decoded here or in the decode
        pool, or only opened, for the inference thread to decode."""
        image = self.checks.open_image(data)
        crop = None
        if region is not None:
            crop = self.checks.check_region(region, image, pair.embedder.contract.exif_orientation)
        placement = self.placement(pair, image)
        array = None
        if placement == DecodePlacement.ON_LOOP:
            array = self.engine.model_input(pair, image, crop)
        elif placement == DecodePlacement.IN_POOL:
            loop = asyncio.get_running_loop()
            array = await loop.run_in_executor(self.decode_pool, self.engine.model_input, pair, image, crop)
        return Query(
            pair,
            k,
            exclude,
            scope,
            array=array,
            image=image if array is None else None,
            region=crop,
            deadline=deadline,
            received=received,
            decode_s=time.perf_counter() - received,
        )

    def _scope(self, request: pb.SearchRequest, pair: ServingPair) -> Scope:
        """The rows a request may be answered with: its filter's matches, at or above its
        min_score; grouped by its group_by field (the index's item field unless it says)."""
        min_score = None
        if request.HasField("min_score"):
            min_score = self.checks.check_min_score(float(request.min_score))
        allowed = self.filter_masks.mask(pair, request.filter) if request.HasField("filter") else None
        group_by = request.group_by if request.HasField("group_by") else pair.manifest.item_field or ""
        if not group_by:
            if request.HasField("per_group"):
                raise InvalidArgument("per_group needs group_by (this index has no item field to group by)")
            return Scope(allowed, min_score) if allowed is not None or min_score is not None else EVERY_ROW
        per_group = self.checks.check_per_group(request.per_group if request.HasField("per_group") else 1)
        return Scope(allowed, min_score, self.checks.groups(pair, group_by), per_group)

    def _left_out(self, scope: Scope, rows: set[int]) -> set[int]:
        """Rows a query's own items leave out: the rows themselves and, grouped, their groups'."""
        if scope.groups is None:
            return rows
        codes = scope.groups.codes
        return rows.union(*(scope.groups.rows_of(int(codes[r])).tolist() for r in rows if codes[r] >= 0))

    async def _prepare(self, request: pb.SearchRequest, pair: ServingPair, deadline: float | None) -> Query:
        checks = self.checks
        if request.HasField("label") and not (pair.items.labelled or pair.manifest.item_field):
            raise InvalidArgument(
                "label: this index version's rows have no label and no item field, so a labelled query cannot be "
                "scored on it; leave label out (index build --item-field names the column a label would match)"
            )
        scope = self._scope(request, pair)
        k = checks.k_of(request.k, scope.min_score)
        exclude = frozenset(checks.exclude_rows(pair, list(request.exclude_ids)))
        received = time.perf_counter()
        kind = request.WhichOneof("query")
        if request.HasField("region") and kind != "image":
            raise InvalidArgument(f"region crops an image query; this query is {kind or 'a set of parts'}")
        if request.parts:
            if kind is not None:
                raise InvalidArgument(f"set either {kind} or parts, not both")
            vector, own = await self._combined(list(request.parts), pair, deadline)
            exclude |= self._left_out(scope, own)
            return Query(pair, k, exclude, scope, vector=vector, deadline=deadline, received=received)
        if kind == "image":
            region = request.region if request.HasField("region") else None
            return await self._image_query(pair, request.image, k, exclude, deadline, received, scope, region)
        if kind == "embedding":
            vector = checks.check_embedding(pair, request.embedding.values)
            return Query(pair, k, exclude, scope, vector=vector, deadline=deadline, received=received)
        if kind == "item_id":
            vector, row = checks.item_vector(pair, request.item_id)
            exclude |= self._left_out(scope, {row})
            return Query(pair, k, exclude, scope, vector=vector, deadline=deadline, received=received)
        raise InvalidArgument("request has no query: set image, embedding, item_id or parts")

    async def _combined(
        self, parts: list[pb.QueryPart], pair: ServingPair, deadline: float | None
    ) -> tuple[np.ndarray, set[int]]:
        """One query vector from several parts, Rocchio-style — normalise(sum of weight × unit
        embedding, negatives subtracted) — and the rows of its item-id parts. A part's error
        names the part."""
        weights = self.checks.check_parts(parts)

        async def vector_of(i: int, part: pb.QueryPart) -> tuple[np.ndarray, int | None]:
            try:
                kind = part.WhichOneof("query")
                if kind == "embedding":
                    return self.checks.check_embedding(pair, part.embedding.values), None
                if kind == "item_id":
                    return self.checks.item_vector(pair, part.item_id)
                region = part.region if part.HasField("region") else None
                query = await self._image_query(
                    pair, part.image, 0, frozenset(), deadline, time.perf_counter(), region=region
                )
                return (await self.batcher.run(query)).vector, None
            except InvalidArgument as exc:
                raise InvalidArgument(f"parts[{i}]: {exc}") from None

        found = await asyncio.gather(*(vector_of(i, p) for i, p in enumerate(parts)))
        combined = sum(w * v.astype(np.float64) for w, (v, _) in zip(weights, found, strict=True))
        norm = float(np.linalg.norm(combined))
        if not norm > 1e-6:
            raise InvalidArgument("query parts cancel out: the weighted sum of their embeddings is zero")
        return (combined / norm).astype(np.float32), {row for _, row in found if row is not None}

    # -- answers ----------------------------------------------------------------------------

    async def _answer(self, request: pb.SearchRequest, pair: ServingPair, deadline: float | None) -> pb.SearchResponse:
        query = await self._prepare(request, pair, deadline)
        return self._respond(request, query, await self.batcher.run(query))

    def _respond(self, request: pb.SearchRequest, query: Query, result: Result) -> pb.SearchResponse:
        pair = query.pair
        items = pair.items
        request_id = request.request_id or uuid.uuid4().hex
        neighbors = [
            pb.Neighbor(
                id=items.ids[h.row],
                # float32 dot products of unit vectors land a hair outside the cosine's range
                score=min(1.0, max(-1.0, h.score)),
                label=items.labels[h.row],
                metadata=items.metadata[h.row],
            )
            for h in result.hits
        ]
        groups = query.scope.groups
        if groups is not None:
            for neighbor, hit in zip(neighbors, result.hits, strict=True):
                neighbor.group = groups.label(hit.group)
            if result.candidates is not None:
                self.metrics.group_candidates.observe(
                    pair.index_version.size if result.candidates == EXACT_PASS else result.candidates
                )
        rows = [h.row for h in result.hits]
        self.feedback_log.remember(request_id, pair.serial, rows)
        if request.HasField("label"):
            self.monitor.record_labelled(pair.serial, request.label, self._truths(pair, result.hits, neighbors))
        if query.scope.min_score is None:  # the exact re-run compares against every row the filter allows
            self.monitor.maybe_sample_ann(
                pair.serial, result.vector, rows, query.exclude, query.scope.allowed, query.scope.groups
            )
        if result.path is not None:
            self.metrics.filtered_queries.labels(result.path).inc()
        return pb.SearchResponse(
            truncated=result.truncated,
            group_by=groups.name if groups is not None else "",
            neighbors=neighbors,
            request_id=request_id,
            index_version=pair.version,
            index_id=pair.index_id,
            model_id=pair.model_id,
            timings=self._timings(query, result),
        )

    @staticmethod
    def _truths(pair: ServingPair, hits: list[Hit], neighbors: list[pb.Neighbor]) -> list[str | None]:
        """What a query's `label` is compared with, answer row by row: the rows' labels, or —
        rows without labels — their item field's value (the label names the item to find)."""
        if pair.items.labelled:
            return [n.label for n in neighbors]
        groups = pair.index_version.groups(pair.manifest.item_field)
        return [groups.label(groups.codes[h.row]) if groups.codes[h.row] >= 0 else None for h in hits]

    def _timings(self, query: Query, result: Result) -> pb.StageTimings:
        """The query's stage times, observed in the stage histograms and returned for its answer."""
        for stage, seconds in (
            ("decode", result.decode_s),
            ("queue", result.queue_s),
            ("embed", result.embed_s),
            ("search", result.search_s),
        ):
            if seconds:
                self.metrics.stage_latency.labels(stage).observe(seconds)
        return pb.StageTimings(
            decode_ms=result.decode_s * 1e3,
            queue_ms=result.queue_s * 1e3,
            embed_ms=result.embed_s * 1e3,
            search_ms=result.search_s * 1e3,
            total_ms=(time.perf_counter() - query.received) * 1e3,
        )

    # -- the calls --------------------------------------------------------------------------

    async def search_many(
        self, requests: list[pb.SearchRequest], timeout: float | None, named: bool = False
    ) -> list[pb.SearchResponse]:
        """Queries answered on one pair (the one live when they arrived), batched with others.
        `named`: a request's own error names its place in the list (`requests[3]: …`)."""
        pair = self.engine.pair
        self._answering[pair.serial] += 1
        try:
            async with _deadline(timeout) as deadline:
                answers = [
                    self._answer_at(i, r, pair, deadline) if named else self._answer(r, pair, deadline)
                    for i, r in enumerate(requests)
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
        self, i: int, request: pb.SearchRequest, pair: ServingPair, deadline: float | None
    ) -> pb.SearchResponse:
        """Request `i` of a batch answered: one bad request fails the batch, so its error says
        which it was."""
        try:
            return await self._answer(request, pair, deadline)
        except (DeadlineExceeded, Unavailable):
            raise  # the call's, not the request's
        except ServiceError as exc:
            raise type(exc)(f"requests[{i}]: {exc.message}") from exc

    async def search(self, request: pb.SearchRequest, timeout: float | None) -> pb.SearchResponse:
        return (await self.search_many([request], timeout))[0]

    async def search_batch(self, request: pb.SearchBatchRequest, timeout: float | None) -> pb.SearchBatchResponse:
        limit = self.engine.limits.max_batch_queries
        if len(request.requests) > limit:
            raise InvalidArgument(f"{len(request.requests)} queries exceed the batch limit of {limit}")
        return pb.SearchBatchResponse(responses=await self.search_many(list(request.requests), timeout, named=True))

    async def embed(self, request: pb.EmbedRequest, timeout: float | None) -> pb.EmbedResponse:
        """An image embedded in a batch with the queries (a query searched for nothing)."""
        pair = self.engine.pair
        async with _deadline(timeout) as deadline:
            query = await self._image_query(pair, request.image, 0, frozenset(), deadline, time.perf_counter())
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
            unknown = [i for i in relevant if i not in returned and pair.index_version.row_of(i) is None]
            if unknown:
                named = ", ".join(map(repr, unknown[:10]))
                if len(unknown) > 10:
                    named += f" and {len(unknown) - 10} more"
                raise InvalidArgument(
                    f"relevant_ids: {named} neither in the answer nor in index version {pair.version}; nothing counted"
                )
        accepted = self.monitor.record_feedback(serial, ids, relevant, request.request_id)
        return pb.FeedbackResponse(accepted=accepted)

    async def info(self) -> pb.GetInfoResponse:
        pair = self.engine.pair
        limits = self.engine.limits
        recall = [
            pb.RecallFigure(source=source, k=k, value=v)
            for source, values in self.monitor.figures().items()
            for k, v in values.items()
        ]
        ann = [pb.RecallFigure(source="ann", k=k, value=v) for k, v in self.monitor.ann_values().items()]
        return pb.GetInfoResponse(
            model_id=pair.model_id,
            index_version=pair.version,
            index_id=pair.index_id,
            index_size=pair.index_version.size,
            deleted_rows=len(pair.index_version.deleted),
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
        row = pair.index_version.row_of(item_id)
        if row is None:
            raise NotFound(f"no item {item_id!r} in index version {pair.version}")
        key = (pair.serial, row, size)
        cached = self._thumbnails.get(key)
        if cached is None:
            path = pair.items.paths[row]
            loop = asyncio.get_running_loop()
            cached = await loop.run_in_executor(self.decode_pool, thumbnail_of, path, size, self.checks.limits)
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
        return {
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


Reloader = Callable[[str | None, str | None], Awaitable[tuple[ServingPair | None, ServingPair]]]
Remover = Callable[[list[str], str, str, str], Awaitable[RemovalReport]]
# (version, model_dir, who, via, restore_taken_down, make_current) → what the rollback did, old pair, new pair
RollingBack = Callable[
    [str, str | None, str, str, bool, bool],
    Awaitable[tuple[RollbackReport, ServingPair | None, ServingPair]],
]


class AdminService:
    """Reload: a new pair swapped in, or FAILED_PRECONDITION with the old one still serving.
    RemoveItems: a takedown published as a new version and swapped in. A named version (Reload,
    make live) goes through `rollback`: takedowns made since it was built are re-applied."""

    def __init__(
        self,
        reload: Reloader,
        remove: Remover | None = None,
        index_root: str | Path | None = None,
        rollback: RollingBack | None = None,
        live: Callable[[], ServingPair | None] | None = None,
    ) -> None:
        self._reload = reload
        self._remove = remove
        self._rollback = rollback
        self._live = live
        self.index_root = Path(index_root) if index_root is not None else None

    def _root(self) -> Path:
        if self.index_root is None:
            raise FailedPrecondition("this server has no index root")
        return self.index_root

    def versions(self, live: str | None) -> list[dict]:
        """Every version in the root, newest first, with its manifest's figures."""
        root = self._root()
        current = artifacts.current_version(root)
        listed = []
        for version in reversed(artifacts.list_versions(root)):
            try:
                m = IndexManifest.read(artifacts.version_dir(root, version))
            except (ArtifactError, FileNotFoundError, ValueError) as exc:
                listed.append({"version": version, "error": str(exc)})
                continue
            quality = m.quality
            listed.append(
                {
                    "version": version,
                    "live": version == live,
                    "current": version == current,
                    "size": m.live_size,
                    "deletedRows": m.deleted_rows,
                    "factory": m.factory,
                    "modelId": m.model_id,
                    "annRecall": quality.ann_recall_at_k if quality else None,
                    "probeRecallAtK": (quality.probe_recall_at_k or {}) if quality else {},
                    "created": m.created,
                    "parentVersion": m.parent_version,
                }
            )
        return listed

    def neighbours_sheet(self, version: str) -> Path:
        path = self._version_dir(version) / artifacts.NEIGHBOURS_FILE
        if not path.is_file():
            raise NotFound(f"version {version} has no {artifacts.NEIGHBOURS_FILE}")
        return path

    def _version_dir(self, version: str) -> Path:
        if version not in artifacts.list_versions(self._root()):  # a name from the listing, never a path
            raise NotFound(f"no index version {version!r}")
        return artifacts.version_dir(self._root(), version)

    async def make_live(
        self, version: str, who: str = "", via: str = "http", restore_taken_down: bool = False
    ) -> pb.ReloadResponse:
        """Make `version` live — what `index rollback --to` does — and load it: CURRENT names it,
        or a version derived from it without the items taken down since it was built."""
        self._version_dir(version)
        return await self._roll_back(version, None, who, via, restore_taken_down, make_current=True)

    def audit(self, limit: int) -> list[dict]:
        """The newest `limit` entries of the root's takedown audit log."""
        return audit_entries(self._root())[::-1][:limit]

    def duplicates(self, live: str) -> dict:
        """The groups of the live version's latest `index duplicates` run in its default folder."""
        runs = runs_of(self._root(), live)
        if not runs:  # not an error: a version nobody has looked for duplicates in yet
            return {"indexVersion": live, "minScore": None, "run": None, "groups": []}
        run = runs[-1]
        summary = json.loads((run / SUMMARY_FILE).read_text()) if (run / SUMMARY_FILE).is_file() else {}
        groups: dict[int, dict] = {}
        with open(run / GROUPS_FILE, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                group = groups.setdefault(int(row["group"]), {"group": int(row["group"]), "ids": [], "labels": []})
                group["ids"].append(row["id"])
                group["labels"].append(row.get("label") or "")
        for group in groups.values():
            group["size"] = len(group["ids"])
        return {
            "indexVersion": live,
            "minScore": summary.get("min_score"),
            "run": run.name,
            "groups": sorted(groups.values(), key=lambda g: (-g["size"], g["group"])),
        }

    async def remove_items(self, request: pb.RemoveItemsRequest, who: str, via: str) -> pb.RemoveItemsResponse:
        ids = list(request.ids)
        if not ids:
            raise InvalidArgument("ids: empty; name the items to remove")
        if any(not item_id for item_id in ids):
            raise InvalidArgument("ids: an empty string is not an item id")
        if self._remove is None:
            raise FailedPrecondition("this server cannot remove items")
        try:
            report = await self._remove(ids, who, request.reason, via)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(f"removal failed, nothing changed: {exc}") from None
        return pb.RemoveItemsResponse(
            index_version=report.version or report.parent_version,
            previous_index_version=report.parent_version,
            removed=report.removed,
            not_found=report.not_found,
            index_size=report.size,
        )

    async def reload(self, request: pb.ReloadRequest, who: str = "", via: str = "grpc") -> pb.ReloadResponse:
        if request.restore_taken_down and not request.index_version:
            raise InvalidArgument("restore_taken_down needs index_version: the version whose taken-down items to serve")
        if request.index_version and self._rollback is not None:
            model_dir = request.model_dir or None
            restore = request.restore_taken_down
            return await self._roll_back(request.index_version, model_dir, who, via, restore, make_current=False)
        try:
            old, new = await self._reload(request.index_version or None, request.model_dir or None)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(self._refused(request.index_version, request.model_dir, exc)) from None
        return pb.ReloadResponse(
            index_version=new.version, model_id=new.model_id, previous_index_version=old.version if old else ""
        )

    async def _roll_back(
        self, version: str, model_dir: str | None, who: str, via: str, restore: bool, make_current: bool
    ) -> pb.ReloadResponse:
        if self._rollback is None:
            raise FailedPrecondition("this server cannot make a version live")
        try:
            report, old, new = await self._rollback(version, model_dir, who, via, restore, make_current)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(self._refused(version, model_dir, exc)) from None
        return pb.ReloadResponse(
            index_version=new.version,
            model_id=new.model_id,
            previous_index_version=old.version if old else "",
            reapplied_ids=report.reapplied,
            restored_ids=report.restored,
        )

    def _refused(self, version: str | None, model_dir: str | None, exc: Exception) -> str:
        """A refused reload's message: the candidate it refused, and the pair still serving."""
        candidate = f"index {version or 'CURRENT names'}" + (f" with the model in {model_dir}" if model_dir else "")
        live = self._live() if self._live is not None else None
        serving = f"index {live.version} with model {live.model_id}" if live is not None else "nothing loaded yet"
        return f"reload of {candidate} refused, still serving the old pair ({serving}): {exc}"
