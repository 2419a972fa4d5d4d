"""RAW + VTHM loss: "A unified view of deep metric learning via gradient analysis", 5.1-5.2.

In pytorch-metric-learning's terms this is ``MultiSimilarityLoss(α, β, base=γ)`` fed by
``MultiSimilarityMiner(epsilon=λ)``: the multi-similarity loss ("Metric Learning: A Deep Dive"
Eq. 2.24) is Eq. 17 and its pair mining is VTHM, so the registry's ``multi_similarity`` is an
alias of ``raw_vthm`` that keeps the thesis's option names (its ``margin`` is γ, its
``epsilon`` is λ).

With ``s_ij`` the cosine similarity, ``P_i`` the other samples of anchor i's class and ``N_i``
the samples of other classes:

* VTHM (valid-triplet-based hard mining, ``mining.VthmMiner``), per anchor i: ``p*`` = least
  similar positive, ``n*`` = most similar negative; keep negative j if ``s_ij > s_ip* - λ``, keep
  positive j if ``s_ij < s_in* + λ``. The kept sets are ``P~_i`` and ``N~_i``.
* RAW (Eq. 17), gradient-equivalent to the pair weights of Eq. 15-16::

      L = 1/m Σ_i [ 1/α log(1 + Σ_{k∈P~_i} exp(-α(s_ik - γ)))
                  + 1/β log(1 + Σ_{k∈N~_i} exp( β(s_ik - γ))) ]

  so ``∂L/∂s_ij = -w_ij/m`` for a kept positive and ``+w_ij/m`` for a kept negative, with
  ``w_ij`` from Eq. 15/16 (``pair_weights``).

Defaults are the paper's: α=2, β=50, γ=0.5, λ=0.1. They are also the thesis's Table 4 values for
multi-similarity (α 2, β 50, "margin λ" 0.5 = γ, ε 0.1 = λ), in whose notation Eq. 2.24 reads::

      L = 1/m Σ_i { 1/α log[1 + Σ_{k∈P_i} e^{-α(S_ik - λ)}] + 1/β log[1 + Σ_{k∈N_i} e^{β(S_ik - λ)}] }

with ``P_i``/``N_i`` the pairs kept by multi-similarity mining with margin ε.

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
11. Averaging: the per-anchor terms go through ``MeanReducer``, i.e. the sum is divided by the
    batch size ``m``, including anchors that kept nothing (the paper's 1/m).
    pytorch-metric-learning's default MeanReducer does the same. ``reduction="sum"`` drops the 1/m.
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
    e.g. a one-class batch still has its positive terms. Indices passed to ``forward``
    (``indices_tuple``, ``PairMasks`` from any pair miner) replace the loss's own mining.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import check_finite, check_positive
from .base import ElementLosses, PairBasedLoss
from .mining import PairMasks, VthmMiner
from .reducers import BaseReducer
from .registry import LOSSES
from .similarity import cosine_similarity_matrix, log1p_sum_exp
from .weights import PairWeightView, pair_weights

__all__ = ["PairMasks", "RawVthmLoss"]


@LOSSES.register("raw_vthm")
class RawVthmLoss(PairBasedLoss):
    """RAW loss (Eq. 17) over the pairs kept by VTHM mining.

    Args:
        alpha: α, scale of the positive terms (> 0).
        beta: β, scale of the negative terms (> 0).
        gamma: γ, the absolute-similarity threshold.
        margin: λ, the VTHM mining margin (``VthmMiner(epsilon=λ)``).
        mining: apply VTHM; ``False`` gives plain RAW over all pairs.
        reduction: "mean" over anchors (default, the paper's 1/m) or "sum".
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        margin: float = 0.1,
        mining: bool = True,
        reduction: str | BaseReducer = "mean",
    ) -> None:
        check_positive(alpha=alpha, beta=beta)
        check_finite(gamma=gamma, margin=margin)
        super().__init__(reduction, miner=VthmMiner(margin) if mining else None)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.margin = float(margin)
        self.mining = bool(mining)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "margin": self.margin,
            "mining": self.mining,
            "reduction": self.reduction,
        }

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """Eq. 17's per-anchor terms over the kept pairs."""
        pos_term = log1p_sum_exp(-self.alpha * (sim - self.gamma), indices.positive, dim=1) / self.alpha
        neg_term = log1p_sum_exp(self.beta * (sim - self.gamma), indices.negative, dim=1) / self.beta
        return {"loss": ElementLosses(pos_term + neg_term)}

    def pair_weights(self, embeddings: torch.Tensor, labels: torch.Tensor) -> PairWeightView:
        """Per-pair weights ``w_ij`` of Eq. 15 (positives) and 16 (negatives), for diagnostics.

        Row i holds anchor i's weights; pairs not kept are 0. They are the gradient of the
        per-anchor sum (Eq. 17 without 1/m), taken by the weight view: with the default mean,
        ``∂L/∂s_ij = (w_neg_ij - w_pos_ij) / m``. Eq. 15-16 in closed form,
        ``w_ij = exp(z_ij) / (1 + Σ_k exp(z_ik))``, is what that gradient evaluates to.
        """
        return pair_weights(self, cosine_similarity_matrix(embeddings.detach()), labels, reduced=False)
