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

# Importing the loss modules is what fills the registry.
from . import direct_gradient, histogram, pair_based, proxy_anchor, proxy_based, raw_vthm, reference  # noqa: F401
from .registry import (
    LOSSES,
    available_losses,
    build_loss,
    get_loss_class,
    loss_requires_num_classes,
    register_loss,
)
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

LOSSES.alias("multi_similarity", "raw_vthm", options={"margin": "gamma", "epsilon": "margin"})
