"""The monitor keeps measuring under a stream (issue 61): probe queries wait in a lane of their
own, behind every user query; a reload that only grew the live version (an ingest, a takedown)
keeps the online figures, the probe's last round and their sample sizes, and starts no probe
round of its own; a reload of an index that did not grow from it clears them."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.retrieval.metrics import stable_key
from protos.simsearch.v1 import search_pb2 as pb
from serving.monitoring.lineage import grew_from
from serving.search.executors import PROBE_MAX_WAIT_S, BatchedExecutor, SchedulingPolicy
from serving.search.inference import Query, Result, Work
from serving.telemetry.metrics import ServiceMetrics
from tests.serving.test_ingest import ADMIN, unit
from tests.support.index import write_catalog_index
from tests.support.server import derived_version, start, wait_for


class Recorded:
    """An inference thread's stand-in: records each batch's queries (by their `k`) and answers them."""

    def __init__(self) -> None:
        self.metrics = ServiceMetrics()
        self.batches: list[list[int]] = []

    def __call__(self, batch: list[Work], side_by_side: bool = False) -> None:
        self.batches.append([work.query.k for work in batch])


def batched(probes: list[tuple[int, float | None]], users: list[int]) -> list[list[int]]:
    """The batches (each query by its `k`) a paused batcher of batches of 4 forms once resumed,
    given probe queries (k, when enqueued: None for now) and then user queries (k) queued in it."""

    async def scenario() -> list[list[int]]:
        inference = Recorded()
        executor = BatchedExecutor(inference, SchedulingPolicy(max_batch_size=4, streams=1), max_queue=100)
        executor.start()
        executor.pause()
        pair = object()  # one pair for all: a batch never mixes pairs
        works = [
            Work(Query(pair, k=k, background=True), Result(), **({} if at is None else {"enqueued": at}))  # type: ignore[arg-type]
            for k, at in probes
        ]
        works += [Work(Query(pair, k=k), Result()) for k in users]  # type: ignore[arg-type]
        waiting = [asyncio.ensure_future(executor.run(work)) for work in works]
        await asyncio.sleep(0)
        assert executor.queued == len(works)
        executor.resume()
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        await executor.stop()
        return inference.batches

    return asyncio.run(scenario())


def test_a_user_query_is_batched_before_probe_queries_queued_ahead_of_it():
    batches = batched([(100 + i, None) for i in range(6)], [1])
    assert batches[0] == [1]  # the user's query alone, first, though six probes queued before it
    assert sorted(k for batch in batches[1:] for k in batch) == list(range(100, 106))
    assert all(k >= 100 for batch in batches[1:] for k in batch)  # probe batches hold no user query


def figures(info: pb.GetInfoResponse) -> dict[tuple[str, int], tuple[float, int]]:
    return {(f.source, f.k): (round(f.value, 6), f.samples) for f in [*info.recall_at_k, *info.ann_recall_at_k]}


@pytest.fixture
def served(tmp_path):
    root = write_catalog_index(tmp_path, items=12)
    server, client = start(root, admin_token=ADMIN, ingest_window_ms=0, recall_ks=(1, 5))
    yield server, client, root
    client.close()
    server.stop(grace=1)


def marked(client, n: int) -> None:
    """`n` answers marked by Feedback: the feedback figure, over n answers."""
    for seed in range(n):
        answer = client.search(pb.SearchRequest(embedding=pb.Embedding(values=unit(900 + seed)), k=5, group_by=""))
        assert client.feedback(answer.request_id, [answer.neighbors[0].id]).accepted


def test_a_reload_that_only_added_items_keeps_the_figures_and_their_samples_and_starts_no_probe_round(served):
    server, client, root = served
    marked(client, 3)
    assert server.monitor.run_probe(server.run_probe) is None  # unlabelled: the item round only
    before = figures(client.get_info())
    assert before[("feedback", 1)] == (1.0, 3) and before[("probe_items", 1)][1] > 0
    rounds = []
    server.run_probe = lambda: rounds.append(1)  # a probe round after the reload would land here

    client.add_items([pb.NewItem(id="streamed", embedding=pb.Embedding(values=unit(950)), metadata={"shade": "1"})])
    after = client.get_info()
    assert figures(after) == before  # same figures, same sample sizes
    marked(client, 1)  # and the window goes on counting across the reload
    assert figures(client.get_info())[("feedback", 1)] == (1.0, 4)
    assert rounds == []
    history = server.service.history(server.recorder.history)
    assert history["samples"]["feedback"]["1"] == 4 and history["recall"]["feedback"]["1"] == 1.0
    samples = {
        (s.labels["source"], s.labels["k"]): s.value
        for metric in server.metrics.registry.collect()
        for s in metric.samples
        if s.name == "simsearch_recall_samples"
    }
    assert samples[("feedback", "1")] == 4


def test_a_reload_of_an_index_that_did_not_grow_from_the_live_one_clears_the_figures(served):
    server, client, root = served
    marked(client, 2)
    assert figures(client.get_info())[("feedback", 1)] == (1.0, 2)

    live = artifacts.version_dir(root)

    def unrelated(staging, manifest):  # the same rows, but no lineage: a rebuild, as the monitor sees it
        manifest["parent_version"] = manifest["ancestors"] = None
        for extra in live.iterdir():  # what derived_version leaves out (the filter structure)
            if extra.is_file() and not (staging / extra.name).exists():
                shutil.copy2(extra, staging / extra.name)

    server.reload_now(derived_version(root, unrelated))
    assert figures(client.get_info()) == {}


# -- the probe follows the stream: only what changed is asked again ---------------------------


@pytest.fixture
def labelled(tmp_path):
    """A server over 24 labelled images (4 classes), its probe sampling all of them: one round
    at start, the next an hour later."""
    import csv

    from index.build.build import run_build
    from index.build.config import BuildConfig
    from tests.support.index import write_images, write_tiny_model

    paths = write_images(tmp_path / "images", 24)
    catalog = tmp_path / "images" / "catalog.csv"
    with open(catalog, "w", newline="") as out:
        csv.writer(out).writerows(
            [["id", "path", "label"], *([p.stem, p.name, f"class{n % 4}"] for n, p in enumerate(paths))]
        )
    root = tmp_path / "index"
    model = write_tiny_model(tmp_path / "model")
    run_build(
        BuildConfig(model=str(model), index_root=str(root), catalog=str(catalog), min_ann_recall=0), progress=False
    )
    server, client = start(
        root, admin_token=ADMIN, ingest_window_ms=0, recall_ks=(1, 5), probe_interval_s=3600, probe_size=24
    )
    wait_for(lambda: ("probe", 1) in figures(client.get_info()))
    yield server, client, root, paths
    client.close()
    server.stop(grace=1)


def probe_figures(client) -> dict[int, tuple[float, int]]:
    return {k: value for (source, k), value in figures(client.get_info()).items() if source == "probe"}


def caught_up(server) -> bool:
    """The probe's last round describes the live load (a full round, or one brought up to it)."""
    probed = server.prober._round
    return probed is not None and probed.serial == server.engine.pair.serial


def test_an_ingest_and_a_takedown_bring_the_probe_up_to_date_asking_again_only_the_queries_they_touched(labelled):
    server, client, root, paths = labelled
    rounds = []
    whole_round = server.prober.run
    server.prober.run = lambda loop: rounds.append(1) or whole_round(loop)
    before = probe_figures(client)
    assert before[1][1] == 24  # every image, once
    version = server.engine.pair.index_version
    misses = []  # probe items whose own best other neighbour has another label
    for path in paths:
        answer = client.search(pb.SearchRequest(image=path.read_bytes(), k=1, exclude_ids=[path.stem], group_by=""))
        if answer.neighbors[0].label != version.items.labels[version.row_of(path.stem)]:
            misses.append(path.stem)
    twins = misses[:3]  # each one's exact vector again, under its own label: its query's new best answer
    assert twins
    last = max(stable_key(path.stem) for path in paths)
    # Twins' ids rank after the sample's in the stable order: the next whole round samples the same items.
    names = {i: next(f"twin-{i}-{n}" for n in range(10**6) if stable_key(f"twin-{i}-{n}") > last) for i in twins}
    client.add_items([
        pb.NewItem(id=names[i], embedding=pb.Embedding(values=version.vector(version.row_of(i)).tolist()),
                   label=version.items.labels[version.row_of(i)])
        for i in twins
    ])  # fmt: skip
    wait_for(lambda: caught_up(server))
    grown = probe_figures(client)
    assert grown[1] == (round(before[1][0] + len(twins) / 24, 6), 24)
    assert rounds == []  # no whole round: the change was measured
    assert len(twins) <= server.prober.asked_again < 24
    assert server.monitor.run_probe(server.run_probe) is not None  # a whole round agrees, at every K
    assert probe_figures(client) == grown

    client.remove_items(list(names.values()))
    wait_for(lambda: caught_up(server) and probe_figures(client)[1] == before[1])
    assert len(twins) <= server.prober.asked_again < 24
    assert len(rounds) == 1
    assert probe_figures(client) == before


def test_probe_queries_waiting_past_their_bound_go_ahead_of_a_queue_that_never_empties():
    long_ago = time.perf_counter() - PROBE_MAX_WAIT_S - 1
    batches = batched([(100, long_ago), (101, long_ago)], list(range(1, 9)))
    assert batches[0] == [100, 101]  # the probes' batch first: they waited past the bound
    assert [k for batch in batches[1:] for k in batch] == list(range(1, 9))


def test_a_version_grew_from_one_whose_descendants_were_pruned_since_and_a_rollback_did_not(tmp_path):
    root = write_catalog_index(tmp_path, items=6)
    server, client = start(root, admin_token=ADMIN, ingest_window_ms=0, keep_versions=2, merges="whole")
    try:
        built = IndexManifest.read(artifacts.version_dir(root))
        seen = [built]
        for n in range(4):  # each publishes a version; two are kept
            client.add_items([pb.NewItem(id=f"streamed-{n}", embedding=pb.Embedding(values=unit(960 + n)))])
            seen.append(IndexManifest.read(artifacts.version_dir(root)))
        assert not (root / artifacts.VERSIONS / seen[2].version).exists()  # the line between is gone
        assert grew_from(root, built, seen[-1]) and grew_from(root, seen[1], seen[-1])
        assert not grew_from(root, seen[-1], seen[1])  # an older version did not grow from a newer one
        server._call(server.rollback(seen[-2].version, None, "test", "test", restore=False, make_current=True))
        back = IndexManifest.read(artifacts.version_dir(root))
        assert back.version != seen[-1].version and not grew_from(root, seen[-1], back)
    finally:
        client.close()
        server.stop(grace=1)


def test_a_late_reload_of_a_version_the_live_one_grew_from_loads_nothing_and_keeps_the_figures(served):
    """Two workers' writes published back to back: the first's relayed reload reached the other
    worker after it had loaded the second's version, loaded the earlier one and cleared every
    figure (10 ingest callers at 1M rows: traffic samples 1,555 → 256)."""
    server, client, root = served
    earlier = server.engine.pair.version
    client.add_items([pb.NewItem(id="later", embedding=pb.Embedding(values=unit(970)), metadata={"shade": "1"})])
    marked(client, 2)
    before, pair = figures(client.get_info()), server.engine.pair
    assert pair.version != earlier and earlier in pair.manifest.ancestors
    server._call(server.reload(earlier, unless_live=True))
    assert server.engine.pair is pair and figures(client.get_info()) == before
    server._call(server.reload(earlier))  # a Reload call loads what it names, even an older version
    assert server.engine.pair.version == earlier


def test_a_reload_of_the_live_version_by_the_watcher_or_a_write_loads_nothing_and_keeps_the_figures(served):
    """A write's own reload and the CURRENT watcher's can name one version: the second loaded it
    again and cleared every figure (mid-stream, a server of worker processes showed 275 traffic
    samples where it had 1,218)."""
    server, client, root = served
    marked(client, 2)
    before, pair = figures(client.get_info()), server.engine.pair
    assert before[("feedback", 1)] == (1.0, 2)
    server._call(server.reload(pair.version, unless_live=True))
    assert server.engine.pair is pair and figures(client.get_info()) == before
