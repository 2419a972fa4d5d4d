"""Metric-learning losses behind a name registry (timm style), in pytorch-metric-learning's shape.

    from training.losses import build_loss, loss_requires_num_classes

    options = dict(cfg.loss_options)
    if loss_requires_num_classes(cfg.loss):
        options.update(num_classes=n_train_classes, embedding_dim=dim)
    criterion = build_loss(cfg.loss, **options)

A loss module registers itself with ``@LOSSES.register("name")`` (``core.registry.Registry``, the
registry backbones and datasets use too). Every loss derives from ``base.BaseMetricLoss``:
``PairBasedLoss`` (functions of the cosine-similarity matrix, with an optional miner from
``mining.py``: ``loss(embeddings, labels, indices_tuple=None)``) or ``ProxyBasedLoss`` (learnable
per-class ``proxies``; ``requires_num_classes = True``, taking ``num_classes`` and
``embedding_dim`` as constructor options, so the training loop needs no if-chain on loss
names). Per-element terms become the returned scalar through a reducer (``reducers.py``).

``multi_similarity`` is an alias of ``raw_vthm`` (the thesis's multi-similarity loss and mining
are RAW + VTHM) that keeps the thesis's option names: its ``margin`` is γ and its ``epsilon`` is
λ (raw_vthm's ``margin``).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from core.registry import Registry

from .similarity import cosine_similarity_matrix, log1p_sum_exp

__all__ = [
    "LOSSES",
    "available_losses",
    "build_loss",
    "cosine_similarity_matrix",
    "get_loss_class",
    "log1p_sum_exp",
    "loss_requires_num_classes",
    "register_loss",
]

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


# The loss modules register into LOSSES, so they are imported only after it exists; importing
# them here is what populates the registry.
from . import direct_gradient, histogram, pair_based, proxy_anchor, proxy_based, raw_vthm, reference  # noqa: E402, F401

LOSSES.alias("multi_similarity", "raw_vthm", options={"margin": "gamma", "epsilon": "margin"})
