"""Sharded index versions (issue 42): `--shards S` builds one version of S shards, trained once
and added in parallel on a local Ray; the version opened whole answers as one index does, a
takedown rewrites only the shard it touches, and a version whose shards disagree with its
manifest is refused naming the shard."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, RowCounts
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable
from core.retrieval.metrics import stable_sample
from core.retrieval.vectors import RowBlocks, exact_search, l2_normalized
from index.__main__ import main as index_main
from index.build.build import run_build
from index.build.config import BuildConfig
from index.build.gate import GateThresholds
from index.build.publish import IndexRecipe, NewVersion, PublishTarget, publish_index_version
from index.changes.lifecycle import remove_items
from index.search.ann_recall import ann_recall
from index.search.faiss_search import search, search_within
from index.search.filters import parse_filterable
from index.search.grouping import search_groups
from index.versions.sharding import partition, shard_keys, shard_of
from index.versions.version import IndexVersion
from tests.support.index import write_images, write_tiny_model

N, DIM, ITEMS = 2400, 24, 800  # three rows an item
FILTERABLE = parse_filterable(["item", "shade"])


pytestmark = pytest.mark.usefixtures("local_ray")  # the sharded builds add their shards in Ray tasks


@pytest.fixture(scope="module")
def catalog() -> tuple[np.ndarray, ItemTable]:
    """Clustered vectors (the rows of an item near one another) and their items table."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, DIM))
    vectors = centres[rng.integers(0, 40, N)] + 0.6 * rng.standard_normal((N, DIM))
    items = ItemTable(
        [f"id{i:05d}" for i in range(N)],
        None,
        [f"/images/{i}.png" for i in range(N)],
        [{"item": f"item{i % ITEMS}", "shade": str(i % 3)} for i in range(N)],
    )
    return l2_normalized(vectors.astype(np.float32)), items


def publish(
    root: Path, catalog, factory: str, shards: int, params: dict | None = None, item_field: str | None = "item"
) -> IndexVersion:
    vectors, items = catalog
    new = NewVersion(
        model_id="m",
        embeddings=vectors,
        items=items,
        catalog="/catalog.csv",
        rows=RowCounts(N, N),
        started=time.perf_counter(),
        embed_seconds=0.0,
    )
    gate = GateThresholds(
        ks=(1,), quality_sample=200, ann_k=10, min_ann_recall=0, min_probe_recall_at_1=0, max_recall_drop=None,
        force=False,
    )  # fmt: skip
    published = publish_index_version(
        new,
        IndexRecipe(factory, params or {}, None, "cpu", 0.95, shards),
        gate,
        None,
        FILTERABLE,
        item_field,
        PublishTarget(root, 5, str(root / "model"), {}),
    )
    return IndexVersion(published).load(dim=DIM)


def queries(count: int = 300) -> np.ndarray:
    return l2_normalized(np.random.default_rng(1).standard_normal((count, DIM)).astype(np.float32))


def ids_of(version: IndexVersion, rows: np.ndarray) -> list[list[str]]:
    ids = version.items.ids
    return [[ids[r] for r in row if r >= 0] for row in rows]


def recall_at_10(version: IndexVersion, vectors: np.ndarray, items: ItemTable) -> float:
    """recall@10 of the version's search against exact search over the catalog (by id)."""
    q = queries()
    _, exact = exact_search(vectors, q, 10)
    found = ids_of(version, search(version.searchable(), q, 10)[1])
    expected = [[items.ids[r] for r in row] for row in exact]
    return float(np.mean([len(set(f) & set(e)) / 10 for f, e in zip(found, expected, strict=True)]))


@pytest.fixture(scope="module")
def flat_pair(catalog, tmp_path_factory) -> tuple[IndexVersion, IndexVersion]:
    folder = tmp_path_factory.mktemp("flat")
    return publish(folder / "one", catalog, "Flat", 1), publish(folder / "four", catalog, "Flat", 4)


def test_shard_of_is_a_stable_hash_and_an_item_lives_in_one_shard(catalog, flat_pair):
    assert [shard_of("item7", 4), shard_of("item7", 4)] == [shard_of("item7", 4)] * 2
    assert shard_of("item7", 1) == 0 and {shard_of(f"k{i}", 4) for i in range(100)} == {0, 1, 2, 3}
    _, items = catalog
    parts = partition(shard_keys(items, "item"), 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(N))
    assert all((np.diff(rows) > 0).all() for rows in parts)  # catalog order within a shard
    _, sharded = flat_pair
    assert sharded.shard_names == ["000", "001", "002", "003"] and sharded.manifest.shard_key == "item"
    for number in range(4):
        shard = sharded.shard(number)
        held = {meta["item"] for meta in shard.items.metadata}
        assert all(shard_of(item, 4) == number for item in held)
        assert shard.manifest.size == len(shard.items) == sharded.manifest.shards[number].rows
    # Global row = offset + local row.
    number, local = 2, 5
    assert sharded.items.ids[int(sharded.shard_offsets[number]) + local] == sharded.shard(number).items.ids[local]


def test_flat_merged_search_answers_as_the_single_index(flat_pair):
    single, sharded = flat_pair
    q = queries()
    one_scores, one_rows = search(single.searchable(), q, 10)
    many_scores, many_rows = search(sharded.searchable(), q, 10)
    np.testing.assert_allclose(many_scores, one_scores, atol=1e-5)
    assert ids_of(sharded, many_rows) == ids_of(single, one_rows)
    # Filtered: the rows of shade 1, as each version numbers them.
    mask_one = np.zeros(N, bool)
    mask_one[single.filters.fields["shade"].rows_equal("1")] = True
    mask_many = np.zeros(N, bool)
    mask_many[sharded.filters.fields["shade"].rows_equal("1")] = True
    _, rows_one, _ = search_within(single.searchable(), single.vectors, q, 10, mask_one)
    _, rows_many, _ = search_within(sharded.searchable(), sharded.vectors, q, 10, mask_many, exact_below=0.0)
    assert ids_of(sharded, rows_many) == ids_of(single, rows_one)
    # Grouped by the item: the same items, best first, and the same rows in each.
    got_one = search_groups(single.searchable(), single.vectors, q, 5, single.groups("item"), per_group=2)
    got_many = search_groups(sharded.searchable(), sharded.vectors, q, 5, sharded.groups("item"), per_group=2)
    for a, b in zip(got_one, got_many, strict=True):
        assert [[single.items.ids[r] for r, _ in rows] for _, rows in a.groups] == [
            [sharded.items.ids[r] for r, _ in rows] for _, rows in b.groups
        ]


@pytest.mark.parametrize(
    "factory,params,slack",
    [("IVF32,Flat", {"nprobe": 4}, 0.0), ("IVF32,PQ8", {"nprobe": 4}, 0.0), ("HNSW16", {"efSearch": 32}, 0.01)],
)
def test_ann_recall_of_the_merged_search(catalog, tmp_path, factory, params, slack):
    vectors, items = catalog
    single = publish(tmp_path / "one", catalog, factory, 1, params)
    sharded = publish(tmp_path / "four", catalog, factory, 4, params)
    assert sharded.manifest.search_params == single.manifest.search_params  # rerank added alike for PQ
    assert recall_at_10(sharded, vectors, items) >= recall_at_10(single, vectors, items) - slack - 1e-9


def test_search_effort_is_tuned_on_the_merged_search(catalog, tmp_path):
    sharded = publish(tmp_path / "four", catalog, "IVF32,Flat", 4)
    tuning = sharded.manifest.quality.search_tuning
    assert tuning["parameter"] == "nprobe" and sharded.manifest.search_params["nprobe"] == tuning["value"]
    assert sharded.manifest.quality.ann_recall_at_k >= 0.9
    for number in range(4):  # every shard searched at the chosen effort
        assert faiss.extract_index_ivf(sharded.shard(number).index).nprobe == tuning["value"]


def test_one_shard_is_todays_version(catalog, flat_pair, tmp_path):
    single, _ = flat_pair
    assert not (single.directory / artifacts.SHARDS).exists() and single.shard_names == []
    written = json.loads((single.directory / artifacts.MANIFEST).read_text())
    assert "shards" not in written and "shard_key" not in written
    again = publish(tmp_path / "again", catalog, "Flat", 1)
    for name in (artifacts.INDEX_FILE, artifacts.EMBEDDINGS_FILE, artifacts.ITEMS_FILE, artifacts.FILTERS_FILE):
        assert (again.directory / name).read_bytes() == (single.directory / name).read_bytes()


def test_a_takedown_rewrites_only_the_shard_it_touches(catalog, tmp_path):
    sharded = publish(tmp_path / "root", catalog, "Flat", 4)
    root = tmp_path / "root"
    victim = sharded.shard(1).items.ids[3]
    report = remove_items(root, [victim], "test")
    after = IndexVersion.open(root).load(dim=DIM)
    assert report.removed == 1 and after.manifest.parent_version == sharded.name
    assert after.row_of(victim) is None and after.manifest.live_size == N - 1
    for number in range(4):  # no shard's rows are written again: shard 001 gains tombstones alone
        old = sharded.directory / artifacts.SHARDS / f"{number:03d}" / artifacts.INDEX_FILE
        kept = after.directory / artifacts.SHARDS / f"{number:03d}"
        kept = kept / artifacts.SEGMENTS / "000000" if number == 1 else kept
        assert os.stat(old).st_ino == os.stat(kept / artifacts.INDEX_FILE).st_ino
    assert [e.deleted_rows for e in after.manifest.shards] == [0, 1, 0, 0]
    assert [e.rows for e in after.manifest.shards] == [e.rows for e in sharded.manifest.shards]
    assert after.manifest.shards[1].segments is not None and after.manifest.shards[2].segments is None
    # The merged search, its tombstones masked, never answers with it.
    vector = sharded.vector(sharded.row_of(victim))[None]
    _, rows, _ = search_within(after.searchable(), after.vectors, vector, 10, after.live_mask, exact_below=0.0)
    assert victim not in ids_of(after, rows)[0]


def test_an_admin_write_reads_ids_a_shard_at_a_time_and_only_where_they_can_be(catalog, tmp_path, monkeypatch):
    """A takedown's or an add's id lookup (`rows_of_ids`) never joins the whole version's items
    (a sharded server's ingress holds no rows): it searches the shards' written id lookups —
    placed by id, only the shards the ids name; placed by the item field (unknown from an id),
    every shard's — and reads the items of only the shards that hold an id asked."""
    read: list[Path] = []
    original = ItemTable.read
    monkeypatch.setattr(ItemTable, "read", staticmethod(lambda path: read.append(Path(path)) or original(path)))
    for item_field in (None, "item"):
        root = tmp_path / f"by-{item_field or 'id'}"
        whole = publish(root, catalog, "Flat", 4, item_field=item_field)
        asked = [whole.items.ids[r] for r in (3, 500, 1100)] + ["no-such-id"]
        expected = {item_id: whole.row_of(item_id) for item_id in asked}
        read.clear()
        opened = IndexVersion.open(root)
        assert opened.rows_of_ids(asked) == expected and "items" not in opened.__dict__
        found = [row for row in expected.values() if row is not None]
        holding = {int(np.searchsorted(whole.shard_offsets, row, side="right")) - 1 for row in found}
        assert sorted(path.parent.name for path in read) == [f"{n:03d}" for n in sorted(holding)]
        if item_field is None:
            victim = asked[1]
            read.clear()
            assert remove_items(root, [victim], "test").removed == 1
            assert {path.parent.name for path in read} == {f"{shard_of(victim, 4):03d}"}


def test_a_shard_that_disagrees_with_the_manifest_is_refused_naming_it(catalog, tmp_path):
    import shutil

    sharded = publish(tmp_path / "root", catalog, "Flat", 4)
    shards = sharded.directory / artifacts.SHARDS

    def reopen() -> IndexVersion:
        return IndexVersion(sharded.directory).load(dim=DIM)

    backup = tmp_path / "backup"
    shutil.copytree(shards, backup)

    (shards / "002" / artifacts.ITEMS_FILE).unlink()
    with pytest.raises(ArtifactError, match=r"shard 002 .*items\.parquet is missing"):
        reopen()
    shutil.copy2(backup / "002" / artifacts.ITEMS_FILE, shards / "002" / artifacts.ITEMS_FILE)

    corrupt = shards / "001" / artifacts.EMBEDDINGS_FILE
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.unlink()  # a hard link's other names keep their bytes
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"shard 001 .*embeddings\.npy is damaged: its sha256 differs"):
        reopen()
    shutil.copy2(backup / "001" / artifacts.EMBEDDINGS_FILE, corrupt)
    reopen()  # whole again

    shutil.rmtree(shards / "003")
    with pytest.raises(ArtifactError, match=r"lists 4 shards, .* holds 3; shard 003 is missing"):
        reopen()
    shutil.copytree(backup / "003", shards / "003")

    manifest = IndexManifest.read(sharded.directory)
    manifest.shards = manifest.shards[:3]
    manifest.write(sharded.directory)
    with pytest.raises(ArtifactError, match=r"lists 3 shards, .* holds 4; shard 003 is not in the manifest"):
        reopen()


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model and a catalog of 12 images (an item column: two photos an item)."""
    folder = tmp_path_factory.mktemp("photos")
    paths = write_images(folder / "images", 12)
    catalog_path = folder / "images" / "catalog.csv"
    with open(catalog_path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "path", "item"])
        writer.writerows([p.stem, p.name, f"item{n // 2}"] for n, p in enumerate(paths))
    return write_tiny_model(folder / "model"), catalog_path


def test_shard_counts_out_of_range_are_one_error_line(photos, tmp_path, capsys):
    model, catalog_path = photos
    common = ["--model", str(model), "--catalog", str(catalog_path), "--index-root", str(tmp_path / "r")]
    assert index_main(["build", *common, "--shards", "0", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --shards must be at least 1, got 0"]
    assert index_main(["build", *common, "--shards", "13", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --shards 13 is more shards than the 12 rows to index: at most 12"]


def test_build_add_and_list_a_sharded_version(photos, tmp_path, capsys):
    model, catalog_path = photos
    root = tmp_path / "root"
    config = BuildConfig(model=str(model), index_root=str(root), catalog=str(catalog_path), min_ann_recall=0, shards=3)
    first = IndexVersion(run_build(config, progress=False)).load()
    assert len(first.shard_names) == 3 and first.manifest.shard_key == "item" and first.size == 12
    assert index_main(["list", "--index-root", str(root)]) == 0
    listed = capsys.readouterr().out
    rows = "/".join(str(e.rows) for e in first.manifest.shards)
    assert f"shards=3 ({rows})" in listed
    # index add: new rows join the shard of their item; untouched shards are linked.
    more = write_images(catalog_path.parent, 2, seed=9, prefix="new")
    extra = catalog_path.parent / "extra.csv"
    with open(extra, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "path", "item"])
        writer.writerows([p.stem, p.name, "item0"] for p in more)
    from index.changes.add import run_add

    added = IndexVersion(run_add(BuildConfig(index_root=str(root), catalog=str(extra), min_ann_recall=0),
                                 progress=False)).load()  # fmt: skip
    assert added.size == 14 and len(added.shard_names) == 3
    home = shard_of("item0", 3)
    assert {added.shard(home).items.ids[-1], added.shard(home).items.ids[-2]} == {p.stem for p in more}
    for number in range(3):  # every shard's old rows linked; the home shard's new ones a segment of their own
        old = first.directory / artifacts.SHARDS / f"{number:03d}" / artifacts.ITEMS_FILE
        kept = added.directory / artifacts.SHARDS / f"{number:03d}"
        kept = kept / artifacts.SEGMENTS / "000000" if number == home else kept
        assert os.stat(old).st_ino == os.stat(kept / artifacts.ITEMS_FILE).st_ino
    assert [s.rows for s in added.manifest.shards[home].segments] == [first.manifest.shards[home].rows, 2]


def test_a_takedown_may_empty_a_shard_which_still_loads_and_searches(catalog, tmp_path):
    sharded = publish(tmp_path / "root", catalog, "Flat", 4)
    emptied = list(sharded.shard(2).items.ids)
    report = remove_items(tmp_path / "root", emptied, "test")
    after = IndexVersion.open(tmp_path / "root").load(dim=DIM)
    assert report.removed == len(emptied) and after.manifest.shards[2].rows == 0
    assert after.manifest.live_size == N - len(emptied) and after.shard(3).manifest.size > 0
    empty = IndexVersion(after.directory).shard(2).load(dim=DIM)  # a fresh reader: files checked
    assert empty.vectors.shape == (0, DIM) and len(empty.items) == 0 and empty.index.ntotal == 0
    scores, rows = search(empty.searchable(), queries(3), 10)
    assert (rows == -1).all()
    left = set(after.items.ids)
    assert all(i in left for row in ids_of(after, search(after.searchable(), queries(), 10)[1]) for i in row)
    assert not left & set(emptied)


def test_compacting_an_all_deleted_hnsw_shard_leaves_an_empty_graph(catalog, tmp_path):
    root = tmp_path / "root"
    sharded = publish(root, catalog, "HNSW16", 4, {"efSearch": 32})
    victims = list(sharded.shard(1).items.ids)
    remove_items(root, victims[:10], "test")  # tombstones: below the fraction
    assert IndexVersion.open(root).manifest.shards[1].deleted_rows == 10
    remove_items(root, victims[10:], "test", compact=True)  # every row of the shard gone: compacted
    after = IndexVersion.open(root).load(dim=DIM)
    entry = after.manifest.shards[1]
    assert (entry.rows, entry.deleted_rows) == (0, 0) and after.manifest.live_size == N - len(victims)
    empty = IndexVersion(after.directory).shard(1).load(dim=DIM)
    assert isinstance(faiss.downcast_index(empty.index), faiss.IndexHNSWFlat) and empty.index.ntotal == 0
    assert faiss.downcast_index(empty.index).hnsw.efSearch == after.manifest.search_params["efSearch"]
    assert (search(empty.searchable(), queries(3), 5)[1] == -1).all()
    found = ids_of(after, search(after.searchable(), queries(), 10)[1])
    assert all(len(row) == 10 for row in found) and not set(victims) & {i for row in found for i in row}


def test_a_shard_no_row_hashes_to_is_built_empty(tmp_path):
    # Items placed only in shards 0 and 1 of 3: shard 2 is an empty copy of the trained index.
    keys = [k for k in (f"item{i}" for i in range(400)) if shard_of(k, 3) != 2][:60]
    rng = np.random.default_rng(3)
    vectors = l2_normalized(rng.standard_normal((120, DIM)).astype(np.float32))
    items = ItemTable(
        [f"id{i}" for i in range(120)], None, [f"/images/{i}.png" for i in range(120)],
        [{"item": keys[i // 2], "shade": str(i % 3)} for i in range(120)],
    )  # fmt: skip
    for factory in ("Flat", "IVF2,Flat"):
        version = publish(tmp_path / factory.replace(",", "_"), (vectors, items), factory, 3)
        assert [e.rows for e in version.manifest.shards][2] == 0 and version.size == 120
        empty = version.shard(2)
        assert empty.index.ntotal == 0 and empty.index.is_trained
        assert (search(empty.searchable(), vectors[:2], 4)[1] == -1).all()


def test_a_sharded_manifest_is_schema_2_which_a_reader_from_before_shards_refuses(flat_pair, monkeypatch):
    single, sharded = flat_pair
    assert json.loads((single.directory / artifacts.MANIFEST).read_text())["schema_version"] == 1
    written = json.loads((sharded.directory / artifacts.MANIFEST).read_text())
    assert written["schema_version"] == 2
    assert IndexManifest.read(sharded.directory).to_dict() == written  # read back, written back the same
    monkeypatch.setattr(IndexManifest, "_READS", 1)  # what a reader from before shards reads
    with pytest.raises(ArtifactError, match=r"field 'schema_version' is 2; this simsearch reads versions 1 to 1"):
        IndexManifest.read(sharded.directory)
    monkeypatch.undo()
    with pytest.raises(ArtifactError, match=r"'schema_version' is 2, but the manifest describes one index"):
        IndexManifest.from_dict({k: v for k, v in written.items() if k != "shards"})
    with pytest.raises(ArtifactError, match=r"'schema_version' is 1, but the manifest describes shards"):
        IndexManifest.from_dict({**written, "schema_version": 1})


def test_a_sharded_builds_tuning_and_gate_read_each_shard_where_it_lies(catalog, tmp_path, monkeypatch):
    """Issue 48, gates: a sharded build tunes its search effort and measures its gate (ANN
    recall against exact search, the leave-one-out probe, item recall) over its shards' vector
    maps block by block — never one array of every shard's rows in the driver — and measures
    what the joined array would."""

    def joined(self, dtype=None, copy=None):
        raise AssertionError("the build joined every shard's vectors into one array")

    with monkeypatch.context() as patched:
        patched.setattr(RowBlocks, "__array__", joined)
        version = publish(tmp_path, catalog, "IVF16,Flat", 4)  # no nprobe given: the build tunes it
    quality = version.manifest.quality
    sample = stable_sample(version.items.ids, 200, seed=0)
    stored = np.asarray(version.vectors)
    expected = ann_recall(version.searchable(), stored, stored[sample], 10)
    assert quality.ann_recall_at_k == pytest.approx(expected)
    assert "nprobe" in version.manifest.search_params


def test_exact_search_over_row_blocks_equals_the_joined_array_with_deleted_rows_left_out():
    rng = np.random.default_rng(3)
    blocks = [l2_normalized(rng.standard_normal((n, DIM)).astype(np.float32)) for n in (500, 0, 7, 300)]
    q = l2_normalized(rng.standard_normal((40, DIM)).astype(np.float32))
    joined = np.concatenate(blocks)
    live = rng.random(len(joined)) > 0.3
    scores, rows = exact_search(RowBlocks(blocks), q, 10, live)
    expected_scores, expected_rows = exact_search(joined[live], q, 10)
    np.testing.assert_array_equal(rows, np.flatnonzero(live)[expected_rows])
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)
    assert exact_search(RowBlocks(blocks), q, 10)[1].tolist() == exact_search(joined, q, 10)[1].tolist()
