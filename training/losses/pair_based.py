"""Pair- and triplet-based losses on the cosine-similarity matrix.

Formulas and defaults come from "Metric Learning: A Deep Dive" (the thesis: section 2.3.1,
hyper-parameters Table 4, miners Table 5) and, for binomial deviance, from "A unified view of
deep metric learning via gradient analysis" (Eq. 12, hyper-parameters in section 6). ``S_ij``
is the cosine similarity, ``P_i`` the other samples of anchor i's class, ``N_i`` the samples of
other classes. Every loss normalises its input, so it is invariant to embedding norms.

Reduction: where the paper writes a sum over anchors the default is ``reduction="sum"``; where
it writes ``1/m`` or gives only the per-pair/per-triplet term the default is the mean over
those terms. ``reduction="mean"`` always divides by the number of terms (anchors, pairs or
triplets), which is pytorch-metric-learning's ``MeanReducer``.

Where the papers and pytorch-metric-learning disagree (the tests pin the paper):

* contrastive: the positive term is ``-S_ij`` (Eq. 2.15), not ``[1 - S_ij]_+``: same gradient
  for ``S < 1``, a constant apart in value, but a duplicate positive (``S`` rounded to 1 or just
  above) keeps its weight 1. The library averages positive and negative pairs separately over
  the non-zero terms; here one mean over all pairs keeps Eq. 6 of the unified view (every
  selected pair has the same weight).
* triplet: "semihard" is Eq. 2.20 (one negative per positive pair), "hard" is Eq. 2.18-2.19
  (batch hard); see ``mining.py``.
* lifted structure: an anchor without positives or without negatives contributes 0 (the log of
  an empty sum is -inf, clipped by the hinge); the library's generalized version counts its
  negative term anyway.
* N-pair: Eq. 2.22 sums over every positive j and every negative k of each anchor; the
  library's ``NPairsLoss`` keeps one positive pair per class and uses the other classes'
  positives as negatives. Table 4's ``l2 = 0.02`` regularises the raw embedding norms, which a
  loss on cosine similarities does not see: ``l2_reg`` is available but off by default so the
  loss stays norm-invariant.
* margin: Wu et al.'s per-pair term ``[λ + y_ij (D_ij - β)]_+`` with ``y = +1`` for positives
  and ``-1`` for negatives and ``D = sqrt(2 - 2S)`` the distance between the normalised
  embeddings (Eq. 2.23 as printed, with ``I_ij ∈ {0, 1}`` and ``S``, would make every negative a
  constant ``λ``). The library sums the terms over triplets, so a pair counts once per triplet
  it appears in; here each pair counts once.
* multi-similarity: pytorch-metric-learning returns 0 when mining leaves at most one positive
  and one negative pair; Eq. 2.24 keeps their terms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import register_loss
from ._common import (
    SimilarityLoss,
    check_batch,
    check_finite,
    check_positive,
    check_reduction,
    check_similarity,
    distance_from_similarity,
    label_masks,
    masked_logsumexp,
    pairwise_distance,
    reduce,
)
from .mining import TRIPLET_MINERS, mine_triplets, multi_similarity_pairs
from .similarity import log1p_sum_exp

__all__ = [
    "BinomialDevianceLoss",
    "ContrastiveLoss",
    "LiftedStructureLoss",
    "MarginLoss",
    "MultiSimilarityLoss",
    "NPairLoss",
    "TripletLoss",
]


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # log(1 + e^x) without F.softplus's linear cut-over at x > 20, so brute-force references
    # and the paper's weight formulas (e.g. Eq. 13-14 of the unified view) match to ~1e-15.
    return torch.logaddexp(x, torch.zeros_like(x))


@register_loss("contrastive")
class ContrastiveLoss(SimilarityLoss):
    """Contrastive loss, thesis Eq. 2.15: ``(1 - I_ij)[S_ij - λ]_+ - I_ij S_ij`` per pair.

    Every ordered pair ``(i, j)``, ``i != j``, is a term. Weight view (unified view, Eq. 6):
    every positive pair has weight 1 and a negative pair has weight 1 if ``S_ij > λ`` else 0
    (times ``1/#pairs`` for the mean).

    Args:
        margin: λ (Table 4: 0.5).
        reduction: "mean" over all pairs (default) or "sum".
    """

    def __init__(self, margin: float = 0.5, reduction: str = "mean") -> None:
        super().__init__()
        check_finite(margin=margin)
        self.margin = float(margin)
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {"margin": self.margin, "reduction": self.reduction}

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos, neg = label_masks(labels, sim.device)
        total = -sim[pos].sum() + F.relu(sim[neg] - self.margin).sum()
        return reduce(total, pos.sum() + neg.sum(), self.reduction)


@register_loss("triplet")
class TripletLoss(SimilarityLoss):
    """Triplet loss, thesis Eq. 2.17: ``[S_an - S_ap + λ]_+`` over mined triplets.

    Args:
        margin: λ (Table 4: 0.1).
        miner: "semihard" (Table 5; Eq. 2.20), "hard" (Eq. 2.18-2.19), "all", or "ephn"
            (see ``mining.py``).
        reduction: "mean" over mined triplets (default) or "sum".
    """

    def __init__(self, margin: float = 0.1, miner: str = "semihard", reduction: str = "mean") -> None:
        super().__init__()
        check_finite(margin=margin)
        if miner not in TRIPLET_MINERS:
            raise ValueError(f"miner must be one of {sorted(TRIPLET_MINERS)}, got {miner!r}")
        self.margin = float(margin)
        self.miner = miner
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {"margin": self.margin, "miner": self.miner, "reduction": self.reduction}

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        a, p, n = mine_triplets(self.miner, sim, labels)
        losses = F.relu(sim[a, n] - sim[a, p] + self.margin)
        return reduce(losses.sum(), len(losses), self.reduction)


@register_loss("lifted_structure")
class LiftedStructureLoss(SimilarityLoss):
    """Generalized lifted structure loss, thesis Eq. 2.21::

        L = Σ_i [ log Σ_{k∈P_i} e^{λ - S_ik} + log Σ_{k∈N_i} e^{S_ik} ]_+

    ``P_i`` excludes the anchor itself. Weight view (unified view, Eq. 10-11): while the hinge is
    active, positive j gets ``e^{-S_ij} / Σ_{k∈P_i} e^{-S_ik}`` and negative j
    ``e^{S_ij} / Σ_{k∈N_i} e^{S_ik}``.

    Args:
        margin: λ (Table 4: 0.5).
        reduction: "sum" over anchors (default, as Eq. 2.21) or "mean".
    """

    def __init__(self, margin: float = 0.5, reduction: str = "sum") -> None:
        super().__init__()
        check_finite(margin=margin)
        self.margin = float(margin)
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {"margin": self.margin, "reduction": self.reduction}

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos, neg = label_masks(labels, sim.device)
        pos_lse, has_pos = masked_logsumexp(self.margin - sim, pos)
        neg_lse, has_neg = masked_logsumexp(sim, neg)
        per_anchor = torch.where(has_pos & has_neg, F.relu(pos_lse + neg_lse), torch.zeros_like(pos_lse))
        return reduce(per_anchor.sum(), sim.shape[0], self.reduction)


@register_loss("npair")
class NPairLoss(SimilarityLoss):
    """Multi-class N-pair loss, thesis Eq. 2.22::

        L = 1/m Σ_i log(1 + Σ_{k∈N_i} Σ_{j∈P_i} e^{S_ik - S_ij})

    computed as ``softplus(LSE_{N_i}(S) + LSE_{P_i}(-S))``; an anchor without a positive or a
    negative contributes 0.

    Args:
        reduction: "mean" over anchors (default, as Eq. 2.22) or "sum".
        l2_reg: weight of ``mean_i ||x_i||²`` on the *raw* embeddings (Sohn's regulariser; Table 4
            uses 0.02). Off by default: it is the only term that sees embedding norms.
    """

    def __init__(self, reduction: str = "mean", l2_reg: float = 0.0) -> None:
        super().__init__()
        check_finite(l2_reg=l2_reg)
        if l2_reg < 0:
            raise ValueError(f"l2_reg must be >= 0, got {l2_reg!r}")
        self.reduction = check_reduction(reduction)
        self.l2_reg = float(l2_reg)

    def hyperparameters(self) -> dict[str, Any]:
        return {"reduction": self.reduction, "l2_reg": self.l2_reg}

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos, neg = label_masks(labels, sim.device)
        neg_lse, has_neg = masked_logsumexp(sim, neg)
        pos_lse, has_pos = masked_logsumexp(-sim, pos)
        per_anchor = torch.where(has_pos & has_neg, _softplus(neg_lse + pos_lse), torch.zeros_like(neg_lse))
        return reduce(per_anchor.sum(), sim.shape[0], self.reduction)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(embeddings, labels)
        if self.l2_reg:
            loss = loss + self.l2_reg * embeddings.pow(2).sum(dim=1).mean().to(loss.dtype)
        return loss


@register_loss("margin")
class MarginLoss(SimilarityLoss):
    """Margin loss (Wu et al., "Sampling matters"), thesis 2.3.1.5, per pair::

        ℓ_ij = [λ + y_ij (D_ij - β)]_+,   y_ij = +1 (positive) / -1 (negative),

    with ``D_ij`` the Euclidean distance of the normalised embeddings (``sqrt(2 - 2 S_ij)``): β is
    the boundary between positive and negative distances and λ the margin around it. ``forward``
    measures ``D`` from the coordinates, which resolves near-duplicates; ``loss_from_similarity``
    (the weight view) has only ``S`` and uses ``sqrt(2 - 2 S)``.

    Args:
        margin: λ (Table 4: 0.5; Wu et al. use 0.2).
        beta: initial β (Table 4: 1.2).
        learn_beta: make β a learnable scalar (``self.beta`` is then an ``nn.Parameter``, to be
            trained at its own rate: Table 4 uses 5e-5).
        reduction: "mean" over all pairs (default) or "sum".
    """

    def __init__(
        self, margin: float = 0.5, beta: float = 1.2, learn_beta: bool = False, reduction: str = "mean"
    ) -> None:
        super().__init__()
        check_finite(margin=margin, beta=beta)
        self.margin = float(margin)
        self.learn_beta = bool(learn_beta)
        self.beta: torch.Tensor | float
        if self.learn_beta:
            self.beta = nn.Parameter(torch.tensor(float(beta)))
        else:
            self.beta = float(beta)
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "margin": self.margin,
            "beta": float(self.beta),
            "learn_beta": self.learn_beta,
            "reduction": self.reduction,
        }

    def pair_terms(self, dist: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """m×m matrix of the per-pair terms ``ℓ_ij`` for a distance matrix (0 on the diagonal)."""
        check_similarity(dist, labels)
        pos, neg = label_masks(labels, dist.device)
        beta = self.beta.to(dist.dtype) if isinstance(self.beta, torch.Tensor) else self.beta
        zero = torch.zeros_like(dist)
        return torch.where(pos, F.relu(self.margin + dist - beta), zero) + torch.where(
            neg, F.relu(self.margin - dist + beta), zero
        )

    def _from_distance(self, dist: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos, neg = label_masks(labels, dist.device)
        return reduce(self.pair_terms(dist, labels).sum(), pos.sum() + neg.sum(), self.reduction)

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._from_distance(distance_from_similarity(sim), labels)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Distances from the coordinates, not sqrt(2 - 2S): see _common.pairwise_distance.
        check_batch(embeddings, labels, type(self).__name__)
        return self._from_distance(pairwise_distance(embeddings), labels)


@register_loss("multi_similarity")
class MultiSimilarityLoss(SimilarityLoss):
    """Multi-similarity loss, thesis Eq. 2.24, over multi-similarity mined pairs::

        L = 1/m Σ_i { 1/α log[1 + Σ_{k∈P_i} e^{-α(S_ik - λ)}] + 1/β log[1 + Σ_{k∈N_i} e^{β(S_ik - λ)}] }

    with ``P_i``/``N_i`` the pairs kept by ``mining.multi_similarity_pairs`` (ε). Per the texts
    this mining rule is the unified view's VTHM and Eq. 2.24 its Eq. 17, so with the same
    hyper-parameters this loss equals ``raw_vthm`` (the tests check it); it is kept as its own
    entry so configs can name the thesis's loss with the thesis's parameter names.

    Args:
        alpha: α (Table 4: 2).
        beta: β (Table 4: 50).
        margin: λ, the similarity threshold (Table 4 "margin λ": 0.5).
        epsilon: ε, the mining margin (Table 4: 0.1).
        mining: mine pairs (Table 5: "hard"); ``False`` uses every pair.
        reduction: "mean" over anchors (default, as Eq. 2.24) or "sum".
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        margin: float = 0.5,
        epsilon: float = 0.1,
        mining: bool = True,
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        check_positive(alpha=alpha, beta=beta)
        check_finite(margin=margin, epsilon=epsilon)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.margin = float(margin)
        self.epsilon = float(epsilon)
        self.mining = bool(mining)
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "margin": self.margin,
            "epsilon": self.epsilon,
            "mining": self.mining,
            "reduction": self.reduction,
        }

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.mining:
            keep_pos, keep_neg = multi_similarity_pairs(sim, labels, self.epsilon)
        else:
            keep_pos, keep_neg = label_masks(labels, sim.device)
        pos_term = log1p_sum_exp(-self.alpha * (sim - self.margin), keep_pos, dim=1) / self.alpha
        neg_term = log1p_sum_exp(self.beta * (sim - self.margin), keep_neg, dim=1) / self.beta
        return reduce((pos_term + neg_term).sum(), sim.shape[0], self.reduction)


@register_loss("binomial_deviance")
class BinomialDevianceLoss(SimilarityLoss):
    """Binomial deviance loss, unified view Eq. 12::

        L = Σ_i { 1/|P_i| Σ_{k∈P_i} log[1 + e^{α(γ - S_ik)}] + 1/|N_i| Σ_{k∈N_i} log[1 + e^{β(S_ik - γ)}] }

    An empty ``P_i`` or ``N_i`` contributes 0. Weight view (Eq. 13-14): positive j gets
    ``α e^{α(γ - S_ij)} / (|P_i| (1 + e^{α(γ - S_ij)}))``, negative j the same with β, ``S - γ``
    and ``|N_i|``.

    Args:
        alpha: α (section 6: 2).
        beta: β (section 6: 50).
        gamma: γ, the soft threshold (section 6: 0.5).
        reduction: "sum" over anchors (default, as Eq. 12) or "mean".
    """

    def __init__(self, alpha: float = 2.0, beta: float = 50.0, gamma: float = 0.5, reduction: str = "sum") -> None:
        super().__init__()
        check_positive(alpha=alpha, beta=beta)
        check_finite(gamma=gamma)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.reduction = check_reduction(reduction)

    def hyperparameters(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "reduction": self.reduction}

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos, neg = label_masks(labels, sim.device)
        zero = torch.zeros_like(sim)
        pos_terms = torch.where(pos, _softplus(self.alpha * (self.gamma - sim)), zero).sum(dim=1)
        neg_terms = torch.where(neg, _softplus(self.beta * (sim - self.gamma)), zero).sum(dim=1)
        per_anchor = pos_terms / pos.sum(dim=1).clamp_min(1) + neg_terms / neg.sum(dim=1).clamp_min(1)
        return reduce(per_anchor.sum(), sim.shape[0], self.reduction)
