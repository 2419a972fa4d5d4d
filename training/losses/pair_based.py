"""Pair- and triplet-based losses on the cosine-similarity matrix.

Formulas and defaults come from "Metric Learning: A Deep Dive" (the thesis: section 2.3.1,
hyper-parameters Table 4, miners Table 5) and, for binomial deviance, from "A unified view of
deep metric learning via gradient analysis" (Eq. 12, hyper-parameters in section 6). ``S_ij``
is the cosine similarity, ``P_i`` the other samples of anchor i's class, ``N_i`` the samples of
other classes. Every loss normalises its input, so it is invariant to embedding norms.

Each loss computes per-element terms (per anchor, pair or triplet; ``base.PairBasedLoss``) and
its reducer turns them into the scalar. Where the paper writes a sum over anchors the default
is ``reduction="sum"`` (``SumReducer``); where it writes ``1/m`` or gives only the
per-pair/per-triplet term the default is the mean over those terms. ``reduction="mean"``
always divides by the number of terms (anchors, pairs or triplets), which is
pytorch-metric-learning's ``MeanReducer``. Pair losses read the pairs from their indices
(every pair unless a pair miner's ``PairMasks`` are passed); the triplet loss owns a triplet
miner (``mining.py``).

The thesis's multi-similarity loss (Eq. 2.24 with multi-similarity mining) is RAW + VTHM
(``raw_vthm.py``); the registry keeps ``multi_similarity`` as an alias of ``raw_vthm``. Where it
and the library disagree (pytorch-metric-learning returns 0 when mining leaves at most one
positive and one negative pair; Eq. 2.24 keeps their terms) is noted there.

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
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import (
    check_batch,
    check_finite,
    check_positive,
    check_similarity,
    distance_from_similarity,
    masked_logsumexp,
    pairwise_distance,
)
from .base import ElementLosses, PairBasedLoss
from .mining import PairMasks, TripletMiner, Triplets, all_pairs, build_triplet_miner
from .reducers import BaseReducer
from .registry import LOSSES

__all__ = [
    "BinomialDevianceLoss",
    "ContrastiveLoss",
    "LiftedStructureLoss",
    "MarginLoss",
    "NPairLoss",
    "TripletLoss",
]


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # log(1 + e^x) without F.softplus's linear cut-over at x > 20, so brute-force references
    # and the paper's weight formulas (e.g. Eq. 13-14 of the unified view) match to ~1e-15.
    return torch.logaddexp(x, torch.zeros_like(x))


class MarginPairLoss(PairBasedLoss):
    """A pair loss whose one option is a margin λ; the subclass names the reduction its paper
    writes (``default_reduction``), which ``reduction=None`` selects."""

    default_reduction: ClassVar[str]

    def __init__(self, margin: float = 0.5, reduction: str | BaseReducer | None = None) -> None:
        check_finite(margin=margin)
        super().__init__(self.default_reduction if reduction is None else reduction)
        self.margin = float(margin)

    def hyperparameters(self) -> dict[str, Any]:
        return {"margin": self.margin, "reduction": self.reduction}


@LOSSES.register("contrastive")
class ContrastiveLoss(MarginPairLoss):
    """Contrastive loss, thesis Eq. 2.15: ``(1 - I_ij)[S_ij - λ]_+ - I_ij S_ij`` per pair.

    Every ordered pair ``(i, j)``, ``i != j``, is a term. Weight view (unified view, Eq. 6):
    every positive pair has weight 1 and a negative pair has weight 1 if ``S_ij > λ`` else 0
    (times ``1/#pairs`` for the mean).

    Args:
        margin: λ (Table 4: 0.5).
        reduction: "mean" over all pairs (default) or "sum".
    """

    default_reduction = "mean"

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """m×m per-pair terms; the pairs counted are the positive and negative ones."""
        pos, neg = indices
        zero = torch.zeros_like(sim)
        terms = torch.where(pos, -sim, zero) + torch.where(neg, F.relu(sim - self.margin), zero)
        return {"loss": ElementLosses(terms, pos | neg)}


@LOSSES.register("triplet")
class TripletLoss(PairBasedLoss):
    """Triplet loss, thesis Eq. 2.17: ``[S_an - S_ap + λ]_+`` over mined triplets.

    Args:
        margin: λ (Table 4: 0.1).
        miner: a triplet miner, or its name: "semihard" (Table 5; Eq. 2.20), "hard"
            (Eq. 2.18-2.19), "all", or "ephn" (see ``mining.py``).
        reduction: "mean" over mined triplets (default) or "sum".
    """

    miner: TripletMiner

    def __init__(
        self, margin: float = 0.1, miner: str | TripletMiner = "semihard", reduction: str | BaseReducer = "mean"
    ) -> None:
        check_finite(margin=margin)
        super().__init__(reduction, miner=build_triplet_miner(miner))
        self.margin = float(margin)

    def hyperparameters(self) -> dict[str, Any]:
        return {"margin": self.margin, "miner": self.miner.name, "reduction": self.reduction}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: Triplets) -> dict[str, ElementLosses]:
        """One term per mined triplet."""
        a, p, n = indices
        return {"loss": ElementLosses(F.relu(sim[a, n] - sim[a, p] + self.margin))}


@LOSSES.register("lifted_structure")
class LiftedStructureLoss(MarginPairLoss):
    """Generalized lifted structure loss, thesis Eq. 2.21::

        L = Σ_i [ log Σ_{k∈P_i} e^{λ - S_ik} + log Σ_{k∈N_i} e^{S_ik} ]_+

    ``P_i`` excludes the anchor itself. Weight view (unified view, Eq. 10-11): while the hinge is
    active, positive j gets ``e^{-S_ij} / Σ_{k∈P_i} e^{-S_ik}`` and negative j
    ``e^{S_ij} / Σ_{k∈N_i} e^{S_ik}``.

    Args:
        margin: λ (Table 4: 0.5).
        reduction: "sum" over anchors (default, as Eq. 2.21) or "mean".
    """

    default_reduction = "sum"

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """One term per anchor."""
        pos, neg = indices
        pos_lse, has_pos = masked_logsumexp(self.margin - sim, pos)
        neg_lse, has_neg = masked_logsumexp(sim, neg)
        per_anchor = torch.where(has_pos & has_neg, F.relu(pos_lse + neg_lse), torch.zeros_like(pos_lse))
        return {"loss": ElementLosses(per_anchor)}


@LOSSES.register("npair")
class NPairLoss(PairBasedLoss):
    """Multi-class N-pair loss, thesis Eq. 2.22::

        L = 1/m Σ_i log(1 + Σ_{k∈N_i} Σ_{j∈P_i} e^{S_ik - S_ij})

    computed as ``softplus(LSE_{N_i}(S) + LSE_{P_i}(-S))``; an anchor without a positive or a
    negative contributes 0.

    Args:
        reduction: "mean" over anchors (default, as Eq. 2.22) or "sum".
        l2_reg: weight of ``mean_i ||x_i||²`` on the *raw* embeddings (Sohn's regulariser; Table 4
            uses 0.02). Off by default: it is the only term that sees embedding norms.
    """

    def __init__(self, reduction: str | BaseReducer = "mean", l2_reg: float = 0.0) -> None:
        check_finite(l2_reg=l2_reg)
        if l2_reg < 0:
            raise ValueError(f"l2_reg must be >= 0, got {l2_reg!r}")
        super().__init__(reduction)
        self.l2_reg = float(l2_reg)

    def hyperparameters(self) -> dict[str, Any]:
        return {"reduction": self.reduction, "l2_reg": self.l2_reg}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """One term per anchor."""
        pos, neg = indices
        neg_lse, has_neg = masked_logsumexp(sim, neg)
        pos_lse, has_pos = masked_logsumexp(-sim, pos)
        per_anchor = torch.where(has_pos & has_neg, _softplus(neg_lse + pos_lse), torch.zeros_like(neg_lse))
        return {"loss": ElementLosses(per_anchor)}

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: PairMasks | None = None
    ) -> torch.Tensor:
        loss = super().forward(embeddings, labels, indices_tuple)
        if self.l2_reg:
            loss = loss + self.l2_reg * embeddings.pow(2).sum(dim=1).mean().to(loss.dtype)
        return loss


@LOSSES.register("margin")
class MarginLoss(PairBasedLoss):
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
        self, margin: float = 0.5, beta: float = 1.2, learn_beta: bool = False, reduction: str | BaseReducer = "mean"
    ) -> None:
        check_finite(margin=margin, beta=beta)
        super().__init__(reduction)
        self.margin = float(margin)
        self.learn_beta = bool(learn_beta)
        self.beta: torch.Tensor | float
        if self.learn_beta:
            self.beta = nn.Parameter(torch.tensor(float(beta)))
        else:
            self.beta = float(beta)

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
        return self._pair_terms(dist, all_pairs(labels, dist.device))

    def _pair_terms(self, dist: torch.Tensor, pairs: PairMasks) -> torch.Tensor:
        beta = self.beta.to(dist.dtype) if isinstance(self.beta, torch.Tensor) else self.beta
        zero = torch.zeros_like(dist)
        return torch.where(pairs.positive, F.relu(self.margin + dist - beta), zero) + torch.where(
            pairs.negative, F.relu(self.margin - dist + beta), zero
        )

    def _from_distance(self, dist: torch.Tensor, pairs: PairMasks) -> dict[str, ElementLosses]:
        return {"loss": ElementLosses(self._pair_terms(dist, pairs), pairs.positive | pairs.negative)}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """m×m per-pair terms with ``D = sqrt(2 - 2S)``; the pairs counted are the positive and negative ones."""
        return self._from_distance(distance_from_similarity(sim), indices)

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: PairMasks | None = None
    ) -> torch.Tensor:
        # Distances from the coordinates, not sqrt(2 - 2S): see _common.pairwise_distance.
        check_batch(embeddings, labels, type(self).__name__)
        pairs = all_pairs(labels, embeddings.device) if indices_tuple is None else indices_tuple
        return self.reduce(self._from_distance(pairwise_distance(embeddings), pairs))


@LOSSES.register("binomial_deviance")
class BinomialDevianceLoss(PairBasedLoss):
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

    def __init__(
        self, alpha: float = 2.0, beta: float = 50.0, gamma: float = 0.5, reduction: str | BaseReducer = "sum"
    ) -> None:
        check_positive(alpha=alpha, beta=beta)
        check_finite(gamma=gamma)
        super().__init__(reduction)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.gamma = float(gamma)

    def hyperparameters(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "reduction": self.reduction}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """One term per anchor."""
        pos, neg = indices
        zero = torch.zeros_like(sim)
        pos_terms = torch.where(pos, _softplus(self.alpha * (self.gamma - sim)), zero).sum(dim=1)
        neg_terms = torch.where(neg, _softplus(self.beta * (sim - self.gamma)), zero).sum(dim=1)
        per_anchor = pos_terms / pos.sum(dim=1).clamp_min(1) + neg_terms / neg.sum(dim=1).clamp_min(1)
        return {"loss": ElementLosses(per_anchor)}
