"""timm trunks in the backbone registry (issue 35): the architecture's own input contract and
pooling, the user's weights from a safetensors/.pth file or a Hugging Face / timm folder with
the network blocked, and every bad input refused with one `error:` line, nothing written.

Tiny configurations (2 blocks, 64 wide) keep each model a fraction of a second on a CPU; what
is tested is the architecture's code path, which depth and width do not change."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.data.preprocess import InputContract
from tests.support.timm import register_tiny
from training.models.models import (
    BACKBONES,
    TIMM_SHORT_NAMES,
    EmbeddingNet,
    backbone_spec,
    check_backbone,
    input_contract,
)

ROOT = Path(__file__).resolve().parents[2]


register_tiny()


@pytest.fixture
def offline(monkeypatch):
    """No connection can be opened: anything that tried to reach a hub would fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args[1:] or kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def embed(net: EmbeddingNet, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net.eval()(x)


# --- the registry, the contract, the pooling ----------------------------------------------


def test_short_names_are_timm_architectures_with_their_own_contract():
    assert set(TIMM_SHORT_NAMES) <= set(BACKBONES.names())
    vit = input_contract("vit_small_patch16")
    assert (vit.height, vit.resize, vit.interpolation) == (224, 249, "bicubic")  # crop_pct 0.9
    assert vit.mean == (0.5, 0.5, 0.5) and vit.std == (0.5, 0.5, 0.5)
    dinov2 = input_contract("vit_small_patch14_dinov2")
    assert (dinov2.height, dinov2.resize) == (518, 518) and dinov2.mean == (0.485, 0.456, 0.406)
    clip = input_contract("vit_base_patch16_clip")
    assert clip.mean[0] == pytest.approx(0.48145466) and clip.std[0] == pytest.approx(0.26862954)
    convnext = input_contract("convnext_tiny", 64)
    assert (convnext.height, convnext.resize, convnext.interpolation) == (64, 67, "bicubic")  # crop_pct 0.95
    # A tag picks that weights release's config; torchvision's CNNs keep bilinear.
    assert input_contract("timm:vit_small_patch16_224.dino").mean == (0.485, 0.456, 0.406)
    assert input_contract("resnet18").interpolation == "bilinear"
    # The contract travels through the manifest and back.
    assert InputContract.from_dict(vit.to_dict()) == vit
    assert InputContract.from_dict({"height": 8, "width": 8}).interpolation == "bilinear"  # older manifests


def test_each_family_pools_its_own_way_by_default():
    assert check_backbone("vit_small_patch16") == "cls"  # the class token
    assert check_backbone("tiny_siglip_b16") == "map"  # SigLIP's attention pooling
    assert check_backbone("convnext_tiny") == "gap"
    assert check_backbone("resnet18") == "gap"
    assert backbone_spec("vit_small_patch16").poolings == ("cls", "mean")
    assert backbone_spec("convnext_tiny").poolings == ("gap", "gmp", "gap+gmp")


def test_token_poolings_are_what_they_say():
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32)
    cls = EmbeddingNet("tiny_vit_s16", None, "cls", image_size=32).eval()
    model = cls.backbone.model
    with torch.no_grad():
        tokens = model.forward_features((x - cls.mean) / cls.std)
        # timm's own head on its class token, before the classifier: what the trunk answers.
        torch.testing.assert_close(cls.features(x), model.forward_head(tokens, pre_logits=True))
        mean = EmbeddingNet("tiny_vit_s16", None, "mean", image_size=32).eval()
        mean.load_state_dict(cls.state_dict())
        torch.testing.assert_close(mean.features(x), tokens[:, 1:].mean(dim=1))  # patch tokens only
    assert cls.embedding_dim == 64 and embed(cls, x).norm(dim=1).allclose(torch.ones(2))


def test_a_cnn_keeps_its_head_norm():
    """ConvNeXt pools, then LayerNorms: its features as timm answers them with no classifier."""
    torch.manual_seed(0)
    net = EmbeddingNet("tiny_convnext", None, image_size=64).eval()
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(net.features(x), net.backbone.model((x - net.mean) / net.std))
    gmp = EmbeddingNet("tiny_convnext", 16, "gmp", image_size=64)
    assert gmp.backbone.model.head.global_pool.pool_type == "max" and embed(gmp, x).shape == (2, 16)


# --- the user's weights, never a download ---------------------------------------------------


def save_folder(state: dict, folder: Path, config: dict | None) -> Path:
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_random_tiny_vit_weights_load_from_safetensors_offline(tmp_path, offline):
    torch.manual_seed(1)
    reference = EmbeddingNet("tiny_vit_s16", None, image_size=32)
    state = reference.backbone.model.state_dict()
    save_file(state, str(tmp_path / "model.safetensors"))
    torch.save(state, tmp_path / "model.pth")
    x = torch.rand(4, 3, 32, 32)
    expected = embed(reference, x)
    for source in (tmp_path / "model.safetensors", tmp_path / "model.pth"):
        loaded = EmbeddingNet("tiny_vit_s16", None, pretrained=source, image_size=32)
        assert (embed(loaded, x) - expected).abs().max() <= 1e-5, source
    # A training checkpoint's classifier head is not the trunk's: dropped, not refused.
    with_head = {**state, "head.weight": torch.zeros(10, 64), "head.bias": torch.zeros(10)}
    save_file(with_head, str(tmp_path / "classifier.safetensors"))
    loaded = EmbeddingNet("tiny_vit_s16", None, pretrained=tmp_path / "classifier.safetensors", image_size=32)
    assert (embed(loaded, x) - expected).abs().max() <= 1e-5


def test_a_timm_folder_brings_its_own_input_config(tmp_path, offline):
    torch.manual_seed(2)
    reference = EmbeddingNet("tiny_vit_s16", None, image_size=32)
    config = {
        "architecture": "vit_small_patch16_224",
        "num_classes": 0,
        "pretrained_cfg": {"input_size": [3, 32, 32], "mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6], "crop_pct": 1.0},
    }
    folder = save_folder(reference.backbone.model.state_dict(), tmp_path / "hf", config)
    contract = input_contract("tiny_vit_s16", None, folder)
    assert (contract.height, contract.resize, contract.mean, contract.std) == (32, 32, (0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    net = EmbeddingNet("tiny_vit_s16", None, pretrained=folder)  # its size from the folder: 32 px
    assert net.mean.flatten().tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert net.backbone.model.pos_embed.shape[1] == 1 + 2 * 2


def test_position_embeddings_are_resampled_to_another_input_size(tmp_path, offline):
    torch.manual_seed(3)
    small = EmbeddingNet("tiny_dinov2_s14", None, image_size=28)
    save_file(small.backbone.model.state_dict(), str(tmp_path / "w.safetensors"))
    larger = EmbeddingNet("tiny_dinov2_s14", None, pretrained=tmp_path / "w.safetensors", image_size=56)
    assert larger.backbone.model.pos_embed.shape[1] == 1 + 4 * 4
    assert torch.equal(larger.backbone.model.cls_token, small.backbone.model.cls_token)


def test_position_embeddings_timm_cannot_resample_are_refused(tmp_path, monkeypatch):
    import timm.models.vision_transformer as vision_transformer

    torch.manual_seed(3)
    small = EmbeddingNet("tiny_vit_s16", None, image_size=32)
    save_file(small.backbone.model.state_dict(), str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(vision_transformer, "checkpoint_filter_fn", lambda state, model: state)  # no converter
    with pytest.raises(ValueError, match=r"'pos_embed' is \[1, 5, 64\] in the file, \[1, 17, 64\].*--image-size"):
        EmbeddingNet("tiny_vit_s16", None, pretrained=tmp_path / "w.safetensors", image_size=64)


def test_bad_weights_are_named_precisely(tmp_path):
    convnext = EmbeddingNet("tiny_convnext", None, image_size=64).backbone.model.state_dict()
    save_file(convnext, str(tmp_path / "convnext.safetensors"))
    with pytest.raises(ValueError, match=r"first missing key 'cls_token'.*first unexpected key 'stages\.0\."):
        EmbeddingNet("tiny_vit_s16", None, pretrained=tmp_path / "convnext.safetensors", image_size=32)
    whole = (tmp_path / "convnext.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file, or truncated"):
        EmbeddingNet("tiny_convnext", None, pretrained=tmp_path / "cut.safetensors", image_size=64)
    (tmp_path / "text.safetensors").write_text("not a tensor file at all")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        EmbeddingNet("tiny_convnext", None, pretrained=tmp_path / "text.safetensors", image_size=64)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no model\.safetensors \(it holds pytorch_model\.bin\)"):
        EmbeddingNet("tiny_convnext", None, pretrained=tmp_path / "empty", image_size=64)
    other = save_folder(convnext, tmp_path / "other", {"architecture": "convnext_tiny"})
    with pytest.raises(ValueError, match="config.json is for timm architecture 'convnext_tiny', not 'vit_small"):
        EmbeddingNet("tiny_vit_s16", None, pretrained=other, image_size=32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backbone": "timm:vit_smal_patch16_224"}, "unknown timm architecture 'vit_smal_patch16_224'; nearest: "),
        ({"backbone": "timm:vit_small_patch16_224.nope"}, "has no config tagged 'nope'; its tags: augreg_in1k"),
        ({"backbone": "convnext_tiny", "pooling": "cls"}, "--pooling cls: convnext_tiny is a CNN"),
        ({"backbone": "vit_small_patch16", "pooling": "gap"}, "it takes cls, mean"),
        ({"backbone": "vit_small_patch16", "image_size": 100}, "16x16 patches; give a multiple of 16 (e.g. 96 or 112)"),
        ({"backbone": "tiny_convnext", "image_size": 16}, "--image-size 16: timm:convnext_tiny cannot take 16x16"),
        ({"backbone": "resnet18", "drop_path": 0.1}, "resnet18 has no drop path"),
    ],
)
def test_bad_backbone_options_are_refused_before_building(kwargs, message):
    backbone = kwargs.pop("backbone")
    with pytest.raises(ValueError) as info:
        check_backbone(backbone, **kwargs)
    assert message in str(info.value)


# --- the command line: one error line, exit 2, nothing written -------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Files for the command line: random vit_tiny_patch16_224 weights at 32 px, ConvNeXt's, bad ones."""
    import timm

    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32)
    save_file(vit.state_dict(), str(folder / "vit_tiny.safetensors"))
    convnext = EmbeddingNet("tiny_convnext", None, image_size=64).backbone.model.state_dict()
    save_file(convnext, str(folder / "convnext.safetensors"))
    whole = (folder / "vit_tiny.safetensors").read_bytes()
    (folder / "truncated.safetensors").write_bytes(whole[: len(whole) - 1000])
    (folder / "notes.safetensors").write_text("these are not weights")
    (folder / "no_weights").mkdir()
    (folder / "no_weights" / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    return {p.stem: p for p in folder.iterdir()}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


BAD_EXPORTS = {
    "unknown-architecture": (["--backbone", "timm:vit_tiny_patch16", "--pretrained", "vit_tiny"],
                             "error: unknown timm architecture 'vit_tiny_patch16'; nearest: vit_tiny_patch16_"),
    "another-architecture": (["--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32", "--pretrained",
                              "convnext"], "error: weights do not fit timm:vit_tiny_patch16_224: first missing key"),
    "truncated": (["--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32", "--pretrained", "truncated"],
                  "not a readable safetensors file, or truncated"),
    "not-safetensors": (["--backbone", "timm:vit_tiny_patch16_224", "--image-size", "32", "--pretrained", "notes"],
                        "not a readable safetensors file"),
    "folder-without-weights": (["--backbone", "timm:vit_tiny_patch16_224", "--pretrained", "no_weights"],
                               "has no model.safetensors (it holds config.json)"),
    "cls-on-a-cnn": (["--backbone", "convnext_tiny", "--pooling", "cls", "--pretrained", "convnext"],
                     "error: --pooling cls: convnext_tiny is a CNN (its features are a map); it takes gap, gmp"),
    "image-size": (["--backbone", "timm:vit_tiny_patch16_224", "--image-size", "40", "--pretrained", "vit_tiny"],
                   "error: --image-size 40: timm:vit_tiny_patch16_224 cuts images into 16x16 patches"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_EXPORTS)
def test_bad_inputs_to_export_are_one_error_line(case, weights, tmp_path):
    args, message = BAD_EXPORTS[case]
    args = [str(weights[a]) if a in weights else a for a in args]
    done = cli("training", "export", *args, "--out", str(tmp_path / "model"))
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a staging directory


def test_bad_inputs_to_train_write_nothing(weights, tmp_path):
    for args, message in (
        (["--backbone", "convnext_tiny", "--pooling", "cls"], "--pooling cls: convnext_tiny is a CNN"),
        (["--backbone", "vit_small_patch16", "--pretrained", str(weights["convnext"])], "first missing key"),
    ):
        done = cli("training", "train", *args, "--out", str(tmp_path / "run"), "--epochs", "1")
        assert done.returncode == 2 and message in done.stderr, done.stderr[-3000:]
        assert list(tmp_path.iterdir()) == []


def test_a_timm_trunk_without_weights_says_it_starts_random_and_how_to_give_weights(tmp_path):
    """Nothing said that timm's weights are never fetched (issue 40, item 12): the line comes
    at the start of training, before anything is read (here an unlabelled folder ends the run)."""
    from tests.support.index import write_images

    write_images(tmp_path / "photos", 3)
    done = cli("training", "train", "--backbone", "vit_small_patch16", "--catalog", str(tmp_path / "photos"),
               "--out", str(tmp_path / "run"))  # fmt: skip
    assert done.returncode == 2 and "error:" in done.stderr, done.stderr[-3000:]
    notices = [line for line in done.stderr.splitlines() if "starts from random weights" in line]
    assert len(notices) == 1, done.stderr[-3000:]
    for fragment in ("timm weights are never downloaded", "--pretrained with a .safetensors or .pth state dict",
                     "a Hugging Face / timm folder (model.safetensors + config.json)",
                     "docs/architecture.md, 'Weights for timm trunks'"):  # fmt: skip
        assert fragment in notices[0], notices[0]
    from training.models.models import random_start_notice

    assert random_start_notice("vit_small_patch16", "weights/vit.safetensors") is None
    assert random_start_notice("resnet50", None) is None  # torchvision's trunks: no hub to expect
