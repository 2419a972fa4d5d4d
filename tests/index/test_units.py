"""A version's units (index/versions/units.py, issue 60): each shard, or the version itself when it is one
index — read from the manifest alone, and the one answer every place gives for a unit's rows, its
segments and which units may hold an id. On a 4-shard version after an add that touched some
shards, `index list`, /v1/admin/versions (what the console's Versions page shows) and the units
count the same segments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.data.items import ItemTable
from index.changes.add import add_vectors
from index.versions.sharding import shard_of
from index.versions.units import units_for_id
from index.versions.version import IndexVersion
from serving.api.admin_service import AdminService
from tests.support import shards as support

ROOT = Path(__file__).resolve().parents[2]
DIM = 16

pytestmark = pytest.mark.usefixtures("local_ray")  # a sharded build and an add write their shards on Ray


def _added_to_some_shards(root: Path, shards: int) -> list[str]:
    """Two new rows, each of an item of its own: at most two of the shards take them."""
    vectors, _ = support.catalog(2, DIM, 2, seed=7)
    items = ItemTable(["new-a", "new-b"], None, ["/a.png", "/b.png"], [{"item": "new-item-a"}, {"item": "new-item-b"}])
    add_vectors(root, vectors, items, max_segments=100)
    return ["new-item-a", "new-item-b"]


def test_a_sharded_version_after_an_add_counts_its_segments_once_everywhere(tmp_path):
    root = tmp_path / "index"
    support.publish(root, support.catalog(400, DIM, 100), support.model(tmp_path / "model", DIM), shards=4)
    placed = {shard_of(item, 4) for item in _added_to_some_shards(root, 4)}
    live = IndexVersion.open(root)
    counts = [unit.segments for unit in live.units()]
    # The shards the add wrote hold two segments; the others were linked whole: one each.
    assert counts == [2 if number in placed else 1 for number in range(4)] and 1 in counts

    listed = subprocess.run(
        [sys.executable, "-m", "index", "list", "--index-root", str(root)], cwd=ROOT, capture_output=True, text=True
    )
    (live_line,) = [line for line in listed.stdout.splitlines() if line.startswith("* ")]
    assert f"segments={'/'.join(map(str, counts))}" in live_line, listed.stdout
    by_version = {v["version"]: v for v in AdminService(reload=None, index_root=root).versions(live.name)}
    assert by_version[live.name]["segments"] == sum(counts) and by_version[live.name]["shards"] == 4
    (built,) = [v for name, v in by_version.items() if name != live.name]
    assert built["segments"] == 0  # built whole, never changed: in no segments, as `index list` shows none


def test_units_split_rows_and_place_ids_as_the_shards_hold_them(tmp_path):
    root = tmp_path / "index"
    support.publish(
        root, support.catalog(300, DIM, 60), support.model(tmp_path / "model", DIM), shards=3, item_field=None
    )
    live = IndexVersion.open(root)
    units = live.units()
    assert [unit.number for unit in units] == [0, 1, 2]
    for unit in units:  # from the manifest alone, what each shard holds
        shard = live.unit(unit.number)
        assert (unit.offset, unit.rows, unit.deleted) == (
            int(live.shard_offsets[unit.number]),
            len(shard.items),
            len(shard.deleted),
        )
    rows = np.random.default_rng(0).permutation(live.size)
    split = [unit.own(rows) + unit.offset for unit in units]
    assert sorted(np.concatenate(split).tolist()) == list(range(live.size))  # every row in exactly one unit
    for item_id in live.items.ids[::17]:  # placed by id: the one unit it names holds it
        (number,) = units_for_id(live.manifest, item_id)
        assert live.unit(number).row_of(item_id) is not None
    one = tmp_path / "one"
    support.publish(one, support.catalog(50, DIM, 10), support.model(tmp_path / "model1", DIM), shards=1)
    single = IndexVersion.open(one)
    (unit,) = single.units()
    assert (unit.number, unit.offset, unit.rows, unit.segments) == (0, 0, 50, 1) and single.unit(0) is single
    assert single.units_for_id("anything") == [0]
    with pytest.raises(IndexError, match="one index"):
        single.unit(1)
