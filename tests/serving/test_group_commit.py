"""Ingests committed in groups (issue 61) on a real server on loopback: AddItems and RemoveItems
calls arriving within `--ingest-window-ms` are published as one version and loaded once; each
call answers once its own items are live, with its own counts; a call whose item the root
refuses fails alone, naming the item, while the calls beside it are published."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from core.artifacts import layout as artifacts
from protos.simsearch.v1 import search_pb2 as pb
from tests.serving.test_ingest import ADMIN, nearest, unit
from tests.support.index import write_catalog_index
from tests.support.server import start

CALLS = 4
# Wide enough that every call below lands in the window on a busy machine (the window opens at
# the first call's arrival, after its own checks): the grouping is what is tested, not the timing.
WINDOW_MS = 3000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("groups"), items=12)
    # These tests count the versions a group publishes: no background merge (a takedown's
    # segment past its deleted share, under --merges tiered) may publish one of its own meanwhile.
    server, client = start(root, admin_token=ADMIN, ingest_window_ms=WINDOW_MS, keep_versions=50, merges="whole")
    yield server, client, root
    client.close()
    server.stop(grace=1)


def at_once(calls):
    """Each of `calls` on a thread of its own, released together; their answers or errors."""
    gate = threading.Barrier(len(calls))

    def run(call):
        gate.wait()
        try:
            return call()
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def item(name: str, seed: int) -> pb.NewItem:
    return pb.NewItem(id=name, embedding=pb.Embedding(values=unit(seed)), metadata={"shade": "2"})


def test_concurrent_adds_within_the_window_publish_one_version_and_each_answers_with_its_items_live(served):
    server, client, root = served
    before = artifacts.list_versions(root)
    live = client.get_info().index_version

    def add(call: int):
        def send():
            reply = client.add_items([item(f"group-{call}-{i}", 500 + 10 * call + i) for i in range(2)])
            # Searched the moment the call answered: its own items are there.
            found = [nearest(client, embedding=pb.Embedding(values=unit(500 + 10 * call + i))) for i in range(2)]
            return reply, [f.neighbors[0].id for f in found]

        return send

    answers = at_once([add(call) for call in range(CALLS)])
    versions = {reply.index_version for reply, _ in answers}
    assert len(versions) == 1, versions  # one version for the group
    assert len(artifacts.list_versions(root)) == len(before) + 1
    for call, (reply, found) in enumerate(answers):
        assert (reply.added, reply.replaced, reply.previous_index_version) == (2, 0, live)
        assert found == [f"group-{call}-0", f"group-{call}-1"]
    assert reply.index_size == client.get_info().index_size


def test_a_call_whose_item_is_refused_fails_alone_and_names_it_while_its_group_is_published(served):
    server, client, root = served
    client.add_items([item("held-already", 600)])
    live = client.get_info().index_version

    def add(items):
        return lambda: client.add_items(items)

    answers = at_once(
        [
            add([item("fine-a", 601)]),
            add([item("fine-b", 602), item("held-already", 603)]),  # all or nothing: fine-b not added
            add([item("fine-c", 604)]),
        ]
    )
    bad = answers[1]
    assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "held-already" in bad.details()
    for name, seed, reply in (("fine-a", 601, answers[0]), ("fine-c", 604, answers[2])):
        assert not isinstance(reply, grpc.RpcError), reply
        assert reply.added == 1 and reply.previous_index_version != ""
        assert nearest(client, embedding=pb.Embedding(values=unit(seed))).neighbors[0].id == name
    assert nearest(client, embedding=pb.Embedding(values=unit(602))).neighbors[0].id != "fine-b"
    assert client.get_info().index_version != live


def test_concurrent_takedowns_by_one_caller_publish_one_version_each_with_its_own_counts(served):
    server, client, root = served
    client.add_items([item(f"gone-{i}", 700 + i) for i in range(3)])
    before = artifacts.list_versions(root)
    answers = at_once(
        [
            lambda: client.remove_items(["gone-0", "not-there"], reason="drill"),
            lambda: client.remove_items(["gone-1"], reason="drill"),
            lambda: client.remove_items(["gone-2"], reason="drill"),
        ]
    )
    assert len({reply.index_version for reply in answers}) == 1
    assert len(artifacts.list_versions(root)) == len(before) + 1
    assert (answers[0].removed, list(answers[0].not_found)) == (1, ["not-there"])
    assert [reply.removed for reply in answers[1:]] == [1, 1]
    for i in range(3):
        assert nearest(client, embedding=pb.Embedding(values=unit(700 + i))).neighbors[0].id != f"gone-{i}"
