"""Segmented versions (index/versions/segments.py): an add writes one new segment and links the rest, a
removal writes tombstones alone, compaction merges a shard's segments on Ray — and a version of
several segments answers as the same rows compacted into one index do (Flat: to the id; IVF-PQ
and HNSW within a recall tolerance), at S = 1 and S = 4, through every kind of search the
version offers."""

from __future__ import annotations

import json
import os

import faiss
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable, hashed_matches, id_array
from core.retrieval.vectors import RowBlocks, l2_normalized
from index.changes.add import add_vectors
from index.changes.lifecycle import compact_version, remove_items
from index.search.faiss_search import search_within
from index.search.filters import Condition, Filter
from index.search.grouping import search_groups
from index.versions import segments
from index.versions.version import IndexVersion
from tests.support import shards as support

N, DIM, ITEMS, K = 1200, 16, 300, 10
FACTORIES = {"flat": ("Flat", {}), "ivf-pq": ("IVF8,PQ4", {"nprobe": 8}), "hnsw": ("HNSW16", {"efSearch": 64})}

pytestmark = pytest.mark.usefixtures("local_ray")  # sharded builds and compaction run Ray tasks


def _more(count: int, seed: int, first: int = N) -> tuple[np.ndarray, ItemTable]:
    vectors, table = support.catalog(count, DIM, ITEMS, seed=seed)
    ids = [f"id{first + i:05d}" for i in range(count)]
    return vectors, ItemTable(ids, None, list(table.paths), list(table.metadata))


def _grown(root, factory, params, shards, adds=3, per_add=40):
    """A version built over N rows, then `adds` adds of `per_add` rows; the rows in order."""
    data = support.catalog(N, DIM, ITEMS)
    model = support.model(root / "model", DIM)
    support.publish(root / "index", data, model, shards, factory, params)
    vectors, ids = [data[0]], list(data[1].ids)
    for number in range(adds):
        extra, items = _more(per_add, seed=10 + number, first=N + number * per_add)
        add_vectors(root / "index", extra, items, max_segments=100)
        vectors.append(extra)
        ids += list(items.ids)
    return np.concatenate(vectors), ids


def _top(version: IndexVersion, queries: np.ndarray, k: int = K, allowed=None) -> list[list[str]]:
    mask = np.ones(len(version.items), dtype=bool) if allowed is None else allowed.copy()
    if version.live_mask is not None:
        mask &= version.live_mask
    _, rows, _ = search_within(version.searchable(), version.vectors, queries, k, mask, exact_below=0.0)
    return [[version.items.ids[int(r)] for r in line if r >= 0] for line in rows]


@pytest.mark.parametrize("shards", [1, 4])
def test_an_add_writes_one_segment_and_links_every_row_it_keeps(tmp_path, shards):
    data = support.catalog(N, DIM, ITEMS)
    model = support.model(tmp_path / "model", DIM)
    parent = IndexVersion(support.publish(tmp_path / "index", data, model, shards)).load()
    extra, items = _more(10, seed=5)
    report = add_vectors(tmp_path / "index", extra, items)
    child = IndexVersion(report.version).load(dim=DIM)
    assert child.size == N + 10 and child.manifest.schema_version == 3
    assert child.manifest.parent_version == parent.name
    # Written: the ten rows (640 bytes of floats) with their index, items and filters, and tombstones.
    assert report.bytes_written < 60_000
    linked = 0
    for path in child.directory.rglob("*"):
        if path.is_file() and path.stat().st_nlink > 1:
            linked += path.stat().st_size
    assert linked >= (parent.directory / (artifacts.SHARDS if shards > 1 else "")).stat().st_size
    # Every row keeps its vector; the new ones answer for themselves.
    for row in (0, N // 2, N - 1):
        np.testing.assert_array_equal(child.vector(child.row_of(parent.items.ids[row])), parent.vector(row))
    assert _top(child, extra[:3], 1) == [[i] for i in list(items.ids)[:3]]
    # The manifest round-trips and an old reader is refused by its schema version.
    written = json.loads((child.directory / artifacts.MANIFEST).read_text())
    assert written["schema_version"] == 3
    assert IndexManifest.from_dict(written, child.directory / artifacts.MANIFEST).to_dict() == written


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("shards", [1, 4])
def test_segments_answer_as_the_same_rows_compacted(tmp_path, monkeypatch, kind, shards):
    factory, params = FACTORIES[kind]
    if kind == "ivf-pq":  # segments of its own kind, not Flat ones, however small
        monkeypatch.setattr(segments, "FLAT_SEGMENT_ROWS", 1)
    vectors, ids = _grown(tmp_path, factory, params, shards)
    segmented = IndexVersion.open(tmp_path / "index").load(dim=DIM)
    counts = [len(e.segments) for e in segmented.manifest.shards] if shards > 1 else [len(segmented.manifest.segments)]
    assert max(counts) == 4 and segmented.size == len(ids)
    if kind == "ivf-pq":  # new segments are coded by the version's trained quantizer
        first = segmented.shard(0) if shards > 1 else segmented
        centroids = []
        for number in range(len(first.segment_entries)):
            index = first.segment(number).index  # held: the IVF below is a view into it
            ivf = faiss.extract_index_ivf(index)
            centroids.append(faiss.downcast_index(ivf.quantizer).reconstruct_n(0, ivf.nlist))
        assert all(np.array_equal(c, centroids[0]) for c in centroids)
    if kind == "hnsw":  # new rows wait in Flat segments
        first = segmented.shard(0) if shards > 1 else segmented
        assert isinstance(faiss.downcast_index(first.segment(1).index), faiss.IndexFlatIP)

    queries = l2_normalized(vectors[::37] + 0.05)
    before = _top(segmented, queries)
    shade = Filter(must=(Condition("shade", any_of=("2",)),))
    allowed = segmented.filters.mask(shade)
    before_filtered = _top(segmented, queries, allowed=allowed)
    report = compact_version(tmp_path / "index", keep=10)
    compacted = IndexVersion(report.version).load(dim=DIM)
    counts = [len(e.segments) for e in compacted.manifest.shards] if shards > 1 else [len(compacted.manifest.segments)]
    assert counts == [1] * shards and sorted(compacted.items.ids) == sorted(ids)
    after = _top(compacted, queries)
    after_filtered = _top(compacted, queries, allowed=compacted.filters.mask(shade))
    if kind == "flat":
        assert before == after and before_filtered == after_filtered  # to the id
    else:
        overlap = np.mean([len(set(b) & set(a)) / K for b, a in zip(before, after, strict=True)])
        assert overlap >= 0.9, overlap
    if kind == "hnsw":  # compaction built the graph over every row
        first = compacted.shard(0) if shards > 1 else compacted
        assert isinstance(faiss.downcast_index(first.segment(0).index), faiss.IndexHNSWFlat)


def test_grouped_search_over_segments_equals_the_compacted_version(tmp_path):
    vectors, _ = _grown(tmp_path, "Flat", {}, 1)
    segmented = IndexVersion.open(tmp_path / "index").load(dim=DIM)
    queries = l2_normalized(vectors[::53] + 0.05)
    groups = segmented.groups("item")

    def grouped(version):
        found = search_groups(version.searchable(), version.vectors, queries, 5, version.groups("item"), per_group=2)
        return [[[version.items.ids[row] for row, _ in hits] for _, hits in answer.groups] for answer in found]

    assert len(groups.values) == ITEMS
    expected = grouped(segmented)
    compacted = IndexVersion(compact_version(tmp_path / "index", keep=10).version).load(dim=DIM)
    assert grouped(compacted) == expected


def test_a_removal_writes_tombstones_alone_and_an_upsert_both(tmp_path):
    _grown(tmp_path, "IVF8,Flat", {"nprobe": 8}, 1, adds=1)
    root = tmp_path / "index"
    before = IndexVersion.open(root).load()
    victims = [before.items.ids[3], before.items.ids[N + 5]]
    report = remove_items(root, victims, "test")
    assert report.bytes_written < 2_000  # deleted.npy and nothing else
    small = before.segment(1).index  # 40 rows: Flat until compaction, not an IVF of 8 lists
    assert isinstance(faiss.downcast_index(small), faiss.IndexFlatIP)
    after = IndexVersion.open(root).load()
    assert all(after.row_of(v) is None for v in victims) and after.size == before.size - 2
    assert victims[0] not in _top(after, before.vector(3)[None])[0]
    # An upsert: the old row tombstoned, the new one in a segment of its own.
    new_vector = l2_normalized(np.random.default_rng(3).standard_normal((1, DIM)).astype(np.float32))
    items = ItemTable([before.items.ids[7]], None, ["/new.png"], [{"item": "item7", "shade": "1"}])
    with pytest.raises(ValueError, match="already in version .* pass upsert"):
        add_vectors(root, new_vector, items)
    add_vectors(root, new_vector, items, upsert=True)
    upserted = IndexVersion.open(root).load()
    row = upserted.row_of(before.items.ids[7])
    np.testing.assert_array_equal(upserted.vector(row), new_vector[0])
    assert upserted.size == after.size and len(upserted.deleted) == 3
    assert _top(upserted, new_vector, 1) == [[before.items.ids[7]]]
    # All at once, as an add of a whole catalog asks: removed ids, the upserted one (its first row
    # deleted, a later one live), absent ones and repeats, against a scan of the items.
    asked = [*upserted.items.ids, *victims, "no-such-id", before.items.ids[7], "no-such-id"]
    np.testing.assert_array_equal(upserted.live_rows(asked), _live_rows_by_scan(upserted, asked))


def _live_rows_by_scan(version: IndexVersion, ids: list[str]) -> list[int]:
    deleted = set(version.deleted.tolist())
    first: dict[str, int] = {}
    for row, item_id in enumerate(version.items.ids):
        if row not in deleted:
            first.setdefault(item_id, row)
    return [first.get(item_id, -1) for item_id in ids]


def test_ids_whose_hashes_collide_are_told_apart_by_the_ids():
    table = ItemTable(["a", "b", "c", "b"], None, ["/a", "/b", "/c", "/b2"], [{}] * 4)
    order, _ = table.lookup
    alike = np.zeros(4, dtype=np.uint64)  # every id hashing alike: only the ids can tell them apart
    asked = id_array(["b", "z", "c"])
    which, rows = hashed_matches(order, alike, np.zeros(3, dtype=np.uint64), asked, table.ids.array.take)
    assert sorted(zip(which.tolist(), rows.tolist(), strict=True)) == [(0, 1), (0, 3), (2, 2)]
    assert table.row_of("b") == 1 and table.row_of("z") is None


def test_compaction_runs_by_itself_past_the_segment_count_or_deleted_share(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=0)
    root = tmp_path / "index"
    for number in range(3):
        extra, items = _more(5, seed=number, first=N + 5 * number)
        add_vectors(root, extra, items, max_segments=3)
    version = IndexVersion.open(root).load()
    assert len(version.manifest.segments) == 1 and version.size == N + 15  # the third add went past 3
    ids = list(version.items.ids)
    remove_items(root, ids[: int(0.25 * N)], "test", max_deleted_fraction=0.2)
    version = IndexVersion.open(root).load()
    assert len(version.deleted) == 0 and version.size == N + 15 - int(0.25 * N)


def test_a_missing_or_damaged_segment_is_refused_naming_it(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=2)
    live = IndexVersion.open(tmp_path / "index")
    segment = live.directory / artifacts.SEGMENTS / "000001"
    data = (segment / artifacts.EMBEDDINGS_FILE).read_bytes()
    (segment / artifacts.EMBEDDINGS_FILE).unlink()  # a hard link: the parent's copy is untouched
    (segment / artifacts.EMBEDDINGS_FILE).write_bytes(data[:-4] + b"\0\0\0\1")
    with pytest.raises(ArtifactError, match=r"segment 000001 of version .*embeddings\.npy is damaged"):
        IndexVersion(live.directory).load(dim=DIM)
    os.rename(segment, segment.with_name("gone"))
    with pytest.raises(ArtifactError, match=r"segment 000001 is missing"):
        IndexVersion(live.directory).load(dim=DIM)


def test_a_version_opened_beside_its_parent_shares_the_segments_it_keeps(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=1)
    root = tmp_path / "index"
    parent = IndexVersion.open(root).load()
    extra, items = _more(3, seed=99, first=5000)
    child = IndexVersion(add_vectors(root, extra, items).version).load()
    for number in range(2):  # the same objects: a server loading the child reads only its new segment
        assert child.segment(number) is parent.segment(number)
        assert child.segment(number).index is parent.segment(number).index
    assert isinstance(child.vectors, RowBlocks) and len(child.vectors.blocks) == 3
    assert child.vectors.blocks[0].ctypes.data == parent.vectors.blocks[0].ctypes.data  # one map
    # Ids are looked up in each segment's written lookup, memory-mapped: no table builds one of
    # its own (16 bytes a row, a sort of every id, per reload).
    assert parent.row_of("id00005") == child.row_of("id00005") == 5
    assert child.row_of(items.ids[2]) == len(child.items) - 1 and parent.row_of(items.ids[2]) is None
    assert "lookup" not in vars(child.items) and "lookup" not in vars(child.segment(0).items)
    assert child.segment(0)._written_lookup is parent.segment(0)._written_lookup is not None
    assert child.items.row_of("no-such-id") is None and child.row_of("no-such-id") is None


def test_an_add_checks_its_ids_against_the_written_lookups_without_reading_the_items(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=1)
    root = tmp_path / "index"
    live = IndexVersion.open(root)
    extra, items = _more(3, seed=7, first=7000)
    # What an add asks of the live version: each new id absent, and whether its rows are labelled.
    assert set(live.rows_of_ids(items.ids).values()) == {None} and live.labelled is False
    assert "items" not in vars(live) and all("items" not in vars(live.segment(n)) for n in range(2))
    # An id it holds is found, and its segment's items read to tell it from a hash collision.
    assert live.row_of("id00005") == 5 and "items" in vars(live.segment(0))
    child = IndexVersion(add_vectors(root, extra, items).version)
    assert child.row_of(items.ids[1]) == len(live.items) + 1
    with pytest.raises(ValueError, match="already in version"):
        add_vectors(root, extra[:1], items.take(np.array([1])))


def test_a_version_without_written_lookups_finds_its_ids_from_its_items(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=0)
    version = IndexVersion.open(tmp_path / "index")
    (version.directory / artifacts.ID_LOOKUP_FILE).unlink()  # written before the lookups were
    fresh = IndexVersion.open(tmp_path / "index")
    assert fresh._written_lookup is None
    assert fresh.row_of("id00005") == 5 and fresh.row_of("no-such-id") is None
    assert "lookup" in vars(fresh.items)


def test_bad_rows_are_refused_precisely(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=0)
    root = tmp_path / "index"
    extra, items = _more(2, seed=1)
    with pytest.raises(ValueError, match=r"shape \(2, 8\); version .* holds 16-d vectors"):
        add_vectors(root, extra[:, :8], items)
    twice = ItemTable(["a", "a"], None, ["/a", "/b"], [{}, {}])
    with pytest.raises(ValueError, match="item id 'a' comes twice"):
        add_vectors(root, extra, twice)
    bad = extra.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        add_vectors(root, bad, items)


def test_an_add_uses_a_version_open_already_only_while_current_names_it(tmp_path):
    _grown(tmp_path, "Flat", {}, 1, adds=0)
    root = tmp_path / "index"
    opened = IndexVersion.open(root).load()  # a server's live version
    extra, items = _more(2, seed=1)
    report = add_vectors(root, extra, items, opened=opened)  # CURRENT names it: its lookups are used
    assert IndexVersion.open(root).row_of(items.ids[0]) is not None
    # CURRENT moved on: an add given the old version checks the new one, which holds these ids.
    with pytest.raises(ValueError, match=rf"2 of the 2 new ids are already in version {report.live_version.name}"):
        add_vectors(root, extra, items, opened=opened)


@pytest.mark.parametrize("deleted", [10, 50])
def test_tombstones_are_dropped_from_an_answer_asked_deeper(tmp_path, monkeypatch, deleted):
    """A few tombstones: the index asked that much deeper and them dropped; many: the planner
    over the live rows. Either way, for Flat, the exact top k of the live rows."""
    from index.search import faiss_search

    monkeypatch.setattr(faiss_search, "OVERFETCH_DELETED", 20)  # 10 deleted overfetch, 50 go to the planner
    _grown(tmp_path, "Flat", {}, 1, adds=1)
    root = tmp_path / "index"
    before = IndexVersion.open(root).load()
    queries = l2_normalized(np.asarray(before.vectors[:deleted]) + 0.01)  # each query's best row is deleted
    remove_items(root, list(before.items.ids)[:deleted], "test", max_deleted_fraction=1.0)
    version = IndexVersion.open(root).load()
    scores, rows = faiss_search.search_live(
        version.searchable(), version.vectors, queries, K, version.live_mask, len(version.deleted)
    )
    exact = np.asarray(version.vectors) @ queries.T
    exact[version.deleted] = -np.inf
    expected = np.argsort(-exact, axis=0, kind="stable")[:K].T
    assert (rows == expected).mean() >= 0.99 and not np.isin(rows, version.deleted).any()
    assert np.allclose(scores, np.take_along_axis(exact.T, expected, axis=1), atol=1e-5)


@pytest.mark.parametrize("shards", [1, 4])
def test_hnsw_build_effort_shapes_every_graph_of_a_version_its_shards_and_compacted_segments(tmp_path, shards):
    """efConstruction is in the files as they were built (a loaded index has the manifest's
    search parameters set on it, whatever its graph was built with)."""
    _grown(tmp_path, "HNSW16", {"efConstruction": 72, "efSearch": 64}, shards, adds=1)
    root = tmp_path / "index"

    def built_with() -> list[int]:
        files = list(artifacts.version_dir(root).rglob(artifacts.INDEX_FILE))
        graphs = [faiss.downcast_index(faiss.read_index(str(p))) for p in files]
        return [g.hnsw.efConstruction for g in graphs if isinstance(g, faiss.IndexHNSW)]

    assert built_with() and set(built_with()) == {72}  # the build's (one graph a shard)
    compact_version(root, keep=3, on_ray=False)
    assert len(built_with()) == shards and set(built_with()) == {72}  # compaction's graphs
