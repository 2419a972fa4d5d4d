"""A request's filter: the protocol's `pb.Filter` as the index layer's (`index.search.filters`), and the
rows it allows on the live pair, kept for the filters repeated by many queries."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from index.search import filters
from protos.simsearch.v1 import search_pb2 as pb
from serving.errors import InvalidArgument
from serving.search.engine import ServingPair
from serving.search.version_view import VersionView


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

    def mask(self, pair: ServingPair, message: pb.Filter) -> np.ndarray | None:
        """The rows `message` allows on the pair — checked, as INVALID_ARGUMENT naming the field;
        None where the version holds no filter index here (a sharded server's ingress: each shard
        makes its own mask from the filter, `serving.shards.searcher`)."""
        key = (pair.serial, message.SerializeToString(deterministic=True))
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            return mask
        if not pair.manifest.filterable:
            raise InvalidArgument("filter: this index version declares no filterable fields (index build --filterable)")
        try:
            version: VersionView = pair.index_version
            held = version.filters
            if held is None:
                filters.check_filter(to_filter(message), filters.specs_of(pair.manifest.filterable))
                return None
            mask = held.mask(to_filter(message))
        except filters.FilterError as exc:
            raise InvalidArgument(str(exc)) from None
        mask.flags.writeable = False
        self._masks[key] = mask
        while len(self._masks) > self.size:
            self._masks.popitem(last=False)
        return mask
