"""Batch rebuild on real Ray Data: bad rows counted, same neighbours as a plain build, safe re-runs."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.artifacts import layout as artifacts
from core.data.catalog import Catalog, read_catalog
from core.data.items import ItemTable
from index.build.rebuild import embed_actor_resources, read_shards
from tests.support.images import png_header_only

ROOT = Path(__file__).resolve().parents[2]


def test_actor_resources_select_gpu_when_present():
    assert embed_actor_resources(0) == {"num_gpus": 0, "num_cpus": 1}
    assert embed_actor_resources(2) == {"num_gpus": 1, "num_cpus": 1}
    assert embed_actor_resources(2, provider="cpu") == {"num_gpus": 0, "num_cpus": 1}
    with pytest.raises(RuntimeError, match="no GPUs"):
        embed_actor_resources(0, provider="gpu")


@pytest.mark.parametrize("fixed_size", [True, False])
def test_shards_are_read_back_in_catalog_order_with_bad_rows_counted(tmp_path, fixed_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((50, 8)).astype(np.float32)
    reasons = ["" if i % 7 else "unreadable" for i in range(50)]
    reasons[3] = "missing"
    (tmp_path / "shards").mkdir()
    order = rng.permutation(50)
    for n, part in enumerate(np.array_split(order, 3)):  # shards in any order, rows shuffled
        kind = pa.list_(pa.float32(), 8) if fixed_size else pa.list_(pa.float32())
        table = pa.table({
            "row": pa.array(part, pa.int64()),
            "reason": pa.array([reasons[i] for i in part]),
            "embedding": pa.array([vectors[i] for i in part], kind),
        })  # fmt: skip
        pq.write_table(table, tmp_path / "shards" / f"{n}.parquet")
    got, kept, skipped = read_shards(tmp_path, 50)
    assert kept == [i for i in range(50) if reasons[i] == ""]
    assert skipped == {"unreadable": 8, "missing": 1}
    np.testing.assert_array_equal(got, vectors[kept])
    with pytest.raises(RuntimeError, match="shards hold 50 rows, the catalog 51"):
        read_shards(tmp_path, 51)


def index_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "index", *args, "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def planted_catalog(demo_run, tmp_path_factory) -> Path:
    """The test split plus a missing file, a corrupt file and an oversized image."""
    folder = tmp_path_factory.mktemp("planted")
    base = read_catalog(demo_run / "train" / "splits" / "test.csv").subset(range(0, 800, 4))
    corrupt = folder / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    huge = folder / "huge.png"
    buf = io.BytesIO()
    Image.new("L", (3000, 3000)).save(buf, format="PNG")
    huge.write_bytes(buf.getvalue())
    bomb = folder / "bomb.png"  # over Pillow's own threshold: refused before any limit of ours
    bomb.write_bytes(png_header_only(20_000, 20_000))
    planted = Catalog(
        ids=[*base.ids, "bad-missing", "bad-corrupt", "bad-huge", "bad-bomb"],
        paths=[*base.paths, folder / "missing.png", corrupt, huge, bomb],
        labels=[*base.labels, "x", "x", "x", "x"],
        source="planted",
    )
    return planted.write(folder / "planted.csv")


@pytest.mark.slow
def test_rebuild_counts_bad_rows_and_matches_plain_build(demo_run, planted_catalog, tmp_path):
    model = str(demo_run / "model")
    ray_root, plain_root = tmp_path / "ray", tmp_path / "plain"
    common = ["--model", model, "--catalog", str(planted_catalog), "--max-pixels", "4000000", "--max-bad-fraction"]
    too_strict = index_cli("rebuild", *common, "0.001", "--index-root", str(ray_root), "--workers", "2")
    assert too_strict.returncode == 2 and "could not be embedded" in too_strict.stderr
    assert artifacts.current_version(ray_root) is None
    # The failed run left completed shards: the retry reuses them.
    rebuilt = index_cli("rebuild", *common, "0.05", "--index-root", str(ray_root), "--workers", "2")
    assert rebuilt.returncode == 0, rebuilt.stderr
    manifest = artifacts.read_manifest(artifacts.version_dir(ray_root))
    assert manifest["rows"]["skipped"] == {"missing": 1, "unreadable": 1, "oversized": 2}
    assert manifest["engine"]["name"] == "ray_data"
    plain = index_cli("build", *common, "0.05", "--index-root", str(plain_root))
    assert plain.returncode == 0, plain.stderr
    assert artifacts.read_manifest(artifacts.version_dir(plain_root))["rows"]["skipped"] == manifest["rows"]["skipped"]
    ray_dir, plain_dir = artifacts.version_dir(ray_root), artifacts.version_dir(plain_root)
    assert ItemTable.read(ray_dir / "items.parquet").ids == ItemTable.read(plain_dir / "items.parquet").ids
    np.testing.assert_allclose(
        np.load(ray_dir / artifacts.EMBEDDINGS_FILE), np.load(plain_dir / artifacts.EMBEDDINGS_FILE), atol=1e-5
    )


@pytest.mark.slow
def test_rerun_after_a_crash_discards_partial_shards(demo_run, planted_catalog, tmp_path):
    from index.build.rebuild import work_key

    root = tmp_path / "index"
    model_id = artifacts.read_manifest(demo_run / "model")["model_id"]
    work = root / ".rebuild" / work_key(read_catalog(planted_catalog), model_id)
    (work / "shards").mkdir(parents=True)
    (work / "shards" / "half-written.parquet").write_bytes(b"PAR1 truncated")  # a crash mid-write
    done = index_cli(
        "rebuild",
        "--model",
        str(demo_run / "model"),
        "--catalog",
        str(planted_catalog),
        "--max-pixels",
        "4000000",
        "--max-bad-fraction",
        "0.05",
        "--index-root",
        str(root),
        "--workers",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert artifacts.read_manifest(artifacts.version_dir(root))["size"] == 200
    assert not work.exists()  # cleaned after publishing


@pytest.mark.slow
def test_rebuild_takes_a_plain_folder_of_images(demo_run, tmp_path):
    """An unlabelled catalog that is a folder, not a file, is rebuilt like any other."""
    import shutil

    folder = tmp_path / "photos"
    folder.mkdir()
    test = read_catalog(demo_run / "train" / "splits" / "test.csv")
    for i in range(0, 600, 10):
        shutil.copy(test.paths[i], folder / f"image{i:04d}.png")
    root = tmp_path / "index"
    done = index_cli("rebuild", "--model", str(demo_run / "model"), "--catalog", str(folder), "--index-root",
                     str(root), "--workers", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = artifacts.read_manifest(artifacts.version_dir(root))
    assert manifest["quality"]["labelled"] is False and manifest["rows"]["indexed"] == 60
