"""The loss registry: a name → loss class table (`core.registry.Registry`, as backbones and
datasets use) and the functions that build from it. Loss modules register into it with
``@LOSSES.register("name")``; the package imports them, so ``training.losses`` lists every loss."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from core.registry import Registry

LOSSES: Registry[type[nn.Module]] = Registry("loss", plural="losses", base=nn.Module, base_label="nn.Module")


# The functions below look LOSSES up when called, so a test can swap in a copy of the registry.
def register_loss(name: str) -> Any:
    """Class decorator adding a loss to the registry under ``name``."""
    return LOSSES.register(name)


def available_losses() -> list[str]:
    """Sorted names of every registered loss (aliases excluded)."""
    return LOSSES.names()


def get_loss_class(name: str) -> type[nn.Module]:
    """The class registered under ``name`` (or the name it aliases); ``ValueError`` listing the known names."""
    return LOSSES.get(name)


def loss_requires_num_classes(name: str) -> bool:
    """Whether the loss needs ``num_classes`` and ``embedding_dim`` (proxy-based losses)."""
    return bool(getattr(get_loss_class(name), "requires_num_classes", False))


def build_loss(name: str, **options: Any) -> nn.Module:
    """Instantiate the loss registered under ``name`` with keyword ``options``.

    Raises ``ValueError`` for an unknown name and ``TypeError`` naming the offending option for
    unknown or missing options (checked against the constructor signature before calling it, so
    the message lists the valid options). Invalid option values raise the loss's own
    ``ValueError``.
    """
    return LOSSES.create(name, **options)
