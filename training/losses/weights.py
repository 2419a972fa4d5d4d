"""The weight view of pair-based losses ("A unified view of deep metric learning via gradient analysis").

Theorem 3.1: a loss that depends on the embeddings only through the similarity matrix ``S`` is
gradient-equivalent to ``Σ_i (Σ_{k∈N_i} w_ik s_ik - Σ_{j∈P_i} w_ij s_ij)``, i.e. training with it
assigns each pair a weight ``w_ij = |∂L/∂s_ij|`` (Eq. 4, with the sign fixed by the pair's
kind). ``pair_weights`` computes these weights for any pair-based loss (``PairBasedLoss``) by
differentiating its ``loss_from_similarity`` with autograd, so there is one implementation for
every loss instead of one hand-derived formula each (RAW's Eq. 15-16 included):

* positive pairs: ``w_ij = -∂L/∂s_ij`` (the loss pulls them together when ``w > 0``);
* negative pairs: ``w_ij = +∂L/∂s_ij`` (pushed apart when ``w > 0``).

``s_ij`` and ``s_ji`` are separate entries: a loss summing over anchors puts anchor i's weight
on row i (the unified view's ``1/2`` of Eq. 3 folds the two together). Losses that read each
unordered pair once (histogram: ``i < j``) put the weight on the upper triangle.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ._common import label_masks
from .base import PairBasedLoss
from .registry import available_losses, build_loss, get_loss_class

__all__ = ["PairWeightView", "pair_based_losses", "pair_weights"]


class PairWeightView(NamedTuple):
    """m×m weights of positive and of negative pairs (0 off their masks and on the diagonal)."""

    positive: torch.Tensor
    negative: torch.Tensor


def pair_based_losses() -> list[str]:
    """Registered losses that are functions of the similarity matrix (no per-class parameters)."""
    return [name for name in available_losses() if issubclass(get_loss_class(name), PairBasedLoss)]


def pair_weights(
    loss: str | nn.Module,
    similarities: torch.Tensor,
    labels: torch.Tensor,
    reduced: bool = True,
    **options: Any,
) -> PairWeightView:
    """Per-pair weights ``(positive, negative)`` that ``loss`` assigns at ``similarities``.

    ``loss`` is a registered name (built with ``options``) or a loss module. The weights are the
    loss's exact gradient with respect to the (detached) similarity matrix, including any
    mining and the loss's reduction (a mean divides every weight by its count); with
    ``reduced=False`` they are the gradient of the plain sum of its per-element terms, i.e. the
    weights as the papers write them before any ``1/m``.
    """
    if isinstance(loss, str):
        module = build_loss(loss, **options)
    elif options:
        raise TypeError("options are only accepted with a loss name")
    else:
        module = loss
    if not isinstance(module, PairBasedLoss):
        raise ValueError(
            f"{type(module).__name__} is not a function of the similarity matrix; "
            f"pair-based losses: {', '.join(pair_based_losses())}"
        )
    sim = similarities.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        if reduced:
            value = module.loss_from_similarity(sim, labels)
        else:
            value = sum(terms.losses.sum() for terms in module.element_losses(sim, labels).values())
    (grad,) = torch.autograd.grad(value, sim, allow_unused=True)
    if grad is None:
        grad = torch.zeros_like(sim)
    pos, neg = label_masks(labels, sim.device)
    zero = torch.zeros_like(grad)
    return PairWeightView(torch.where(pos, -grad, zero), torch.where(neg, grad, zero))
