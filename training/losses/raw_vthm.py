"""RAW + VTHM loss: "A unified view of deep metric learning via gradient analysis", 5.1-5.2.

With ``s_ij`` the cosine similarity, ``P_i`` the other samples of anchor i's class and ``N_i``
the samples of other classes:

* VTHM (valid-triplet-based hard mining), per anchor i: ``p*`` = least similar positive,
  ``n*`` = most similar negative; keep negative j if ``s_ij > s_ip* - λ``, keep positive j if
  ``s_ij < s_in* + λ``. The kept sets are ``P~_i`` and ``N~_i``.
* RAW (Eq. 17), gradient-equivalent to the pair weights of Eq. 15-16::

      L = 1/m Σ_i [ 1/α log(1 + Σ_{k∈P~_i} exp(-α(s_ik - γ)))
                  + 1/β log(1 + Σ_{k∈N~_i} exp( β(s_ik - γ))) ]

  so ``∂L/∂s_ij = -w_ij/m`` for a kept positive and ``+w_ij/m`` for a kept negative, with
  ``w_ij`` from Eq. 15/16 (``pair_weights``).

Defaults are the paper's: α=2, β=50, γ=0.5, λ=0.1.

Edge cases and how this implementation handles them
----------------------------------------------------
1. Anchor whose class has no other sample in the batch (singleton class): ``p*`` does not
   exist, so no valid triplet exists and VTHM keeps nothing for it (``min`` over an empty set
   is taken as +inf, so ``s_ij > +inf - λ`` never holds). It contributes exactly 0 but still
   counts in ``m``. Its sample still serves as a negative for the other anchors.
2. Anchor with no negative in the batch: ``n*`` is -inf, no positive is kept, contribution 0.
3. Batch of a single class (or a single sample): every anchor is case 2, the loss is exactly
   0.0 and still has a ``grad_fn`` connected to the embeddings, so ``backward()`` works and
   yields all-zero gradients (no NaN: the log-sum-exp always includes the explicit ``0`` term).
4. Batch with all-distinct labels: every anchor is case 1, loss exactly 0 as in 3.
5. Self-pairs are never positives (the diagonal is excluded even though ``s_ii = 1``).
6. Duplicated embeddings at different indices are ordinary pairs with ``s = 1`` (a duplicate of
   another class is the hardest possible negative and makes every positive of that anchor
   kept). Their normalised rows are bit-identical, so they behave identically.
7. Ties for the hardest positive / negative: only the threshold value ``s_ip*`` / ``s_in*``
   matters, never which index attains it, so ties cannot change the result.
8. Pairs exactly at a threshold are dropped: the paper's inequalities are strict, and they are
   evaluated in the paper's form (``s_ij > s_ip* - λ``, ``s_ij < s_in* + λ``).
   pytorch-metric-learning's miner evaluates ``s_ij + λ > s_ip*`` and ``s_ij - λ < s_in*``,
   which can round differently within ~1 ulp of a threshold; nowhere else.
9. Mining is not differentiated: the kept sets are computed from detached similarities
   (``torch.no_grad``) and act as constant masks, so no gradient flows through the ``min``/
   ``max`` that pick ``p*``/``n*``; those pairs get gradient only from their own Eq. 17 terms.
10. Kept sets are per anchor, so pair {i, j} may be kept for anchor i and not for anchor j;
    the gradient of ``s_ij`` then only carries anchor i's term. (Symmetric pairs are two
    separate entries of the m×m matrix, as in the paper's sum over i and k.)
11. Averaging: the sum is divided by the batch size ``m``, including anchors that kept nothing
    (the paper's 1/m). pytorch-metric-learning's default MeanReducer does the same.
12. pytorch-metric-learning returns 0 when the miner yields at most one positive and at most
    one negative pair in the whole batch. The paper has no such rule; here such a batch gives
    the Eq. 17 value of those pairs (tests pin this).
13. Input norm: rows are L2-normalised here, so the loss is invariant to each embedding's
    norm. A zero vector normalises to zero (similarity 0 to everything) rather than NaN.
14. Overflow: β(s - γ) and -α(s - γ) go through a stable log-sum-exp with masked entries at
    -inf, so large β (or similarities near ±1) never overflow.
15. Mixed precision: fp16/bf16 embeddings (or autocast) are upcast to float32 for the
    similarity matrix, the mining comparisons and the loss.
16. Labels may be any integer values in any order (only equality is used); they must be a 1-D
    tensor of length ``m``. An empty batch raises ``ValueError`` (``1/m`` is undefined).
17. ``mining=False`` gives plain RAW over all positives and negatives (the paper's "RAW"
    ablation): the singleton/one-class rules 1-4 then no longer zero an anchor's other term,
    e.g. a one-class batch still has its positive terms.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from . import register_loss
from .similarity import cosine_similarity_matrix, log1p_sum_exp

__all__ = ["PairMasks", "PairWeights", "RawVthmLoss"]


class PairMasks(NamedTuple):
    """Boolean m×m masks of the pairs kept for each anchor (row)."""

    positive: torch.Tensor
    negative: torch.Tensor


class PairWeights(NamedTuple):
    """m×m pair weights of Eq. 15 (positive) and Eq. 16 (negative); 0 where not kept."""

    positive: torch.Tensor
    negative: torch.Tensor


def _check_labels(labels: torch.Tensor, m: int) -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != m:
        raise ValueError(f"labels must have shape ({m},) to match the batch, got {tuple(labels.shape)}")


@register_loss("raw_vthm")
class RawVthmLoss(nn.Module):
    """RAW loss (Eq. 17) over the pairs kept by VTHM mining.

    Args:
        alpha: α, scale of the positive terms (> 0).
        beta: β, scale of the negative terms (> 0).
        gamma: γ, the absolute-similarity threshold.
        margin: λ, the VTHM mining margin.
        mining: apply VTHM; ``False`` gives plain RAW over all pairs.
    """

    requires_num_classes = False

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        margin: float = 0.1,
        mining: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, value in (("gamma", gamma), ("margin", margin)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.margin = float(margin)
        self.mining = bool(mining)

    def hyperparameters(self) -> dict[str, Any]:
        """Resolved hyper-parameters, for run manifests."""
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "margin": self.margin,
            "mining": self.mining,
        }

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())

    @torch.no_grad()
    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> PairMasks:
        """Kept pairs for a similarity matrix: VTHM if ``mining`` else all pairs."""
        m = sim.shape[0]
        _check_labels(labels, m)
        labels = labels.to(sim.device)
        same = labels.unsqueeze(0) == labels.unsqueeze(1)
        eye = torch.eye(m, dtype=torch.bool, device=sim.device)
        pos = same & ~eye
        neg = ~same
        if not self.mining:
            return PairMasks(pos, neg)
        s = sim.detach()
        # ±inf for an empty set makes the comparisons below false for every pair of that
        # anchor, which is exactly "no valid triplet, keep nothing".
        hardest_pos = s.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
        hardest_neg = s.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
        keep_neg = neg & (s > hardest_pos - self.margin)
        keep_pos = pos & (s < hardest_neg + self.margin)
        return PairMasks(keep_pos, keep_neg)

    def _logits(self, sim: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return -self.alpha * (sim - self.gamma), self.beta * (sim - self.gamma)

    def loss_from_similarity(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 17 on a precomputed m×m cosine-similarity matrix."""
        if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
            raise ValueError(f"sim must be a square matrix, got shape {tuple(sim.shape)}")
        m = sim.shape[0]
        if m == 0:
            raise ValueError("RawVthmLoss got an empty batch")
        keep = self.mine(sim, labels)
        pos_logits, neg_logits = self._logits(sim)
        pos_term = log1p_sum_exp(pos_logits, keep.positive, dim=1) / self.alpha
        neg_term = log1p_sum_exp(neg_logits, keep.negative, dim=1) / self.beta
        return (pos_term + neg_term).sum() / m

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if embeddings.ndim != 2:
            raise ValueError(f"embeddings must be (batch, dim), got shape {tuple(embeddings.shape)}")
        _check_labels(labels, embeddings.shape[0])
        if embeddings.shape[0] == 0:
            raise ValueError("RawVthmLoss got an empty batch")
        return self.loss_from_similarity(cosine_similarity_matrix(embeddings), labels)

    @torch.no_grad()
    def pair_weights_from_similarity(self, sim: torch.Tensor, labels: torch.Tensor) -> PairWeights:
        """Eq. 15-16 weights for a precomputed similarity matrix (see ``pair_weights``)."""
        keep = self.mine(sim, labels)
        pos_logits, neg_logits = self._logits(sim)
        # w_ij = exp(z_ij) / (1 + Σ_k exp(z_ik)) is Eq. 15/16 after dividing numerator and
        # denominator by exp(z_ij); computing it as exp(z_ij - lse_i) never overflows.
        pos_lse = log1p_sum_exp(pos_logits, keep.positive, dim=1).unsqueeze(1)
        neg_lse = log1p_sum_exp(neg_logits, keep.negative, dim=1).unsqueeze(1)
        w_pos = torch.exp(pos_logits - pos_lse).masked_fill(~keep.positive, 0.0)
        w_neg = torch.exp(neg_logits - neg_lse).masked_fill(~keep.negative, 0.0)
        return PairWeights(w_pos, w_neg)

    def pair_weights(self, embeddings: torch.Tensor, labels: torch.Tensor) -> PairWeights:
        """Per-pair weights ``w_ij`` of Eq. 15 (positives) and 16 (negatives), for diagnostics.

        Row i holds anchor i's weights; pairs not kept are 0. The loss gradient satisfies
        ``∂L/∂s_ij = (w_neg_ij - w_pos_ij) / m``.
        """
        return self.pair_weights_from_similarity(cosine_similarity_matrix(embeddings.detach()), labels)
