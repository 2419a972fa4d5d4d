"""timm trunks exported, indexed and served (issue 35): the parity gate on real images for a
ViT, a DINOv2-architecture ViT with 14-px patches and a ConvNeXt; fp16/int8 variants with their
recall drop; and the day-one chain on the command line with every socket refused — random
vit_tiny weights saved as a Hugging Face / timm folder, exported with no training run, equal to
the in-memory model, indexed with `python -m index build` and searched over gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from core.artifacts.layout import read_manifest
from core.artifacts.model_manifests import ModelManifest
from core.data.catalog import read_catalog
from core.data.preprocess import load_image
from index.embedder import OnnxEmbedder
from tests.support.timm import register_tiny
from training.export.export import ExportConfig, run_export
from training.models.models import EmbeddingNet

ROOT = Path(__file__).resolve().parents[2]
SOCKET_BLOCKER = """
import socket

def _refuse(*args, **kwargs):
    raise OSError("network blocked by the test: nothing may reach a hub")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.create_connection = _refuse
"""

register_tiny()


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """A class-folder tree of 8 classes × 5 pictures: shapes and colours drawn per class, moved,
    scaled and tinted per picture, saved as JPEG and PNG (decoded like any catalog's photos)."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for c in range(8):
        folder = root / f"class{c}"
        folder.mkdir()
        colour = tuple(int(v) for v in rng.integers(40, 255, 3))
        for i in range(5):
            w, h = int(rng.integers(90, 160)), int(rng.integers(80, 140))
            background = tuple(int(v) for v in rng.integers(0, 80, 3))
            image = Image.new("RGB", (w, h), background)
            draw = ImageDraw.Draw(image)
            x, y = int(rng.integers(0, w // 3)), int(rng.integers(0, h // 3))
            box = (x, y, x + w // 2, y + h // 2)
            [draw.ellipse, draw.rectangle, draw.polygon][c % 3](
                box if c % 3 < 2 else [(x, y + h // 2), (x + w // 4, y), (x + w // 2, y + h // 2)], fill=colour
            )
            draw.line((0, (c * 17) % h, w, h - 1), fill=(255 - colour[0], 128, colour[2]), width=1 + c % 4)
            image.save(folder / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


def random_weights(name: str, size: int, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    net = EmbeddingNet(name, None, image_size=size)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(net.backbone.model.state_dict(), str(folder / "model.safetensors"))
    return folder / "model.safetensors"


@pytest.mark.parametrize(
    "name, size, pooling",
    [("tiny_vit_s16", 32, "cls"), ("tiny_dinov2_s14", 56, "mean"), ("tiny_convnext", 64, "gap")],
    ids=["vit", "dinov2-patch14", "convnext"],
)
def test_the_parity_gate_holds_for_each_family_on_real_images(name, size, pooling, photos, tmp_path):
    weights = random_weights(name, size, tmp_path / "weights", seed=size)
    cfg = ExportConfig(
        backbone=name,
        pretrained=str(weights),
        pooling=pooling,
        image_size=size,
        parity_catalog=str(photos),
        parity_images=40,
        out=str(tmp_path / "model"),
    )
    out = run_export(cfg)
    manifest = ModelManifest.read(out)
    assert manifest.parity["images"] == 40 and manifest.parity["source"] == str(photos.resolve())
    assert manifest.parity["min_cosine"] >= 0.9999, manifest.parity
    assert manifest.backbone == name and manifest.pooling == pooling and manifest.loss is None
    assert manifest.input.interpolation == "bicubic" and manifest.input.height == size


def test_variants_of_a_day_one_vit_measure_their_recall_drop(photos, tmp_path):
    weights = random_weights("tiny_vit_s16", 32, tmp_path / "weights", seed=5)
    out = run_export(
        ExportConfig(
            backbone="tiny_vit_s16",
            pretrained=str(weights),
            image_size=32,
            parity_catalog=str(photos),
            out=str(tmp_path / "model"),
            variants=["fp16", "int8"],
        )
    )
    for name in ("fp16", "int8"):
        variant = ModelManifest.read(out.with_name(f"model-{name}")).variant
        assert variant["name"] == name and variant["test_images"] == 40
        assert set(variant["recall_drop"]) == {"1", "2", "4", "8"}
        assert variant["size_bytes"] < variant["base_size_bytes"]


def python(*args: str, blocked: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if blocked is not None:  # sitecustomize runs first in the child: every socket refused
        env["PYTHONPATH"] = os.pathsep.join([str(blocked), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_day_one_vit_is_exported_indexed_and_served_offline(photos, tmp_path):
    import timm

    from serving.client import SearchClient
    from serving.config import ServerConfig
    from tests.support.server import SearchServer

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(SOCKET_BLOCKER)
    probe = python("-c", "import socket; socket.create_connection(('127.0.0.1', 9))", blocked=blocked)
    assert probe.returncode != 0 and "network blocked by the test" in probe.stderr

    # A user's weights as the hub stores them: model.safetensors + config.json (timm's layout).
    torch.manual_seed(7)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32).eval()
    folder = tmp_path / "vit_tiny_patch16_224.local"
    folder.mkdir()
    save_file(reference.state_dict(), str(folder / "model.safetensors"))
    config = {"architecture": "vit_tiny_patch16_224", "num_classes": 0, "pretrained_cfg": {"input_size": [3, 32, 32]}}
    (folder / "config.json").write_text(json.dumps(config))

    model = tmp_path / "model"
    done = python(
        "-m", "training", "export", "--backbone", "timm:vit_tiny_patch16_224", "--pretrained", str(folder),
        "--parity-catalog", str(photos), "--parity-images", "24", "--out", str(model), blocked=blocked,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = read_manifest(model)
    assert manifest["backbone"] == "timm:vit_tiny_patch16_224" and manifest["pooling"] == "cls"
    assert manifest["embedding_dim"] == 192 and manifest["parity"]["min_cosine"] >= 0.9999
    assert manifest["input"]["height"] == 32 and manifest["input"]["interpolation"] == "bicubic"
    assert manifest["pretrained"]["source"] == str(folder)

    # The published model answers what the in-memory network answers, within 1e-5.
    contract = ModelManifest.read(model).input
    paths = read_catalog(photos).paths[:12]
    images = np.stack([load_image(p, contract) for p in paths])
    mean = torch.tensor(contract.mean).view(1, 3, 1, 1)
    std = torch.tensor(contract.std).view(1, 3, 1, 1)
    with torch.no_grad():
        tokens = reference.forward_features((torch.from_numpy(images) - mean) / std)
        expected = torch.nn.functional.normalize(reference.forward_head(tokens, pre_logits=True), dim=1).numpy()
    got = OnnxEmbedder(model, provider="cpu").embed(images)
    assert np.abs(got - expected).max() <= 1e-5

    root = tmp_path / "index"
    built = python("-m", "index", "build", "--model", str(model), "--catalog", str(photos), "--index-root", str(root))
    assert built.returncode == 0, built.stderr[-3000:]
    server = SearchServer(ServerConfig.flat(index_root=str(root), port=0, metrics_port=None, probe_interval_s=0))
    server.start()
    try:
        with SearchClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            catalog = read_catalog(photos)
            for row in (0, 13, 27):
                answer = client.search_image(catalog.paths[row], k=3)
                assert answer.neighbors[0].id == catalog.ids[row]
                assert answer.neighbors[0].score == pytest.approx(1.0, abs=1e-4)
                assert answer.model_id == manifest["model_id"]
    finally:
        server.stop(grace=0)
