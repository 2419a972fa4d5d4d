"""What a request may ask, checked once for every transport: the service layer runs these before
anything is decoded, embedded or searched, and the gRPC servicers and HTTP routes check
nothing themselves."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from core.preprocess import Region, RegionError, open_image, region_box, upright_size
from index.grouping import Groups
from protos.simsearch.v1 import search_pb2 as pb
from serving.engine import Limits, ServingPair
from serving.errors import InvalidArgument, image_errors

# A negative query part's weight when it names none (a positive's is 1). Rocchio weighs
# negatives far below positives (β 0.75, γ 0.15): at 1, one "not like" part pulled the query
# halfway to the opposite of an unrelated item and the answer off its topic (docs/architecture.md,
# "Queries with several parts", has the figures).
NEGATIVE_WEIGHT = 0.2
# The k of a request that leaves it unset (0 in proto3), on every transport and route.
DEFAULT_K = 10
MIN_SCORE_RANGE = (-1.0, 1.0)  # a cosine similarity's


class RequestChecks:
    """A request's parts against the server's limits and the live pair."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def k_of(self, k: int, min_score: float | None) -> int:
        """The k a request asks for, checked: unset (0) is DEFAULT_K (never past max_k), or with
        a min_score up to max_k, for min_score is then what bounds the answer."""
        if k == 0:
            k = self.limits.max_k if min_score is not None else min(DEFAULT_K, self.limits.max_k)
        self.check_k(k)
        return k

    def check_k(self, k: int) -> None:
        if k <= 0:
            raise InvalidArgument(f"k must be at least 1, got {k}")
        if k > self.limits.max_k:
            raise InvalidArgument(f"k={k} exceeds the maximum of {self.limits.max_k}")

    def check_min_score(self, min_score: float) -> float:
        if not MIN_SCORE_RANGE[0] <= min_score <= MIN_SCORE_RANGE[1]:
            raise InvalidArgument(f"min_score must be within [-1, 1] (cosine similarity), got {min_score}")
        return min_score

    def open_image(self, data: bytes) -> Image.Image:
        """Read the header only: the size is checked against the pixel limit, nothing decoded."""
        if len(data) == 0:
            raise InvalidArgument("image bytes are empty")
        with image_errors():
            return open_image(data, self.limits.max_image_pixels, load=False)

    def check_embedding(self, pair: ServingPair, values: list[float] | np.ndarray) -> np.ndarray:
        """The query embedding as a unit vector of the live model's dimension."""
        vector = np.asarray(values, dtype=np.float32)
        if vector.ndim != 1 or len(vector) != pair.dim:
            raise InvalidArgument(f"embedding has dimension {vector.size}, the live model's is {pair.dim}")
        if not np.isfinite(vector).all():
            raise InvalidArgument("embedding contains NaN or infinity")
        # in float64: the norm of float32 values near float32's largest overflows float32 (inf, and
        # the unit vector would be all zeros)
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        if norm == 0.0:
            raise InvalidArgument("embedding is the zero vector")
        return (vector.astype(np.float64) / norm).astype(np.float32)

    def item_vector(self, pair: ServingPair, item_id: str) -> tuple[np.ndarray, int]:
        """An indexed item's stored vector and row: an unknown id is INVALID_ARGUMENT."""
        row = pair.index_version.row_of(item_id)
        if row is None:
            raise InvalidArgument(f"unknown item id {item_id!r}")
        return pair.index_version.vector(row), row

    def groups(self, pair: ServingPair, name: str) -> Groups:
        """The rows grouped by `name`, a field the live version declares."""
        version = pair.index_version
        if name not in version.group_fields:
            declared = ", ".join(version.group_fields) or "none (index build --item-field / --filterable)"
            raise InvalidArgument(
                f"group_by: {name!r} is not a declared field of this index version (declared: {declared})"
            )
        return version.groups(name)

    def check_per_group(self, per_group: int) -> int:
        if not 1 <= per_group <= self.limits.max_per_group:
            raise InvalidArgument(f"per_group must be within 1..{self.limits.max_per_group}, got {per_group}")
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
                raise InvalidArgument(f"parts[{i}]: has no query: set image, embedding or item_id")
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

    def exclude_rows(self, pair: ServingPair, ids: list[str]) -> set[int]:
        """The rows of the ids a request leaves out (ids not indexed leave nothing out)."""
        return {row for row in (pair.index_version.row_of(i) for i in ids) if row is not None}
