"""`index rebuild --shards S` on real Ray Data (issue 42): each row's shard computed in
`map_batches`, each shard built from its own rows by `map_groups`, and the version the same as
`index build --shards S` makes of the same catalog: the same rows in the same shards, the same
trained quantizer, answers equal."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from core.artifacts import layout as artifacts
from index.build.build import run_build
from index.build.config import BuildConfig
from index.build.rebuild import RebuildConfig, run_rebuild
from index.search.faiss_search import search
from index.versions.sharding import shard_of
from index.versions.version import IndexVersion
from tests.support.index import write_images, write_tiny_model

IMAGES, PER_ITEM = 160, 2


pytestmark = pytest.mark.usefixtures("local_ray")  # the sharded builds add their shards in Ray tasks


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model and a catalog of small images (an item column: two photos an item), one of
    them a missing file (skipped and counted, never placed)."""
    folder = tmp_path_factory.mktemp("photos")
    paths = write_images(folder / "images", IMAGES)
    catalog_path = folder / "images" / "catalog.csv"
    with open(catalog_path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "path", "item", "shade"])
        writer.writerows([p.stem, p.name, f"item{n // PER_ITEM}", n % 3] for n, p in enumerate(paths))
        writer.writerow(["gone", "missing.png", "item0", 0])
    return write_tiny_model(folder / "model", dim=16), catalog_path


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_a_sharded_rebuild_places_rows_on_ray_data_as_build_does(photos, tmp_path, factory):
    model, catalog_path = photos
    common = {
        "model": str(model), "catalog": str(catalog_path), "min_ann_recall": 0, "shards": 4, "factory": factory,
        "filterable": ["shade"], "max_bad_fraction": 0.05,
    }  # fmt: skip
    rebuilt = IndexVersion(run_rebuild(RebuildConfig(index_root=str(tmp_path / "r"), **common), progress=False))
    built = IndexVersion(run_build(BuildConfig(index_root=str(tmp_path / "b"), **common), progress=False))
    rebuilt.load(dim=16), built.load(dim=16)
    assert rebuilt.manifest.engine["name"] == "ray_data" and rebuilt.manifest.rows.skipped == {"missing": 1}
    assert len(rebuilt.shard_names) == 4 and rebuilt.manifest.shard_key == "item" and rebuilt.size == IMAGES
    for number in range(4):
        mine, theirs = rebuilt.shard(number), built.shard(number)
        assert mine.items.ids == theirs.items.ids  # the same rows, in catalog order
        assert all(shard_of(meta["item"], 4) == number for meta in mine.items.metadata)
        np.testing.assert_allclose(mine.vectors, theirs.vectors, atol=1e-6)
        assert (
            mine.filters.fields["shade"].rows_equal("1").tolist()
            == theirs.filters.fields["shade"].rows_equal("1").tolist()
        )
    assert [e.row_offset for e in rebuilt.manifest.shards] == [e.row_offset for e in built.manifest.shards]
    assert rebuilt.manifest.search_params == built.manifest.search_params  # tuned alike on the merged search
    queries = built.vectors[::7]
    _, rows_r = search(rebuilt.searchable(), queries, 10)
    _, rows_b = search(built.searchable(), queries, 10)
    assert (rows_r == rows_b).mean() > 0.99  # the same quantizer (ties in the tiny model's vectors aside)
    assert not (tmp_path / "r" / ".rebuild").exists() or not any((tmp_path / "r" / ".rebuild").iterdir())
    assert (rebuilt.directory / artifacts.SHARDS / "003" / artifacts.INDEX_FILE).is_file()


def test_a_sharded_rebuild_refuses_more_shards_than_rows(photos, tmp_path):
    model, catalog_path = photos
    config = RebuildConfig(
        model=str(model), catalog=str(catalog_path), index_root=str(tmp_path / "r"), min_ann_recall=0,
        shards=IMAGES + 1, max_bad_fraction=0.05,
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"--shards {IMAGES + 1} is more shards than the"):
        run_rebuild(config, progress=False)
