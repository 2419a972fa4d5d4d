"""Cosine similarity and the masked log-sum-exp shared by every loss in the registry.

Keeping one implementation means every loss sees exactly the same ``s_ij`` (same
normalisation epsilon, same matmul order), so mining thresholds and test oracles agree to the
last bit, and mixed precision is handled in one place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cosine_similarity_matrix", "log1p_sum_exp"]

# Same epsilon as torch.nn.functional.normalize's default (and pytorch-metric-learning's
# CosineSimilarity), so a zero vector maps to the zero vector (similarity 0 to everything)
# instead of NaN.
_NORM_EPS = 1e-12

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def cosine_similarity_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine similarities between the rows of ``x`` and the rows of ``y`` (default: ``x``).

    Rows are L2-normalised here, so callers may pass raw embeddings of any norm. Half and
    bfloat16 inputs are computed in float32 with autocast disabled: mining compares
    similarities to thresholds 0.1 apart and the losses exponentiate them with scales up to
    50, which fp16's ~1e-3 resolution would visibly distort.
    """
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D (n, d) tensor, got shape {tuple(x.shape)}")
    if y is not None and (y.ndim != 2 or y.shape[1] != x.shape[1]):
        raise ValueError(f"y must be 2-D with the same width as x ({x.shape[1]}), got shape {tuple(y.shape)}")
    with torch.autocast(device_type=x.device.type, enabled=False):
        if x.dtype in _LOW_PRECISION:
            x = x.float()
        x_n = F.normalize(x, p=2.0, dim=1, eps=_NORM_EPS)
        if y is None:
            y_n = x_n
        else:
            if y.dtype != x_n.dtype:
                y = y.to(x_n.dtype)
            y_n = F.normalize(y, p=2.0, dim=1, eps=_NORM_EPS)
        return x_n @ y_n.t()


def log1p_sum_exp(logits: torch.Tensor, keep: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``log(1 + sum_{k: keep} exp(logits_k))`` along ``dim``, numerically stable.

    Computed as a log-sum-exp over ``[0, logits...]`` with dropped entries at ``-inf``: the
    explicit 0 keeps the reduction finite (and its gradient NaN-free) when nothing is kept,
    in which case the result is exactly 0 and the gradient to every logit is exactly 0.
    """
    masked = logits.masked_fill(~keep, float("-inf"))
    shape = list(masked.shape)
    shape[dim] = 1
    zeros = masked.new_zeros(shape)
    return torch.logsumexp(torch.cat([zeros, masked], dim=dim), dim=dim)
