"""What a request may ask, checked once for every transport: the service layer runs these before
anything is decoded, embedded or searched, and the gRPC servicers and HTTP routes check
nothing themselves."""

from __future__ import annotations

import numpy as np
from PIL import Image

from core.preprocess import open_image
from serving.engine import Limits, ServingPair
from serving.errors import InvalidArgument, image_errors


class RequestChecks:
    """A request's parts against the server's limits and the live pair."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def check_k(self, k: int) -> None:
        if k <= 0:
            raise InvalidArgument(f"k must be at least 1, got {k}")
        if k > self.limits.max_k:
            raise InvalidArgument(f"k={k} exceeds the maximum of {self.limits.max_k}")

    def check_min_score(self, min_score: float) -> float:
        if not -1.0 <= min_score <= 1.0:
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
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            raise InvalidArgument("embedding is the zero vector")
        return vector / norm

    def item_vector(self, pair: ServingPair, item_id: str) -> tuple[np.ndarray, int]:
        """An indexed item's stored vector and row: an unknown id is INVALID_ARGUMENT."""
        row = pair.index_version.row_of(item_id)
        if row is None:
            raise InvalidArgument(f"unknown item id {item_id!r}")
        return pair.index_version.vector(row), row

    def exclude_rows(self, pair: ServingPair, ids: list[str]) -> set[int]:
        """The rows of the ids a request leaves out (ids not indexed leave nothing out)."""
        return {row for row in (pair.index_version.row_of(i) for i in ids) if row is not None}
