"""`serve --ray`'s shard calls without a cluster: `RayShards` over fake handles tries a failed
call again, never one the version itself refuses, and locating an item goes the same way; an
exception said in one line (`failure_reason`) and a shard named as its deployment is."""

from __future__ import annotations

import numpy as np
import pytest

from index.versions.version import ItemLocation
from serving.errors import Unavailable
from serving.logs import failure_reason, shard_label
from serving.ray_serve.deployment import _cause
from serving.ray_serve.handles import RayShards
from serving.ray_serve.replicas import shard_deployment
from serving.shards.messages import ShardRequest, ShardScope
from serving.telemetry.metrics import ServiceMetrics
from tests.support.shards import Answered


class _Handle:
    """A shard deployment's handle: each call's outcome the next of `outcomes` (the last repeats)."""

    def __init__(self, *outcomes) -> None:
        self.outcomes = list(outcomes)
        self.sent: list[tuple[str, str, object]] = []
        self.by_reference: list[bool] = []  # each call's: its answer through the object store

    def options(self, method_name: str, _by_reference: bool = True) -> _Handle.Method:
        return _Handle.Method(self, method_name, _by_reference)

    class Method:
        def __init__(self, handle: _Handle, name: str, by_reference: bool = True) -> None:
            self.handle, self.name, self.by_reference = handle, name, by_reference

        def remote(self, version: str, argument: object) -> Answered:
            handle = self.handle
            handle.sent.append((self.name, version, argument))
            handle.by_reference.append(self.by_reference)
            return Answered(handle.outcomes.pop(0) if len(handle.outcomes) > 1 else handle.outcomes[0])


def shards(*handles: _Handle, retries: int = 2) -> RayShards:
    return RayShards(list(handles), timeout_s=5.0, retries=retries, metrics=ServiceMetrics())


def located(row: int) -> ItemLocation:
    return ItemLocation(row, np.full(4, row, dtype=np.float32), "v")


def test_an_item_is_located_again_on_another_replica():
    item = located(7)
    flaky = _Handle(RuntimeError("replica gone"), item)
    assert shards(_Handle(None), flaky).locate("v1", "id7", "shade", [1]) is item
    assert flaky.sent == [("locate", "v1", ("id7", "shade")), ("locate", "v1", ("id7", "shade"))]


def test_an_item_a_shard_refuses_is_not_tried_again():
    refusing = _Handle(ValueError("bad version"))
    with pytest.raises(ValueError, match="bad version"):
        shards(refusing).locate("v1", "id7", None, [0])
    assert len(refusing.sent) == 1


def test_an_item_no_replica_answers_is_unavailable_unless_another_shard_holds_it():
    dead = _Handle(RuntimeError("replica gone"))
    with pytest.raises(Unavailable, match="shard 000 did not answer for item 'id7': RuntimeError: replica gone"):
        shards(dead, _Handle(None), retries=2).locate("v1", "id7", None, [0, 1])
    assert len(dead.sent) == 3
    # Ids are unique among live rows: the shard that holds it answers for it, whatever the others did.
    item = located(9)
    assert shards(dead, _Handle(item), retries=0).locate("v1", "id7", None, [0, 1]) is item
    assert shards(_Handle(None), _Handle(None)).locate("v1", "id7", None, [0, 1]) is None


def test_a_fan_out_answers_each_shard_in_order():
    answers = shards(_Handle("a"), _Handle(ValueError("bad version")), _Handle(RuntimeError("x"), "c")).call(
        "search", "v1", "request"
    )
    assert answers[0] == "a" and isinstance(answers[1], ValueError) and answers[2] == "c"


def test_an_exception_in_one_line():
    remote = RuntimeError("Traceback (most recent call last):\n  File 'x'\n\nArtifactError: shard 001 is damaged\n")
    assert failure_reason(remote) == "RuntimeError: ArtifactError: shard 001 is damaged"
    assert failure_reason(remote, typed=False) == "ArtifactError: shard 001 is damaged"
    assert failure_reason(remote, typed=False, first=True) == "Traceback (most recent call last):"
    assert failure_reason(TimeoutError()) == "TimeoutError"
    assert failure_reason(TimeoutError(), typed=False) == "TimeoutError"
    assert _cause(remote, "001", "v1") == "shard 001 is damaged"
    assert _cause(RuntimeError("checksum mismatch"), "002", "v1") == "shard 002 of version v1: checksum mismatch"


def test_a_shards_deployment_is_named_by_its_label():
    assert (shard_label(3), shard_deployment(3)) == ("003", "shard-003")


def test_a_call_whose_answer_may_pass_the_message_limit_goes_through_the_object_store():
    """Serve's inter-deployment gRPC refuses a reply over its limit: a call whose answer may pass it
    (the most hits it can hold × its version's most bytes a hit, from `warm`) goes by reference."""
    handle = _Handle("answer")
    reach = shards(handle)
    reach.warmed("v1", {"hit_bytes": 300})
    reach.warmed("v1", {"hit_bytes": 200})  # another replica's: the most of them counts
    scope = ShardScope(group_by="item", per_group=4)

    def request(queries: int, k: int) -> ShardRequest:
        return ShardRequest(np.zeros((queries, 4), np.float32), k, None, [scope], [0] * queries, [])

    fits = reach.reply_bytes // (300 * 4 * 10)  # queries of k 10, 4 rows a group, that fit
    reach.call("search", "v1", request(fits, 10))
    reach.call("search", "v1", request(fits + 1, 10))
    reach.call("search", "v2", request(fits + 1, 10))  # a version no replica warmed: its hits' size unknown
    assert handle.by_reference == [False, True, False]
    assert request(3, 10).most_hits() == 120
