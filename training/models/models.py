"""Embedding networks: a backbone from a registry, pooling, a linear head, L2-normalised output.

Backbones are looked up by name (timm style, `core.registry.Registry`) rather than chosen by an
if-chain: torchvision's CNNs by name, any timm architecture as `timm:<architecture>` (a few by a
short name, `TIMM_SHORT_NAMES`; `training/models/timm_backbones.py`), each described by a `BackboneSpec`
(`training/models/backbone_specs.py`). Pretrained weights are only ever read from a local file, a Hugging
Face / timm folder or an installed package, never downloaded (`training/models/weight_files.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from core.data.preprocess import DEFAULT_REDUCING_GAP, InputContract
from core.registry import Registry
from training.models.backbone_specs import ALL_POOLINGS, POOLINGS, BackboneSpec, TrunkOptions
from training.models.weight_files import WEIGHTS_ACCEPTED, WEIGHTS_DOC, load_pretrained

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# Entries are specs, or functions that make one when first asked (timm's take seconds to import).
BACKBONES: Registry[BackboneSpec | Callable[[], BackboneSpec]] = Registry("backbone")
TIMM_PREFIX = "timm:"
# Short names of timm trunks (the ones the docs and the cost table speak of), each `timm:<arch>`.
TIMM_SHORT_NAMES: dict[str, str] = {
    "vit_small_patch16": "vit_small_patch16_224",  # ViT-S/16 (DeiT, AugReg, DINO weights)
    "vit_small_patch14_dinov2": "vit_small_patch14_dinov2",  # DINOv2 ViT-S/14
    "vit_base_patch16_clip": "vit_base_patch16_clip_224",  # CLIP ViT-B/16 image tower
    "convnext_tiny": "convnext_tiny",
    "efficientnetv2_s": "efficientnetv2_s",
}


def register_backbone(name: str, spec: BackboneSpec | Callable[[], BackboneSpec]) -> None:
    """Add a backbone under `name` (a spec, or a function making it on first use); a name is
    registered once."""
    BACKBONES.register(name, spec)


def available_backbones() -> list[str]:
    """Registered names; any timm architecture is also taken as `timm:<architecture>`."""
    return BACKBONES.names()


def backbone_spec(name: str) -> BackboneSpec:
    """The spec of `name`: a registered backbone, or `timm:<architecture>[.<tag>]`; ValueError
    listing the known backbones (or the nearest timm architectures) otherwise."""
    if name.startswith(TIMM_PREFIX):
        from training.models.timm_backbones import timm_spec

        return timm_spec(name[len(TIMM_PREFIX) :])
    return _made(BACKBONES.resolve(name))


@cache
def _made(name: str) -> BackboneSpec:
    entry = BACKBONES.get(name)
    return entry if isinstance(entry, BackboneSpec) else entry()


def _timm_short_name(arch: str) -> Callable[[], BackboneSpec]:
    return lambda: backbone_spec(TIMM_PREFIX + arch)


def resolve_pooling(backbone: str, pooling: str | None) -> str:
    """The pooling a backbone runs with: `pooling`, or its family's own when None (a ViT's class
    token, a CNN's average); ValueError when the family cannot pool that way."""
    spec = backbone_spec(backbone)
    if pooling is None:
        return spec.default_pooling
    if pooling not in spec.poolings:
        if pooling not in ALL_POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(ALL_POOLINGS)}, got {pooling!r}")
        raise ValueError(f"--pooling {pooling}: {backbone} is {spec.family}; it takes {', '.join(spec.poolings)}")
    return pooling


def check_backbone(
    backbone: str, pooling: str | None = None, image_size: int | None = None, drop_path: float = 0.0
) -> str:
    """Check a backbone's options before anything is built or written (a configuration's
    __post_init__); returns the pooling resolved."""
    spec = backbone_spec(backbone)
    resolved = resolve_pooling(backbone, pooling)
    if image_size is not None:
        if image_size <= 0:
            raise ValueError(f"--image-size must be positive, got {image_size}")
        if spec.check_size is not None:
            spec.check_size(image_size)
    if drop_path and not spec.drop_path:
        raise ValueError(f"--drop-path {drop_path}: {backbone} has no drop path (timm trunks have)")
    if not 0.0 <= drop_path < 1.0:
        raise ValueError(f"--drop-path must be in [0, 1), got {drop_path}")
    return resolved


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


def _torchvision_trunk(name: str) -> Callable[[TrunkOptions], tuple[nn.Module, int]]:
    return lambda options: _trunk(_classifier(name), name)


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
        build=lambda options: (lambda m: (m, m.out_channels))(SmallCNN(in_channels=1)),
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
for _short, _arch in TIMM_SHORT_NAMES.items():
    register_backbone(_short, _timm_short_name(_arch))


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
        pooling: str | None = None,
        pretrained: str | Path | None = None,
        freeze_bn: bool = False,
        image_size: int | None = None,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        spec = backbone_spec(backbone)
        if embedding_dim is not None and embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        pooling = check_backbone(backbone, pooling, image_size, drop_path)
        self.backbone_name, self.pooling = backbone, pooling
        # The weights' own normalisation (a timm folder's config.json) wins over the architecture's.
        contract = input_contract(backbone, image_size, pretrained)
        self.register_buffer("mean", torch.tensor(contract.mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(contract.std).view(1, -1, 1, 1))
        self.backbone, channels = spec.build(TrunkOptions(contract.height, pooling, drop_path))
        if pretrained is not None:
            load_pretrained(self.backbone, spec, pretrained)
        self.pool = nn.Identity() if spec.trunk_pools else Pooling(pooling)
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

    def layer_decay_groups(self, weight_decay: float, layer_decay: float) -> list[dict[str, Any]] | None:
        """The backbone's parameters in layer-wise rate-decay groups (each with an `lr_scale`), or
        None where the backbone has no layers to decay over (torchvision CNNs)."""
        spec = backbone_spec(self.backbone_name)
        if spec.layer_groups is None:
            return None
        groups = spec.layer_groups(self.backbone, weight_decay, layer_decay)
        return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]

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


def random_start_notice(backbone: str, pretrained: str | Path | None) -> str | None:
    """The line a timm trunk trained without --pretrained is started with (None otherwise): a
    user who expects timm's hub weights gets random ones, as timm here never downloads."""
    if pretrained is not None or not backbone_spec(backbone).trunk_pools:
        return None
    return (
        f"{backbone} starts from random weights: timm weights are never downloaded; for a pretrained start pass "
        f"--pretrained with {WEIGHTS_ACCEPTED} ({WEIGHTS_DOC})"
    )


def input_contract(backbone: str, size: int | None = None, pretrained: str | Path | None = None) -> InputContract:
    """The inference contract of a backbone: normalisation inside the graph, [0,1] pixels in,
    large images reduced cheaply before the fair resample (`InputContract.reducing_gap`), photos
    turned upright by their EXIF orientation, resized with the filter the network was trained
    with. The architecture's config sets size, mean/std, crop and filter; a weights folder's
    config.json (`pretrained`) overrides them, as those weights were trained."""
    spec = backbone_spec(backbone)
    own = dict(spec.weights_config(pretrained)) if pretrained is not None and spec.weights_config else {}
    side = size or own.get("default_size", spec.default_size)
    ratio = own.get("resize_ratio", spec.resize_ratio)
    resize = None if ratio is None else round(side * ratio)
    return InputContract(
        height=side,
        width=side,
        channels=spec.input_channels,
        resize=resize,
        mean=own.get("mean", spec.mean),
        std=own.get("std", spec.std),
        normalize_in_graph=True,
        reducing_gap=None if resize is None else DEFAULT_REDUCING_GAP,
        exif_orientation=True,
        interpolation=own.get("interpolation", spec.interpolation),
    )
