"""What a new user gets without asking (issue 32): IVF searched hard enough to answer, a quality
floor by default, bad factory strings refused before anything is embedded, one size of a
version everywhere, and `index add` / `remove` / `list` that need no more than they must."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, RowCounts
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable
from index.build.config import BuildConfig
from index.build.gate import QualityGateError
from index.build.publish import NewVersion, publish_index_version
from index.search.faiss_index import build_index
from index.versions.version import IndexVersion
from tests.support.index import write_images, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
N, DIM = 6000, 32


@pytest.fixture(scope="module")
def clustered() -> np.ndarray:
    """Vectors in 60 clusters: an IVF's lists split them, so one list of 256 holds few neighbours."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((60, DIM))
    vectors = (centres[rng.integers(0, 60, N)] + 0.6 * rng.standard_normal((N, DIM))).astype(np.float32)
    faiss.normalize_L2(vectors)
    return vectors


def publish(root: Path, vectors: np.ndarray, **options) -> IndexVersion:
    n = len(vectors)
    items = ItemTable([f"item-{i}" for i in range(n)], None, [f"/nonexistent/{i}.png" for i in range(n)], [{}] * n)
    cfg = BuildConfig(model=str(root / "model"), index_root=str(root), **options)
    new = NewVersion("model-a", vectors, items, root / "c.csv", RowCounts(n, n), time.perf_counter(), 0)
    publish_index_version(
        new, cfg.index_recipe, cfg.gate_thresholds, cfg.probe, cfg.filterable_fields, cfg.item_field, cfg.publish_target
    )
    return IndexVersion.open(root).load()


def test_ivf_without_nprobe_gets_the_least_that_meets_the_recall_target(tmp_path, clustered, caplog):
    with caplog.at_level(logging.INFO, logger="index.build.publish"):
        version = publish(tmp_path, clustered, factory="IVF256,Flat")
    manifest = version.manifest
    nprobe = manifest.search_params["nprobe"]
    tuning = manifest.quality.search_tuning
    assert tuning["parameter"] == "nprobe" and tuning["value"] == nprobe > 1 and tuning["target"] == 0.95
    tried = {int(v): r for v, r in tuning["tried"].items()}
    assert list(tried) == [2**i for i in range(len(tried))] and tried[nprobe] >= 0.95
    assert all(r < 0.95 for v, r in tried.items() if v < nprobe)  # the least nprobe that reaches it
    assert manifest.quality.ann_recall_at_k >= 0.9 and manifest.quality_gate.passed
    assert version.index.nprobe == nprobe  # a loader applies what the manifest records
    # The build says what it measured and chose.
    assert f"nprobe {nprobe} chosen" in caplog.text and "quality: ANN recall@10 0." in caplog.text
    assert "probe Recall@K none" in caplog.text


def test_nprobe_given_is_kept_and_the_default_floor_refuses_what_misses_it(tmp_path, clustered):
    with pytest.raises(QualityGateError, match=r"ANN recall@10 0\.\d+ < floor 0\.9 \(search harder: --nprobe"):
        publish(tmp_path, clustered, factory="IVF256,Flat", nprobe=1)
    assert artifacts.current_version(tmp_path) is None
    forced = publish(tmp_path, clustered, factory="IVF256,Flat", search_params={"nprobe": 64}, nprobe=1, force=True)
    assert forced.manifest.search_params == {"nprobe": 1}  # --nprobe over --search-params'
    assert forced.manifest.quality.search_tuning is None and forced.manifest.quality_gate.forced
    given = publish(tmp_path, clustered, factory="IVF256,Flat", search_params={"nprobe": 32})
    assert given.manifest.search_params == {"nprobe": 32} and given.manifest.quality.search_tuning is None


def test_hnsw_without_ef_search_records_the_one_it_measured(tmp_path, clustered):
    version = publish(tmp_path, clustered[:2000], factory="HNSW16")
    ef = version.manifest.search_params["efSearch"]
    assert ef >= 16 and version.manifest.quality.search_tuning["value"] == ef
    assert version.manifest.quality.ann_recall_at_k >= 0.9


def test_a_faiss_failure_the_checks_do_not_foresee_is_a_value_error():
    vectors = np.random.default_rng(0).standard_normal((100, 16)).astype(np.float32)
    # OPQ trains a product quantizer of 256 codes on 100 vectors: faiss's own RuntimeError.
    with pytest.raises(ValueError, match=r"faiss could not build 'OPQ4,IVF4,Flat' over 100 vectors.*training points"):
        build_index(vectors, "OPQ4,IVF4,Flat", device="cpu")


def index_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "index", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, input=stdin
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_images(folder, 300)
    return folder


@pytest.mark.parametrize("command", ["build", "rebuild"])
@pytest.mark.parametrize(
    "factory, fragments",
    [
        ("Flatt", ["invalid faiss factory string 'Flatt' for 16-d vectors: could not parse index string Flatt"]),
        ("IVF4096,Flat", ["(300 rows)", "has 4096 lists", "there are 300", "about 7 lists", "'IVF7,Flat'"]),
        # 300 rows, but a sample of 100 to train on: fewer than a code book's 256 codes.
        ("IVF8,PQ4", ["(300 rows, --train-size 100)", "code books of 256 codes", "there are 100"]),
    ],
)
def test_a_factory_the_catalog_cannot_train_is_refused_before_anything_is_embedded(
    model, photos, tmp_path, command, factory, fragments
):
    extra = ("--train-size", "100") if "PQ" in factory else ()
    done = index_cli(
        command, "--model", str(model), "--catalog", str(photos), "--index-root", str(tmp_path / "index"),
        "--factory", factory, *extra, "--no-progress",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert "loaded model" not in done.stderr  # the model was never loaded: nothing was embedded
    assert not (tmp_path / "index").exists() or artifacts.current_version(tmp_path / "index") is None


def test_lists_too_many_for_the_catalog_are_one_rule_in_the_projects_words(model, photos, tmp_path):
    """300 images took IVF256 with faiss's own "please provide at least 9984 training points" on
    stderr, but IVF512 was refused with "use about 7 lists" (issue 40, item 10): under 39 training
    vectors a list is built with the project's warning, under one a list refused, both with the
    same advice."""
    done = index_cli(
        "build", "--model", str(model), "--catalog", str(photos), "--index-root", str(tmp_path / "index"),
        "--factory", "IVF256,Flat", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "please provide" not in done.stderr and "WARNING clustering" not in done.stderr, done.stderr
    advice = "use about 7 lists for 300 vectors (~4√n, at most n/39), e.g. 'IVF7,Flat', or Flat"
    warned = [line for line in done.stderr.splitlines() if "k-means wants" in line]
    assert len(warned) == 1 and " WARNING " in warned[0], done.stderr
    assert warned[0].endswith(
        "factory 'IVF256,Flat' has 256 lists and k-means wants 39 training vectors a list (9,984), but there are "
        f"300: built, with lists placed poorly and recall uneven; {advice}"
    ), warned[0]
    refused = index_cli(
        "build", "--model", str(model), "--catalog", str(photos), "--index-root", str(tmp_path / "index"),
        "--factory", "IVF512,Flat", "--no-progress",
    )  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.strip().endswith(advice), refused.stderr


@pytest.mark.parametrize("field", ["emoji", "label"])
def test_an_item_field_the_catalog_lacks_is_named_by_its_own_flag(model, photos, tmp_path, field):
    """It was refused as `--filterable emoji`, a flag the user never typed (issue 40, item 12)."""
    done = index_cli(
        "build", "--model", str(model), "--catalog", str(photos), "--index-root", str(tmp_path), "--item-field", field,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    missing = f"no column '{field}'" if field != "label" else "no label column"
    assert done.stderr.strip().splitlines() == [f"error: {photos}: --item-field {field}: the catalog has {missing}"]


def test_add_of_unlabelled_images_to_a_root_grouped_by_label_names_the_root_not_a_flag(model, photos, tmp_path):
    """`index add` said `--item-field label: the catalog has no label column` to a user who never
    typed the flag: the root's first build did (issue 63)."""
    for n, kind in enumerate(("circle", "square")):
        write_images(tmp_path / "classes" / kind, 20, seed=n)
    root = tmp_path / "index"
    built = index_cli(
        "build", "--model", str(model), "--catalog", str(tmp_path / "classes"), "--index-root", str(root),
        "--item-field", "label", "--factory", "Flat", "--no-progress",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    # Where to look first (issue 63): the build says where it drew its sample queries' neighbours.
    assert f"sample queries and their neighbours: {built.stdout.strip()}/neighbours.png" in built.stderr
    done = index_cli("add", "--catalog", str(photos), "--index-root", str(root), "--no-progress")
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if " INFO " not in line] == [
        f"error: {photos}: the versions of {root} group their items by the item field 'label', set when the root "
        "was built (--item-field label), and this catalog has no label column: give its rows labels (a folder per "
        "class)"
    ]


def test_list_and_rollback_on_a_folder_without_index_versions_say_so(model, tmp_path):
    """`index list` on a model folder exited 0 printing nothing (issue 40, item 13)."""
    for command in ("list", "rollback"):
        done = index_cli(command, "--index-root", str(model))
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: {model} holds no index versions (it looks like a model folder: it holds model.onnx); an "
            f"index root holds versions/ and CURRENT, written by `python -m index build --index-root {model}`"
        ]
    (tmp_path / "empty").mkdir()
    done = index_cli("list", "--index-root", str(tmp_path / "empty"))
    assert done.returncode == 2 and f"error: {tmp_path / 'empty'} holds no index versions; an index" in done.stderr


def listing(root: Path) -> str:
    done = index_cli("list", "--index-root", str(root))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_one_size_through_remove_and_add_and_add_defaults_to_the_live_model(model, photos, tmp_path):
    root = tmp_path / "index"
    built = index_cli(
        "build", "--model", str(model), "--catalog", str(photos), "--index-root", str(root), "--factory", "HNSW16",
        "--no-progress",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "published index" in built.stderr and "(300 items)" in built.stderr
    first = listing(root)
    assert "size=300  factory=HNSW16  search=efSearch=" in first and "ann_R@10=" in first
    assert "probe_R@1=-" in first and "None" not in first  # unlabelled: no probe figure

    # A takedown from standard input: one summary, the new version's directory on stdout.
    removed = index_cli(
        "remove", "--index-root", str(root), "--ids", "-", stdin="img-0000.png\nimg-0001.png\nimg-0002.png\n"
    )
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == str(artifacts.version_dir(root))
    assert removed.stderr.count("removed 3 of 3 requested ids") == 1 and "(297 items)" in removed.stderr
    live = IndexVersion.open(root).load()
    assert live.size == live.manifest.live_size == 297 and live.index.ntotal == 300  # HNSW: masked rows
    assert "size=297 (+3 removed, masked)" in listing(root)

    # Add without --model: the live version's model. Three new images, the three masked rows stay.
    new = tmp_path / "new"
    write_images(new, 3, seed=1, prefix="new")
    added = index_cli("add", "--index-root", str(root), "--catalog", str(new), "--no-progress")
    assert added.returncode == 0, added.stderr
    assert "(300 items, 2 segments, 3 deleted): added 3 items" in added.stderr
    live = IndexVersion.open(root).load()
    assert live.size == live.manifest.live_size == live.manifest.rows.indexed == 300 and live.index.ntotal == 303
    assert live.manifest.model_dir == str(model.resolve())
    assert "size=300 (+3 removed, masked)" in next(line for line in listing(root).splitlines() if line[0] == "*")

    # The same rows again: what to do about it, by name.
    again = index_cli("add", "--index-root", str(root), "--catalog", str(new), "--no-progress")
    assert again.returncode == 2 and "already in version" in again.stderr and "pass --upsert" in again.stderr
    assert "'new-0000.png'" in again.stderr  # what an id of a folder catalog looks like
    # A takedown that takes nothing down is an error, not a success.
    ghost = index_cli("remove", "--index-root", str(root), "--ids", "-", stdin="img-0000.png\nghost.png\n")
    assert ghost.returncode == 2, ghost.stderr
    assert "error: none of the 2 ids is in version" in ghost.stderr and "nothing was published" in ghost.stderr


def test_add_names_the_missing_model_of_the_live_version(model, photos, tmp_path):
    root = tmp_path / "index"
    cfg = BuildConfig(model=str(tmp_path / "gone"), index_root=str(root))
    new = NewVersion(
        "tiny000000000000",
        np.eye(4, 16, dtype=np.float32),
        ItemTable([f"i{n}" for n in range(4)], None, [f"/x/{n}.png" for n in range(4)], [{}] * 4),
        root / "c.csv",
        RowCounts(4, 4),
        time.perf_counter(),
        0,
    )
    publish_index_version(
        new, cfg.index_recipe, cfg.gate_thresholds, cfg.probe, cfg.filterable_fields, cfg.item_field, cfg.publish_target
    )
    done = index_cli("add", "--index-root", str(root), "--catalog", str(photos), "--no-progress")
    assert done.returncode == 2 and "no --model given" in done.stderr and "pass --model" in done.stderr
    assert str(tmp_path / "gone") in done.stderr


def test_a_manifest_that_disagrees_with_its_files_is_refused(tmp_path, clustered):
    version = publish(tmp_path, clustered[:100], factory="Flat")
    manifest = version.manifest
    IndexManifest.from_dict({**manifest.to_dict(), "deleted_rows": 3}).write(version.directory)
    with pytest.raises(
        ArtifactError, match="the manifest counts 100 rows, 3 of them deleted; the files hold 100 rows, 0"
    ):
        IndexVersion.open(tmp_path).load()
