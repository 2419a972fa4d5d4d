"""Proxy-Anchor loss (Kim et al., CVPR 2020), as in "Metric Learning: A Deep Dive" 2.3.2.5.

Eq. 2.31, with ``s(x, w)`` the cosine similarity, α the scale and δ the margin::

    L = 1/|W+| Σ_{w∈W+} log(1 + Σ_{x∈X+_w} exp(-α(s(x,w) - δ)))
      + 1/|W|  Σ_{w∈W}  log(1 + Σ_{x∈X-_w} exp( α(s(x,w) + δ)))

W+ is the set of proxies with at least one positive in the batch; the negative term averages
over all proxies (a proxy with no negative in the batch contributes 0 to it).

The proxies are the ``proxies`` parameter so the optimiser can put them in their own parameter
group: the authors train them about 100x faster than the backbone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from . import register_loss
from .similarity import cosine_similarity_matrix, log1p_sum_exp

__all__ = ["ProxyAnchorLoss"]


@register_loss("proxy_anchor")
class ProxyAnchorLoss(nn.Module):
    """Proxy-Anchor loss with one learnable proxy per training class.

    Args:
        num_classes: number of training classes (one proxy each); labels must lie in
            ``[0, num_classes)``.
        embedding_dim: width of the embeddings and proxies.
        alpha: α, scale (> 0).
        margin: δ, margin.
    """

    requires_num_classes = True

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        alpha: float = 32.0,
        margin: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        if not math.isfinite(margin):
            raise ValueError(f"margin must be finite, got {margin!r}")
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.alpha = float(alpha)
        self.margin = float(margin)
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The official Proxy-Anchor code's initialisation; only directions matter (cosine),
        # but the scale interacts with the proxies' larger learning rate under Adam/AdamW.
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def hyperparameters(self) -> dict[str, Any]:
        """Resolved hyper-parameters, for run manifests."""
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "alpha": self.alpha,
            "margin": self.margin,
        }

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())

    def _check_inputs(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        if embeddings.ndim != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings must have shape (batch, {self.embedding_dim}), got {tuple(embeddings.shape)}")
        m = embeddings.shape[0]
        if m == 0:
            raise ValueError("ProxyAnchorLoss got an empty batch")
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
        if labels.ndim != 1 or labels.shape[0] != m:
            raise ValueError(f"labels must have shape ({m},) to match the batch, got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
        # One host sync per step; a label outside the proxy table would otherwise be a cryptic
        # one_hot/indexing error (or a silent device-side assert on CUDA).
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}) (num_classes={self.num_classes}); "
                f"got values in [{lo}, {hi}]"
            )

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check_inputs(embeddings, labels)
        labels = labels.to(device=embeddings.device, dtype=torch.long)
        cos = cosine_similarity_matrix(embeddings, self.proxies)  # (m, C)
        pos = torch.nn.functional.one_hot(labels, self.num_classes).bool()
        neg = ~pos
        pos_term = log1p_sum_exp(-self.alpha * (cos - self.margin), pos, dim=0)  # (C,)
        neg_term = log1p_sum_exp(self.alpha * (cos + self.margin), neg, dim=0)  # (C,)
        # |W+| >= 1 for a non-empty batch; kept as a tensor so no host sync is needed here.
        num_pos_proxies = pos.any(dim=0).sum().to(pos_term.dtype)
        return pos_term.sum() / num_pos_proxies + neg_term.sum() / self.num_classes
