"""What a backbone is to the rest of training: the options a trunk is built for (`TrunkOptions`),
how to build one and what input it wants (`BackboneSpec`), and the poolings there are.

The registry of backbones (`training/models/models.py`) and the timm trunks (`training/models/timm_backbones.py`)
both speak these types; they live here so neither module needs the other's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

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
