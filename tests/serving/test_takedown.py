"""RemoveItems on a real server under concurrent query load: once it returns, no answer holds a
removed item and no request failed; the takedown is a version (rolled back like any other),
audited with the caller's token fingerprint, and `index add --upsert` replaces items in place."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from core.data.items import ItemTable
from index.build.build import run_build
from index.build.config import BuildConfig
from index.versions.audit import AUDIT_LOG
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from tests.support.server import start

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["Flat", "HNSW16"])
def index_root(request, demo_run, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.lower())
    if request.param == "Flat":
        shutil.copytree(demo_run / "index", root, dirs_exist_ok=True)
    else:
        run_build(
            BuildConfig(
                model=str(demo_run / "model"),
                index_root=str(root),
                catalog=str(demo_run / "train" / "splits" / "test.csv"),
                factory=request.param,
                search_params={"efSearch": 64},
            ),
            progress=False,
        )
    return root


def test_no_answer_holds_a_removed_item_once_remove_items_returns(index_root):
    live = IndexVersion.open(index_root).load()
    size = live.size
    server, client = start(index_root, admin_token="t0ken", ann_sample_rate=1.0)
    # The takedown's targets are the queries: each is its own best answer until it is removed.
    # An exact index answers an item's own vector with the item; an approximate one (HNSW) does
    # for most items but not all, and which ones depends on the trained embeddings, so the
    # targets are items the served version answers that way (issue 59). What the server does
    # guarantee is one answer a query a version, checked below across the load.
    candidates = [live.items.ids[r] for r in range(0, size, max(1, size // 48))]
    queries_of = {
        t: pb.SearchRequest(embedding=pb.Embedding(values=live.vector(live.row_of(t)).tolist()), k=5)
        for t in candidates
    }
    targets = [t for t in candidates if client.search(queries_of[t]).neighbors[0].id == t][:12]
    assert len(targets) == 12, f"only {len(targets)} of {len(candidates)} items are their own best answer"
    queries = [queries_of[t] for t in targets]
    answers: list[tuple[float, list[str], str, int]] = []  # (sent at, ids, index version, query)
    failures: list[BaseException] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            sent = time.monotonic()
            try:
                reply = client.search(queries[i % len(queries)])
            except grpc.RpcError as exc:
                failures.append(exc)
                return
            answers.append((sent, [n.id for n in reply.neighbors], reply.index_version, i % len(queries)))
            i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as denied:
            server_client_without_token(server).remove_items(targets)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as empty:
            client.remove_items([])
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ids" in empty.value.details()

        reply = client.remove_items([*targets, "no-such-item"], reason="legal hold 42")
        returned = time.monotonic()
        time.sleep(1.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    try:
        assert not failures, failures[:3]
        assert reply.removed == len(targets) and list(reply.not_found) == ["no-such-item"]
        assert reply.previous_index_version == live.name and reply.index_version != live.name
        assert reply.index_size == size - len(targets)
        later = [a for a in answers if a[0] > returned]
        assert len(later) > 10 and any(a[0] < returned for a in answers)
        assert all(version == reply.index_version for _, _, version, _ in later)
        assert not any(set(ids) & set(targets) for _, ids, _, _ in later)
        assert all(len(ids) == 5 for _, ids, _, _ in later)  # k answers still, from the items left
        # Before the takedown the targets were their own best answers: the test could have failed.
        # "Before" is what the old version answered: on a busy machine the call can return seconds
        # after its version went live, so a clock before its return does not tell (issue 59).
        before = [(ids, query) for _, ids, version, query in answers if version == live.name]
        assert len(before) > 10 and all(ids[0] == targets[query] for ids, query in before)
        # One answer a query a version, whatever else was batched with it.
        for answered in (before, [(ids, query) for _, ids, _, query in later]):
            by_query: dict[int, list[list[str]]] = {}
            for ids, query in answered:
                by_query.setdefault(query, []).append(ids)
            assert all(all(ids == seen[0] for ids in seen) for seen in by_query.values())

        info = client.get_info()
        assert info.index_version == reply.index_version and info.index_size == size - len(targets)
        tombstones = IndexVersion.open(index_root).manifest.deleted_rows
        assert info.deleted_rows == tombstones == len(targets)  # every index type: tombstones, segments linked
        # Every way of asking keeps them out: near-duplicates of a removed item, a batch.
        near = pb.SearchRequest(embedding=queries[0].embedding, min_score=0.5, k=0)
        assert not {n.id for n in client.search(near).neighbors} & set(targets)
        batch = client.search_batch(queries)
        assert not {n.id for r in batch.responses for n in r.neighbors} & set(targets)
        for target in targets:
            with pytest.raises(grpc.RpcError) as unknown:
                client.search_item(target)
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        removed_count = server.metrics.items_removed.collect()[0].samples[0].value
        assert removed_count == len(targets)
        audit = json.loads((index_root / AUDIT_LOG).read_text().splitlines()[-1])
        assert audit["via"] == "grpc" and audit["reason"] == "legal hold 42" and audit["removed"] == len(targets)
        assert audit["who"].startswith("token sha256:") and "t0ken" not in audit["who"]
        assert sorted(audit["ids"]) == sorted(targets)

        # The previous version is kept, but a takedown outlives it: reloading it re-applies the
        # takedown (a version derived from it, without the items), audited as a rollback.
        again = client.reload(index_version=live.name)
        assert sorted(again.reapplied_ids) == sorted(targets) and not again.restored_ids
        assert again.index_version not in (live.name, reply.index_version)
        assert again.index_version == artifacts.current_version(index_root)
        assert client.search(queries[0]).neighbors[0].id not in targets
        audit = json.loads((index_root / AUDIT_LOG).read_text().splitlines()[-1])
        assert (audit["action"], audit["via"], audit["parent_version"]) == ("rollback", "grpc", live.name)
        assert audit["who"].startswith("token sha256:") and sorted(audit["ids"]) == sorted(targets)
        # Only on request does it serve the removed items again, audited by id.
        restored = client.reload(index_version=live.name, restore_taken_down=True)
        assert restored.index_version == live.name and sorted(restored.restored_ids) == sorted(targets)
        assert client.search(queries[0]).neighbors[0].id == targets[0]
        audit = json.loads((index_root / AUDIT_LOG).read_text().splitlines()[-1])
        assert audit["action"] == "restore" and sorted(audit["ids"]) == sorted(targets)
        with pytest.raises(grpc.RpcError) as bare:
            client.reload(restore_taken_down=True)
        assert bare.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.close()
        server.stop(grace=1)


def server_client_without_token(server):
    from serving.client import SearchClient

    return SearchClient(f"127.0.0.1:{server.port}", timeout=30.0)


def index_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "index", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_upsert_replaces_vectors_and_metadata_of_ids_already_indexed(demo_run, index_root, tmp_path):
    catalog = read_catalog(demo_run / "train" / "splits" / "test.csv")
    live = IndexVersion.open(index_root).load()
    indexed = [r for r in range(len(catalog)) if live.row_of(catalog.ids[r]) is not None]
    # Two indexed items get another item's image (a new vector) and new metadata; one is new.
    a, b, c = indexed[0], indexed[1], indexed[2]
    rows = [
        {"id": catalog.ids[a], "path": str(catalog.paths[c]), "label": catalog.labels[a], "colour": "red"},
        {"id": catalog.ids[b], "path": str(catalog.paths[c]), "label": catalog.labels[b], "colour": "blue"},
        {"id": "brand-new", "path": str(catalog.paths[c]), "label": catalog.labels[c], "colour": "green"},
    ]
    changes = tmp_path / "changes.csv"
    changes.write_text(
        "id,path,label,colour\n" + "".join(f"{r['id']},{r['path']},{r['label']},{r['colour']}\n" for r in rows)
    )
    model = str(demo_run / "model")
    plain = index_cli(
        "add", "--model", model, "--index-root", str(index_root), "--catalog", str(changes), "--no-progress"
    )
    assert plain.returncode == 0, plain.stderr  # without --upsert: only the new row is added
    after_plain = IndexVersion.open(index_root).load()
    assert after_plain.manifest.rows.already_indexed == 2 and after_plain.manifest.rows.added == 1
    np.testing.assert_array_equal(
        after_plain.vector(after_plain.row_of(catalog.ids[a])), live.vector(live.row_of(catalog.ids[a]))
    )

    upsert = index_cli(
        "add", "--model", model, "--index-root", str(index_root), "--catalog", str(changes), "--upsert", "--no-progress"
    )
    assert upsert.returncode == 0, upsert.stderr
    new = IndexVersion.open(index_root).load()
    assert new.manifest.rows.replaced == 3 and new.size == after_plain.size
    ids = [new.items.ids[r] for r in range(len(new.items)) if new.live_mask is None or new.live_mask[r]]
    assert len(ids) == len(set(ids))  # one live row per id
    c_vector = live.vector(live.row_of(catalog.ids[c]))
    for item, colour in ((catalog.ids[a], "red"), (catalog.ids[b], "blue"), ("brand-new", "green")):
        row = new.row_of(item)
        assert new.items.metadata[row] == {"colour": colour}
        np.testing.assert_allclose(new.vector(row), c_vector, atol=1e-5)  # the image it now has
    untouched = catalog.ids[indexed[3]]
    np.testing.assert_array_equal(new.vector(new.row_of(untouched)), live.vector(live.row_of(untouched)))
    assert isinstance(new.items, ItemTable) and artifacts.current_version(index_root) == new.name
