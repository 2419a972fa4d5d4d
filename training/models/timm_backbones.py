"""timm trunks in the backbone registry: ViTs, DINOv2- and CLIP/SigLIP-architecture towers,
ConvNeXt, EfficientNetV2 — any timm architecture as `timm:<architecture>[.<tag>]`, a few by a
short name (`TIMM_SHORT_NAMES`).

timm supplies the architecture and its config (input size, mean/std, interpolation, crop), never
the weights: every model is created with `pretrained=False` and the hub's offline switches set,
and the user's own file (`model.safetensors`, a `.pth` state dict, or a Hugging Face / timm
folder) is loaded here, checked key by key. The trunk pools itself — class token, mean of the
patch tokens or attention pooling for transformers, the architecture's own head pooling for
CNNs — so the rest of `EmbeddingNet` sees one vector per image.

Imported only when a timm backbone is named: timm takes seconds to import.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.models.backbone_specs import POOLINGS, TOKEN_POOLINGS, BackboneSpec, TrunkOptions
from training.models.weight_files import check_weights_fit, folder_config, hub_offline

# Our pooling names → timm's global_pool for feature-map (CNN) heads. timm's avgmax is the
# mean of the two, ours (`Pooling`) their sum: the same direction, which is all an L2-normalised
# embedding keeps (a head in front learns the factor).
MAP_POOL_TYPES = {"gap": "avg", "gmp": "max", "gap+gmp": "avgmax"}
# timm's global_pool of a token model → our name for it (the architecture's own pooling).
TOKEN_DEFAULTS = {"token": "cls", "avg": "mean", "map": "map"}


def _timm():
    """timm, imported with the hub switched off: nothing here may reach a network, and timm
    only ever creates architectures (pretrained=False)."""
    hub_offline()
    import timm

    return timm


@dataclass(frozen=True)
class TimmInfo:
    """What the architecture is, read from a model built on the meta device (no memory, no
    compute): its config, whether its features are tokens or a map, what it can pool."""

    arch: str  # as given, possibly with a .tag (which picks the config: mean/std/size)
    config: dict[str, Any]  # timm's pretrained_cfg
    tokens: bool  # forward_features answers B×N×D tokens (a transformer) rather than a map
    patch: int | None  # the patch side of a transformer's patch embedding
    prefix_tokens: int
    class_token: bool
    attention_pool: bool  # SigLIP's MAP head
    default_pooling: str
    takes_img_size: bool  # the constructor takes img_size (position embeddings sized to it)
    dim: int  # the pooled vector's width

    @property
    def poolings(self) -> tuple[str, ...]:
        if not self.tokens:
            return POOLINGS
        usable = {"cls": self.class_token, "mean": True, "map": self.attention_pool}
        return tuple(p for p in TOKEN_POOLINGS if usable[p])

    @property
    def family(self) -> str:
        return "a transformer (its features are tokens)" if self.tokens else "a CNN (its features are a map)"


def _unknown_architecture(arch: str) -> ValueError:
    timm = _timm()
    base, _, tag = arch.partition(".")
    if timm.is_model(base):
        tags = [name.partition(".")[2] for name in timm.list_pretrained(f"{base}.*")]
        return ValueError(f"timm architecture {base!r} has no config tagged {tag!r}; its tags: {', '.join(tags)}")
    names = timm.list_models()
    nearest = difflib.get_close_matches(base, names, n=5, cutoff=0.6) or difflib.get_close_matches(
        base, names, n=5, cutoff=0.3
    )
    return ValueError(
        f"unknown timm architecture {base!r}; nearest: {', '.join(nearest) or '(none)'} "
        f"(timm.list_models() names all {len(names)})"
    )


def _create(arch: str, kwargs: dict[str, Any], side: int | None, drop_path: float = 0.0) -> nn.Module:
    timm = _timm()
    extra = dict(kwargs)
    if side is not None:
        extra["img_size"] = side
    if drop_path:
        extra["drop_path_rate"] = drop_path
    return timm.create_model(arch, pretrained=False, num_classes=0, **extra)


@lru_cache(maxsize=64)
def _info(arch: str, frozen_kwargs: tuple[tuple[str, Any], ...]) -> TimmInfo:
    timm = _timm()
    base, _, tag = arch.partition(".")
    if not timm.is_model(base):
        raise _unknown_architecture(arch)
    if tag:
        try:
            timm.models.get_pretrained_cfg(arch)
        except RuntimeError:
            raise _unknown_architecture(arch) from None
    kwargs = dict(frozen_kwargs)
    with torch.device("meta"):
        model = _create(arch, kwargs, None)
        config = dict(model.pretrained_cfg)
        side = int(config["input_size"][-1])
        features = model.forward_features(torch.zeros(1, 3, side, side))
    tokens = features.ndim == 3
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    try:  # whether position embeddings follow the input size (a ViT's img_size); a CNN takes any
        with torch.device("meta"):
            _create(arch, kwargs, side)
        takes_img_size = True
    except TypeError:
        takes_img_size = False
    default = TOKEN_DEFAULTS.get(str(getattr(model, "global_pool", "")), "mean") if tokens else "gap"
    if tokens:
        dim = features.shape[-1] if getattr(model, "attn_pool", None) is None else model.attn_pool(features).shape[-1]
    else:
        dim = model.forward_head(features, pre_logits=True).shape[-1]
    return TimmInfo(
        arch=arch,
        config=config,
        tokens=tokens,
        patch=int(patch[0]) if patch is not None else None,
        prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)),
        class_token=getattr(model, "cls_token", None) is not None,
        attention_pool=getattr(model, "attn_pool", None) is not None,
        default_pooling=default,
        takes_img_size=takes_img_size,
        dim=int(dim),
    )


class TimmTrunk(nn.Module):
    """A timm model as a trunk that pools: forward_features, then the pooling, then the norm the
    architecture puts after its pooling (a ViT's fc_norm, ConvNeXt's head norm)."""

    def __init__(self, model: nn.Module, info: TimmInfo, pooling: str) -> None:
        super().__init__()
        self.model = model
        self.tokens, self.pooling = info.tokens, pooling
        self.prefix_tokens = info.prefix_tokens
        if not info.tokens:
            # A CNN keeps its own head (pooling, then LayerNorm for ConvNeXt); only its pool type changes.
            model.reset_classifier(0, global_pool=MAP_POOL_TYPES[pooling])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.model.forward_features(x)
        if not self.tokens:
            return self.model.forward_head(features, pre_logits=True)
        if self.pooling == "cls":
            pooled = features[:, 0]
        elif self.pooling == "mean":  # the patch tokens only: class and register tokens are not the picture
            pooled = features[:, self.prefix_tokens :].mean(dim=1)
        else:  # "map": the architecture's own attention pooling (SigLIP)
            pooled = self.model.attn_pool(features)
        norm = getattr(self.model, "fc_norm", None)
        return pooled if norm is None else norm(pooled)


def timm_backbone(arch: str, **model_kwargs: Any) -> BackboneSpec:
    """The registry entry of a timm architecture (`model_kwargs` go to `timm.create_model`: a
    test's 2-block ViT, a depth or width of one's own)."""
    info = _info(arch, tuple(sorted(model_kwargs.items())))
    config = info.config
    crop = float(config.get("crop_pct") or 1.0)

    def check_size(side: int) -> None:
        _check_size(info, model_kwargs, side)

    def build(options: TrunkOptions) -> tuple[nn.Module, int]:
        check_size(options.image_size)
        native = int(config["input_size"][-1])
        side = options.image_size if info.takes_img_size and options.image_size != native else None
        try:
            model = _create(arch, model_kwargs, side, options.drop_path)
        except TypeError as exc:  # drop_path_rate on an architecture that has none
            raise ValueError(f"timm:{arch} cannot be built with drop path {options.drop_path}: {exc}") from None
        return TimmTrunk(model, info, options.pooling), info.dim

    return BackboneSpec(
        build=build,
        input_channels=int(config["input_size"][0]),
        default_size=int(config["input_size"][-1]),
        mean=tuple(float(m) for m in config["mean"]),
        std=tuple(float(s) for s in config["std"]),
        resize_ratio=1.0 / crop,
        load_weights=lambda trunk, state: load_timm_weights(trunk, state, arch),
        interpolation=_interpolation(config),
        poolings=info.poolings,
        default_pooling=info.default_pooling,
        family=info.family,
        check_size=check_size,
        weights_config=lambda source: _folder_contract(source, arch),
        trunk_pools=True,
        transformer=info.tokens,
        drop_path=True,
        layer_groups=_layer_groups,
    )


def _interpolation(config: dict[str, Any]) -> str:
    value = str(config.get("interpolation") or "bicubic")
    return value if value in ("bilinear", "bicubic", "nearest", "lanczos") else "bicubic"


def _check_size(info: TimmInfo, kwargs: dict[str, Any], side: int) -> None:
    """Refuse an input side the architecture cannot take, before anything is built or written."""
    name = f"timm:{info.arch}"
    native = int(info.config["input_size"][-1])
    if side == native:
        return
    if info.patch and side % info.patch:
        lower, upper = side // info.patch * info.patch, (side // info.patch + 1) * info.patch
        choices = f"{lower} or {upper}" if lower else str(upper)
        raise ValueError(
            f"--image-size {side}: {name} cuts images into {info.patch}x{info.patch} patches; "
            f"give a multiple of {info.patch} (e.g. {choices})"
        )
    if info.config.get("fixed_input_size") and not info.takes_img_size:
        raise ValueError(f"--image-size {side}: {name} takes only {native} px (its input size is fixed)")
    try:
        with torch.device("meta"):
            model = _create(info.arch, kwargs, side if info.takes_img_size else None)
            model.forward_features(torch.zeros(1, 3, side, side))
    except Exception as exc:  # noqa: BLE001 — timm's or torch's own words, said as one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--image-size {side}: {name} cannot take {side}x{side} images ({first})") from None


def _layer_groups(trunk: nn.Module, weight_decay: float, layer_decay: float) -> list[dict[str, Any]]:
    """timm's own layer-wise rate decay (BEiT's): parameter groups, each with an `lr_scale` of
    layer_decay^(layers above it) — the patch embedding learns least, the last block most — and
    no weight decay on norms, biases, position embeddings and the class token."""
    from timm.optim import param_groups_layer_decay

    assert isinstance(trunk, TimmTrunk)
    model = trunk.model
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    return param_groups_layer_decay(model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay)


# --- weights ---------------------------------------------------------------------------------


def load_timm_weights(trunk: nn.Module, state: dict[str, torch.Tensor], arch: str) -> None:
    """Load a state dict into a timm trunk, through timm's own converter for the architecture
    (original DINOv2/CLIP layouts; position embeddings resampled to the model's input size).
    Keys that do not fit → ValueError naming the first missing and unexpected ones."""
    assert isinstance(trunk, TimmTrunk)
    model = trunk.model
    name = f"timm:{arch}"
    convert = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    if convert is not None:
        try:
            state = convert(state, model)
        except Exception as exc:  # noqa: BLE001 — a converter fed another architecture's keys
            raise ValueError(f"weights do not fit {name}: timm's converter for it failed ({exc})") from None
    expected = model.state_dict()
    classifier = model.pretrained_cfg.get("classifier") or ()
    heads = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    # The checkpoint's classifier (ImageNet logits, CLIP's text projection) is not part of a trunk.
    state = {k: v for k, v in state.items() if k in expected or not k.startswith(tuple(f"{h}." for h in heads))}
    check_weights_fit(
        state,
        expected,
        name,
        "architecture",
        "weights of another architecture?",
        lambda key: (
            "; timm cannot resample this architecture's position embeddings: use its --image-size"
            if "pos_embed" in key
            else ""
        ),
    )
    model.load_state_dict(state, strict=True)


def _folder_contract(source: str | Path, arch: str) -> dict[str, Any]:
    """What a Hugging Face / timm folder's config.json says of the input (its pretrained_cfg:
    size, mean/std, interpolation, crop) — the weights' own, which may differ from the
    architecture's default tag; {} for a plain file. Refuses a folder made for another
    architecture."""
    config = folder_config(source)
    if config is None:
        return {}
    base = arch.partition(".")[0]
    named = config.get("architecture")
    if isinstance(named, str) and named.partition(".")[0] != base:
        raise ValueError(f"{source}: its config.json is for timm architecture {named!r}, not {base!r}")
    pretrained = config.get("pretrained_cfg") or {}
    values: dict[str, Any] = {}
    if pretrained.get("input_size"):
        values["default_size"] = int(pretrained["input_size"][-1])
    for key in ("mean", "std"):
        if pretrained.get(key):
            values[key] = tuple(float(v) for v in pretrained[key])
    if pretrained.get("interpolation"):
        values["interpolation"] = _interpolation(pretrained)
    if pretrained.get("crop_pct"):
        values["resize_ratio"] = 1.0 / float(pretrained["crop_pct"])
    return values


def timm_spec(arch: str) -> BackboneSpec:
    """The spec of `timm:<arch>` (cached: the architecture is inspected once per process)."""
    return _cached_spec(arch)


@lru_cache(maxsize=64)
def _cached_spec(arch: str) -> BackboneSpec:
    return timm_backbone(arch)
