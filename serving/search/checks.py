"""What a request may ask, checked once for every transport: the service layer checks a request
at its entry — `RequestChecks.search` turns a SearchRequest into a `CheckedSearch` — before
anything is decoded, embedded or searched, and works from that alone; the gRPC servicers and
HTTP routes check nothing themselves."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from core.data.preprocess import Region, RegionError, open_image, region_box, upright_size
from core.data.text import TextInputError
from index.search.grouping import Groups
from index.versions.version import ItemLocation
from protos.simsearch.v1 import search_pb2 as pb
from serving.errors import FailedPrecondition, InvalidArgument, at_place, image_errors
from serving.search.answers import EVERY_ROW, Exclusion, Scope
from serving.search.engine import Limits, ServingPair
from serving.search.filter_masks import FilterMasks, to_filter
from serving.search.version_view import VersionView

# A negative query part's weight when it names none (a positive's is 1). Rocchio weighs
# negatives far below positives (β 0.75, γ 0.15): at 1, one "not like" part pulled the query
# halfway to the opposite of an unrelated item and the answer off its topic (docs/architecture.md,
# "Queries with several parts", has the figures).
NEGATIVE_WEIGHT = 0.2
# The k of a request that leaves it unset (0 in proto3), on every transport and route.
DEFAULT_K = 10
MIN_SCORE_RANGE = (-1.0, 1.0)  # a cosine similarity's
# Items one AddItems call may carry. Each call publishes a version (a segment, and a reload),
# so many small calls cost more than few large ones; but a call embeds its images and holds
# the root's one writer until it is served, and a bound keeps that to seconds, beside queries.
MAX_ADD_ITEMS = 1_000


@dataclass(frozen=True)
class CheckedImage:
    """An image to embed: opened, its header only (its size within the pixel limit), and the
    region of it to embed, checked against its size as seen (None: all of it)."""

    image: Image.Image
    crop: Region | None = None
    data: bytes = b""  # as the request sent it: what an embedder that decodes images is sent


@dataclass(frozen=True)
class CheckedPart:
    """One part of a query with several parts: its signed weight (negative: "not like"), and its
    vector — an embedding, or an indexed item's stored one (`item`: its id and where it lives) —
    or its image."""

    weight: float
    vector: np.ndarray | None = None
    item: tuple[str, ItemLocation] | None = None
    image: CheckedImage | None = None
    text_ids: np.ndarray | None = None  # a text part's token ids, for the pair's text model


@dataclass(frozen=True)
class CheckedSearch:
    """A SearchRequest checked against the limits and the pair that answers it: what the rest of
    the service works from, trusting it."""

    pair: ServingPair
    k: int
    scope: Scope  # the filter's rows, min_score, group_by and per_group
    exclude: Exclusion  # the excluded ids, and the query's own items (their groups, grouped)
    kind: str  # "image", "embedding", "item_id", "text" or "parts"
    vector: np.ndarray | None = None  # an embedding's (a unit vector) or an item's
    image: CheckedImage | None = None
    text_ids: np.ndarray | None = None  # a text query's token ids, for the pair's text model
    parts: tuple[CheckedPart, ...] = ()
    label: str | None = None  # the query's true label, scored into the traffic Recall@K
    request_id: str = ""  # as the request gave it ("": one is made up for the answer)
    allow_partial: bool = False  # a sharded server may answer from the shards that answered


def left_out(excluded_ids: frozenset[str], own: list[tuple[str, ItemLocation]]) -> Exclusion:
    """What a query leaves out: the ids it excludes, and its own items — each one's id and,
    grouped (located with the group-by field's value), its group."""
    groups = frozenset(found.value for _, found in own if found.value is not None)
    return Exclusion(ids=excluded_ids | {item_id for item_id, _ in own}, groups=groups)


def check_item_count(count: int) -> None:
    """An AddItems call's number of items, 1..MAX_ADD_ITEMS: checked before any item is read, so
    a call over the limit is refused at once, not after its images are decoded."""
    if not count:
        raise InvalidArgument("items: empty; give the items to add")
    if count > MAX_ADD_ITEMS:
        raise InvalidArgument(f"{count} items exceed the limit of {MAX_ADD_ITEMS} a call; send them in several calls")


class RequestChecks:
    """A request's parts against the server's limits and the live pair."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.filter_masks = FilterMasks()

    def search_batch(self, requests: list[pb.SearchRequest], pair: ServingPair, named: bool) -> list[CheckedSearch]:
        """Each request checked, in order, before any is answered. `named`: a request's own error
        names its place in the list (`requests[3]: …`)."""
        if not named:
            return [self.search(request, pair) for request in requests]
        checked = []
        for i, request in enumerate(requests):
            with at_place(i):
                checked.append(self.search(request, pair))
        return checked

    def check_batch_size(self, queries: int) -> None:
        if queries > self.limits.max_batch_queries:
            raise InvalidArgument(f"{queries} queries exceed the batch limit of {self.limits.max_batch_queries}")

    def search(self, request: pb.SearchRequest, pair: ServingPair) -> CheckedSearch:
        """A SearchRequest checked, its first fault an INVALID_ARGUMENT (an image past the pixel
        limit: PayloadTooLarge); its image opened, its ids looked up, its filter's rows found."""
        if request.HasField("label") and not (pair.index_version.labelled or pair.manifest.item_field):
            raise InvalidArgument(
                "label: this index version's rows have no label and no item field, so a labelled query cannot be "
                "scored on it; leave label out (index build --item-field names the column a label would match)"
            )
        scope = self.scope(request, pair)
        k = self.k_of(request.k, scope.min_score)
        excluded = frozenset(request.exclude_ids)  # ids not indexed leave nothing out
        group_by = scope.group_by
        kind = request.WhichOneof("query")
        if request.HasField("region") and kind != "image":
            raise InvalidArgument(f"region crops an image query; this query is {kind or 'a set of parts'}")
        label = request.label if request.HasField("label") else None
        checked = functools.partial(
            CheckedSearch, pair, k, scope, label=label, request_id=request.request_id,
            allow_partial=request.allow_partial,
        )  # fmt: skip
        if request.parts:
            if kind is not None:
                raise InvalidArgument(f"set either {kind} or parts, not both")
            parts = self.parts(pair, list(request.parts), group_by)
            own = [part.item for part in parts if part.item is not None]
            return checked(left_out(excluded, own), "parts", parts=parts)
        exclude = Exclusion(ids=excluded)
        if kind == "image":
            region = request.region if request.HasField("region") else None
            return checked(exclude, kind, image=self.image(pair, request.image, region))
        if kind == "embedding":
            return checked(exclude, kind, vector=self.check_embedding(pair, request.embedding.values))
        if kind == "item_id":
            found = self.item(pair, request.item_id, group_by)
            return checked(left_out(excluded, [(request.item_id, found)]), kind, vector=found.vector)
        if kind == "text":
            return checked(exclude, kind, text_ids=self.text_ids(pair, request.text))
        raise InvalidArgument("request has no query: set image, embedding, item_id, text or parts")

    def scope(self, request: pb.SearchRequest, pair: ServingPair) -> Scope:
        """The rows a request may be answered with: its filter's matches, at or above its
        min_score; grouped by its group_by field (the index's item field unless it says)."""
        min_score = None
        if request.HasField("min_score"):
            min_score = self.check_min_score(float(request.min_score))
        allowed, kept = None, None
        if request.HasField("filter"):
            allowed = self.filter_masks.mask(pair, request.filter)
            kept = to_filter(request.filter)  # what a sharded search sends its shards
        group_by = request.group_by if request.HasField("group_by") else pair.manifest.item_field or ""
        if not group_by:
            if request.HasField("per_group"):
                raise InvalidArgument("per_group needs group_by (this index has no item field to group by)")
            return Scope(allowed, min_score, filter=kept) if kept is not None or min_score is not None else EVERY_ROW
        per_group = self.check_per_group(request.per_group if request.HasField("per_group") else 1)
        return Scope(allowed, min_score, self.groups(pair, group_by), per_group, kept, group_by)

    def image(self, pair: ServingPair, data: bytes, region: pb.Region | None = None) -> CheckedImage:
        """An image to embed (the region of it, when given), opened but not decoded."""
        image = self.open_image(data)
        crop = None
        if region is not None:
            crop = self.check_region(region, image, pair.embedder.contract.exif_orientation)
        return CheckedImage(image, crop, data)

    def new_items(self, pair: ServingPair, items: list[pb.NewItem]) -> list[CheckedImage | np.ndarray]:
        """An AddItems call's items checked, each error naming its item (`items[3]: …`): at most
        MAX_ADD_ITEMS, each with an id and an image (opened, its header only) or an embedding (a
        unit vector of the live model's dimension), labelled all or none. What they are, in
        order: a checked image to embed, or the embedding's unit vector."""
        check_item_count(len(items))
        checked: list[CheckedImage | np.ndarray] = []
        for i, item in enumerate(items):
            with at_place(i, "items"):
                if not item.id:
                    raise InvalidArgument("id is empty; every item needs its id")
                kind = item.WhichOneof("content")
                if kind == "embedding":
                    checked.append(self.check_embedding(pair, item.embedding.values))
                elif kind == "image":
                    checked.append(self.image(pair, item.image))
                else:
                    raise InvalidArgument(f"item {item.id!r} has neither image nor embedding; set one")
        labelled = [item.HasField("label") for item in items]
        if any(labelled) and not all(labelled):
            raise InvalidArgument(
                f"items[{labelled.index(False)}]: has no label and items[{labelled.index(True)}] has one; a "
                "version's items are all labelled or none are"
            )
        return checked

    def parts(
        self, pair: ServingPair, parts: list[pb.QueryPart], group_by: str | None = None
    ) -> tuple[CheckedPart, ...]:
        """A query's parts checked, as a whole (`check_parts`) then each in turn (an item part
        located with its value of `group_by`, the query's grouping); a part's error names the part."""
        weights = self.check_parts(parts)
        checked = []
        for i, (weight, part) in enumerate(zip(weights, parts, strict=True)):
            try:
                kind = part.WhichOneof("query")
                if kind == "embedding":
                    checked.append(CheckedPart(weight, self.check_embedding(pair, part.embedding.values)))
                elif kind == "item_id":
                    found = self.item(pair, part.item_id, group_by)
                    checked.append(CheckedPart(weight, found.vector, (part.item_id, found)))
                elif kind == "text":
                    checked.append(CheckedPart(weight, text_ids=self.text_ids(pair, part.text)))
                else:
                    region = part.region if part.HasField("region") else None
                    checked.append(CheckedPart(weight, image=self.image(pair, part.image, region)))
            except InvalidArgument as exc:
                raise InvalidArgument(f"parts[{i}]: {exc}") from None
        return tuple(checked)

    def k_of(self, k: int, min_score: float | None) -> int:
        """The k a request asks for, checked: unset (0) is DEFAULT_K (never past max_k), or with
        a min_score up to max_k, for min_score is then what bounds the answer."""
        if k == 0:
            k = self.limits.max_k if min_score is not None else min(DEFAULT_K, self.limits.max_k)
        self.check_k(k)
        return k

    def check_k(self, k: int) -> None:
        """k within 1..max_k: the one message for every transport and spelling (a query string's
        k past int32 is checked here too, before it could be a SearchRequest's)."""
        if not 1 <= k <= self.limits.max_k:
            raise InvalidArgument(f"k must be within 1..{self.limits.max_k}, got {k}", "k")

    def check_min_score(self, min_score: float) -> float:
        if not MIN_SCORE_RANGE[0] <= min_score <= MIN_SCORE_RANGE[1]:
            raise InvalidArgument(f"min_score must be within [-1, 1] (cosine similarity), got {min_score}", "min_score")
        return min_score

    def open_image(self, data: bytes) -> Image.Image:
        """Read the header only: the size is checked against the pixel limit, nothing decoded."""
        if len(data) == 0:
            raise InvalidArgument("image bytes are empty")
        with image_errors():
            return open_image(data, self.limits.max_image_pixels, load=False)

    def check_embedding(self, pair: ServingPair, values: list[float] | np.ndarray) -> np.ndarray:
        """The query embedding as a unit vector of the live model's dimension."""
        if isinstance(values, np.ndarray):
            vector = np.asarray(values, dtype=np.float32)
        else:  # a protobuf repeated field: fromiter reads it in C, asarray goes element by element
            vector = np.fromiter(values, dtype=np.float32, count=len(values))
        if vector.ndim != 1 or len(vector) != pair.dim:
            raise InvalidArgument(f"embedding has dimension {vector.size}, the live model's is {pair.dim}")
        if not np.isfinite(vector).all():
            raise InvalidArgument("embedding contains NaN or infinity")
        # in float64: the norm of float32 values near float32's largest overflows float32 (inf, and
        # the unit vector would be all zeros). A dot product, not np.linalg.norm: same sum, a
        # fifth of the call's overhead.
        wide = vector.astype(np.float64)
        norm = float(np.sqrt(wide @ wide))
        if norm == 0.0:
            raise InvalidArgument("embedding is the zero vector")
        return (wide / norm).astype(np.float32)

    def text_ids(self, pair: ServingPair, text: str) -> np.ndarray:
        """A text query's token ids for the pair's text model: FAILED_PRECONDITION when the version
        has none, INVALID_ARGUMENT for an empty text or one past the model's context."""
        if pair.text is None:
            raise FailedPrecondition(
                f"index version {pair.version} has no text model, so it cannot answer text: train one for model "
                f"{pair.model_id} (python -m training train-text), export it (training export --text) and build "
                "the index with it (index build --text-model DIR)"
            )
        try:
            return pair.text.tokenizer.encode([text])[0]
        except TextInputError as exc:
            raise InvalidArgument(str(exc), "text") from None

    def item(self, pair: ServingPair, item_id: str, group_by: str | None = None) -> ItemLocation:
        """An indexed item's row, stored vector and value of `group_by`, wherever the version
        holds it (on `serve --ray`, the shard holding it): an unknown id is INVALID_ARGUMENT."""
        found = pair.index_version.locate(item_id, group_by)
        if found is None:
            raise InvalidArgument(f"unknown item id {item_id!r}")
        return found

    def groups(self, pair: ServingPair, name: str) -> Groups | None:
        """The rows grouped by `name`, a field the live version declares (None where its rows
        are not held here: a sharded server's shards group their own)."""
        version: VersionView = pair.index_version
        if name not in version.group_fields:
            declared = ", ".join(version.group_fields) or "none (index build --item-field / --filterable)"
            raise InvalidArgument(
                f"group_by: {name!r} is not a declared field of this index version (declared: {declared})"
            )
        return version.groups(name)

    def check_per_group(self, per_group: int) -> int:
        if not 1 <= per_group <= self.limits.max_per_group:
            raise InvalidArgument(
                f"per_group must be within 1..{self.limits.max_per_group}, got {per_group}", "per_group"
            )
        return per_group

    def check_region(self, region: pb.Region, image: Image.Image, upright: bool) -> Region:
        """A request's region of an opened image (header only), checked against its size as seen."""
        box = (region.x, region.y, region.width, region.height)
        try:
            region_box(box, upright_size(image) if upright else image.size)
        except RegionError as exc:
            raise InvalidArgument(str(exc)) from None
        return box

    def check_parts(self, parts: list[pb.QueryPart]) -> list[float]:
        """Each part's signed weight: at most max_query_parts parts, weights finite and above 0,
        a region only on an image part, and at least one positive part."""
        if len(parts) > self.limits.max_query_parts:
            raise InvalidArgument(f"{len(parts)} query parts exceed the maximum of {self.limits.max_query_parts}")
        signed = []
        for i, part in enumerate(parts):
            kind = part.WhichOneof("query")
            if kind is None:
                raise InvalidArgument(f"parts[{i}]: has no query: set image, embedding, item_id or text")
            if part.HasField("region") and kind != "image":
                raise InvalidArgument(f"parts[{i}]: a region crops an image; this part is an {kind}")
            weight = part.weight if part.HasField("weight") else (NEGATIVE_WEIGHT if part.negative else 1.0)
            if not math.isfinite(weight) or weight <= 0:
                raise InvalidArgument(
                    f"parts[{i}]: weight must be a finite number above 0, got {weight} (mark a part negative instead)"
                )
            signed.append(-weight if part.negative else weight)
        if all(w < 0 for w in signed):
            raise InvalidArgument("query parts are all negative: give at least one positive part")
        return signed
