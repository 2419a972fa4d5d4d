"""What a soak serves (`benchmarks.soak`): a demo run's model and index, or a synthetic catalog of
224-px JPEG images and a 224-px model; an index root of S shards built from them once; and the
versions a soak publishes into its copy of that root while it runs.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from core.artifacts import layout as artifacts

ROOT = Path(__file__).resolve().parents[1]

SIDE = 224  # the synthetic catalog's images and its model's input: what users send


@dataclass
class Served:
    """A model (`folder`/model) and the catalog its index versions are built from (None: the
    model's test split, as a demo run's index was): an index root of S shards built from them
    once, in `folder`, and copied for each soak."""

    folder: Path
    catalog: Path | None = None

    def index_root(self, shards: int, env: dict[str, str]) -> Path:
        built = self.folder / ("index" if shards == 1 and self.catalog is None else f"index-s{shards}")
        if artifacts.current_version(built) is None:
            command = [
                sys.executable, "-m", "index", "build", "--model", str(self.folder / "model"), "--index-root",
                str(built), "--shards", str(shards), "--no-progress",
            ]  # fmt: skip
            command += ["--catalog", str(self.catalog)] if self.catalog else []
            subprocess.run(command, cwd=ROOT, env=env, check=True)
        return built


def demo_run(run: Path) -> Served:
    harness.ensure_artifacts(run, quick=False)
    return Served(run)


def synthetic_run(folder: Path, count: int, dim: int = 64) -> Served:
    """`count` 224-px JPEG images in 50 classes (`harness.photo_like_images`) and their catalog,
    and a 224-px model whose graph is an average pool to 8×8 and one projection to `dim`
    (tests/support/index.py: a query's cost at the server is its decoding, its pixels' trip to
    the model and its search, as with a real model less the network's own time), written into
    `folder` once."""
    from tests.support.index import write_tiny_model

    catalog = folder / "images" / "catalog.csv"
    if not catalog.is_file():
        catalog.parent.mkdir(parents=True, exist_ok=True)
        images, labels = harness.photo_like_images(count, side=SIDE)
        partial = catalog.with_suffix(".partial")
        with open(partial, "w", newline="") as out:  # paths relative to the catalog
            writer = csv.writer(out)
            writer.writerow(["id", "path", "label"])
            for n, (image, label) in enumerate(zip(images, labels, strict=True)):
                (catalog.parent / f"{n:06d}.jpg").write_bytes(image)
                writer.writerow([f"img{n:06d}", f"{n:06d}.jpg", f"class{label:02d}"])
        partial.rename(catalog)  # a catalog is there once every image is
    if not (folder / "model" / artifacts.MANIFEST).is_file():
        write_tiny_model(folder / "model", dim=dim, side=SIDE)
    return Served(folder, catalog)


# -- the versions a soak publishes --------------------------------------------------------------


def live_copy(root: Path, copy=shutil.copy2) -> Path:
    """A staging directory holding the live version's files, each put there by `copy`."""
    staging = artifacts.index_staging_dir(root)
    shutil.copytree(artifacts.version_dir(root), staging, copy_function=copy, dirs_exist_ok=True)
    return staging


def damaged_and_missing_versions(root: Path) -> list[str]:
    """A version whose index files (a sharded version's: each shard's) are cut short, and a name no
    version has."""
    staging = live_copy(root)  # copies: the live version's files must stay whole
    for index_file in staging.rglob(artifacts.INDEX_FILE):
        index_file.write_bytes(index_file.read_bytes()[: index_file.stat().st_size // 3])
    damaged = artifacts.new_version_name("damaged00000000")
    artifacts.publish_version(root, staging, damaged, make_current=False)
    return [damaged, "v-no-such-version"]
