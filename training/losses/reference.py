"""pytorch-metric-learning's versions of our losses, registered for side-by-side comparisons.

Training them through the same registry gives an identical setup (backbone, sampler, epochs,
seeds) for the comparison the README reports. pytorch-metric-learning is a dev dependency
only, so these register themselves only where it is installed.
"""

from __future__ import annotations

import torch
from torch import nn

from .registry import LOSSES

try:
    from pytorch_metric_learning import losses as pml_losses
    from pytorch_metric_learning import miners as pml_miners
except ImportError:  # production installs: the comparison losses are simply absent
    pml_losses = None


if pml_losses is not None:

    @LOSSES.register("pml_multi_similarity")
    class PMLMultiSimilarity(nn.Module):
        """MultiSimilarityMiner(epsilon=margin) + MultiSimilarityLoss(α, β, base=γ): RAW+VTHM's library twin."""

        def __init__(self, alpha: float = 2.0, beta: float = 50.0, gamma: float = 0.5, margin: float = 0.1) -> None:
            super().__init__()
            self.miner = pml_miners.MultiSimilarityMiner(epsilon=margin)
            self.loss = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=gamma)

        def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.loss(embeddings, labels, self.miner(embeddings, labels))

    @LOSSES.register("pml_proxy_anchor")
    class PMLProxyAnchor(nn.Module):
        """The library's ProxyAnchorLoss (α=32, δ=0.1) with its own proxy initialisation."""

        requires_num_classes = True

        def __init__(self, num_classes: int, embedding_dim: int, alpha: float = 32.0, margin: float = 0.1) -> None:
            super().__init__()
            self.loss = pml_losses.ProxyAnchorLoss(num_classes, embedding_dim, margin=margin, alpha=alpha)

        def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.loss(embeddings, labels)
