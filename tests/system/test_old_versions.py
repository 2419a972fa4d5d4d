"""Index roots written by the code at dbb543c — before `serving/` and `index/` were rebuilt in
rooms (issue 60) — load, serve and take changes with today's code: the artifact format did not
move with the code.

The fixture (`tests/fixtures/versions_dbb543c/`, 250 kB) was written by its `make_fixture.py`
run at dbb543c: a tiny ONNX model (16-d), 48 random 8-px images, and two roots, `sharded`
(2 shards) and `single`, each built from 40 images with `--filterable color`, then 8 images
added (a segment each touched shard) and `item-003`, `item-041` removed (tombstones). Their
versions say so in their manifests; this test reads them as a server and the CLI do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.artifacts import layout as artifacts
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from tests.support.index import write_images
from tests.support.server import start

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "versions_dbb543c"
REMOVED = {"item-003", "item-041"}
COLORS = ("red", "green", "blue")


@pytest.fixture
def old(tmp_path) -> Path:
    """A copy of the fixture (a test writes to its roots; the checked-in one stays as written)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "old"))


def images(old: Path) -> list[Path]:
    return sorted((old / "images").glob("img-*.png"))


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_the_fixture_is_what_it_says(layout):
    """Not vacuous: the live version is segmented (and sharded where named), has tombstones and
    was written by the old code's add and remove (its parent chain and audit)."""
    root = FIXTURE / layout
    manifest = json.loads((artifacts.version_dir(root) / "manifest.json").read_text())
    assert manifest["deleted_rows"] == 2 and manifest["size"] == 48
    assert manifest["config"]["shards"] == (2 if layout == "sharded" else 1)
    assert len(list((root / "versions").iterdir())) == 3
    assert json.loads((root / "audit.jsonl").read_text().splitlines()[-1])["ids"] == sorted(REMOVED)


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_an_old_version_opens_with_its_rows_segments_and_tombstones(old, layout):
    version = IndexVersion.open(old / layout)
    assert version.size == 46 and len(version.deleted) == 2  # size: the live rows
    manifest = json.loads((artifacts.version_dir(old / layout) / "manifest.json").read_text())
    shards = manifest.get("shards") or [{**manifest, "row_offset": 0, "rows": manifest["size"]}]
    written = [(shard["row_offset"], shard["rows"], shard["deleted_rows"]) for shard in shards]
    assert [(unit.offset, unit.rows, unit.deleted) for unit in version.units()] == written
    assert [unit.segments for unit in version.units()] == [2] * len(written)
    assert {version.items.ids[row] for row in version.deleted} == REMOVED
    assert all(version.row_of(item_id) is None for item_id in REMOVED) and version.row_of("item-047") is not None


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_an_old_version_serves_image_filtered_and_embedding_queries(old, layout):
    root = old / layout
    server, client = start(root, model=str(old / "model"))
    try:
        info = client.get_info()
        assert info.index_version == artifacts.current_version(root)
        assert (info.index_size, info.deleted_rows) == (46, 2)
        assert [field.name for field in info.filterable] == ["color"]
        for n, image in enumerate(images(old)):
            item_id = f"item-{n:03d}"
            answer = client.search_image(image, k=3)
            ids = [neighbor.id for neighbor in answer.neighbors]
            assert len(ids) == 3 and not REMOVED & set(ids)
            if item_id not in REMOVED:
                assert ids[0] == item_id and answer.neighbors[0].score == pytest.approx(1.0, abs=1e-4)
            color = COLORS[n % 3]
            only = pb.Filter(must=[pb.Condition(field="color", value=color)])
            filtered = client.search_image(image, k=5, filter=only)
            assert [neighbor.metadata["color"] for neighbor in filtered.neighbors] == [color] * 5
        # By embedding: a stored row's own vector finds it.
        vector = client.embed(images(old)[7].read_bytes()).embedding
        assert client.search_embedding(list(vector), k=1).neighbors[0].id == "item-007"
    finally:
        server.stop()


def index_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "index", *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_todays_commands_change_an_old_root(old, layout):
    """`index add`, `index list`, `index compact` and `index rollback` of today on a root the
    old code wrote: the add publishes a segment onto the old version, the compaction merges the
    old and new segments and drops the tombstones, and a rollback returns to the old version."""
    root = old / layout
    before = artifacts.current_version(root)
    new = write_images(old / "new", 2, seed=99, prefix="new")
    (old / "new.csv").write_text(
        "id,path,label,color\n" + "".join(f"new-{n},{path},class-9,red\n" for n, path in enumerate(new))
    )
    added = index_cli(
        "add", "--model", "model", "--index-root", layout, "--catalog", "new.csv", "--no-progress", cwd=old
    )
    assert added.returncode == 0, added.stderr[-3000:]
    version = IndexVersion.open(root)
    assert version.manifest.parent_version == before and version.size == 48
    assert version.row_of("new-1") is not None and version.row_of("item-047") is not None

    listed = index_cli("list", "--index-root", layout, cwd=old)
    assert listed.returncode == 0 and before in listed.stdout and version.name in listed.stdout

    compacted = index_cli("compact", "--index-root", layout, "--max-segments", "1", "--no-progress", cwd=old)
    assert compacted.returncode == 0, compacted.stderr[-3000:]
    merged = IndexVersion.open(root)
    assert merged.size == 48 and len(merged.deleted) == 0 and sum(u.rows for u in merged.units()) == 48
    assert all(unit.segments == 1 for unit in merged.units())

    rolled = index_cli("rollback", "--index-root", layout, "--to", before, cwd=old)
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    again = IndexVersion.open(root)
    assert again.size == 46 and len(again.deleted) == 2 and again.row_of("new-0") is None
