"""Small variants of real timm architectures for fast tests."""

from __future__ import annotations

from training.models.models import (
    BACKBONES,
    register_backbone,
)
from training.models.timm_backbones import timm_backbone

TINY_VIT = {"depth": 2, "embed_dim": 64, "num_heads": 2}


TINY = {
    "tiny_vit_s16": ("vit_small_patch16_224", TINY_VIT),
    "tiny_dinov2_s14": ("vit_small_patch14_dinov2", TINY_VIT),
    "tiny_siglip_b16": ("vit_base_patch16_siglip_224", TINY_VIT),
    "tiny_convnext": ("convnext_tiny", {"depths": (1, 1, 1, 1), "dims": (16, 32, 48, 64)}),
}


def register_tiny() -> None:
    """Small variants of real timm architectures, registered as a user would register their own."""
    for name, (arch, kwargs) in TINY.items():
        if name not in BACKBONES:
            register_backbone(name, timm_backbone(arch, **kwargs))
