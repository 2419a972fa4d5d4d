"""Proxy-Anchor loss (Kim et al., CVPR 2020), as in "Metric Learning: A Deep Dive" 2.3.2.5.

Eq. 2.31, with ``s(x, w)`` the cosine similarity, α the scale and δ the margin::

    L = 1/|W+| Σ_{w∈W+} log(1 + Σ_{x∈X+_w} exp(-α(s(x,w) - δ)))
      + 1/|W|  Σ_{w∈W}  log(1 + Σ_{x∈X-_w} exp( α(s(x,w) + δ)))

W+ is the set of proxies with at least one positive in the batch; the negative term averages
over all proxies (a proxy with no negative in the batch contributes 0 to it). The two terms are
two sub-losses of per-proxy elements, each through ``MeanReducer``: the positive one counts only
the proxies in W+, the negative one every proxy. (pytorch-metric-learning gets the same numbers
with a ``DivisorReducer``.)

The proxies are the ``proxies`` parameter so the optimiser can put them in their own parameter
group: the authors give them a learning rate about 100 times the backbone's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._common import check_finite, check_positive
from .base import ElementLosses, ProxyBasedLoss
from .registry import LOSSES
from .similarity import log1p_sum_exp

__all__ = ["ProxyAnchorLoss"]


@LOSSES.register("proxy_anchor")
class ProxyAnchorLoss(ProxyBasedLoss):
    """Proxy-Anchor loss with one learnable proxy per training class.

    Args:
        num_classes: number of training classes (one proxy each); labels must lie in
            ``[0, num_classes)``.
        embedding_dim: width of the embeddings and proxies.
        alpha: α, scale (> 0).
        margin: δ, margin.
    """

    def __init__(self, num_classes: int, embedding_dim: int, alpha: float = 32.0, margin: float = 0.1) -> None:
        super().__init__(num_classes, embedding_dim, reduction="mean")
        check_positive(alpha=alpha)
        check_finite(margin=margin)
        self.alpha = float(alpha)
        self.margin = float(margin)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "alpha": self.alpha,
            "margin": self.margin,
        }

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        """Eq. 2.31's per-proxy terms on (m, C) cosines."""
        pos = F.one_hot(labels, self.num_classes).bool()
        neg = ~pos
        pos_term = log1p_sum_exp(-self.alpha * (cos - self.margin), pos, dim=0)  # (C,)
        neg_term = log1p_sum_exp(self.alpha * (cos + self.margin), neg, dim=0)  # (C,)
        # W+ as a mask, so counting it needs no host sync.
        return {"pos_loss": ElementLosses(pos_term, pos.any(dim=0)), "neg_loss": ElementLosses(neg_term)}
