"""Miners, kept apart from the loss math (pytorch-metric-learning's ``miners``).

A miner is a callable object, ``miner(sim, labels)``, that reads a similarity matrix without
gradient and returns the indices a loss should use, which the loss treats as constants: a
``Triplets`` (anchor, positive, negative index tensors) or ``PairMasks`` (m×m boolean masks of the
positive and negative pairs kept for each anchor row). A pair-based loss owns a configured miner
(``loss.miner``) or takes the indices directly, ``loss(embeddings, labels, indices_tuple)``, as in
pytorch-metric-learning; without either it uses every pair. Configurations name triplet miners
by the strings of ``TRIPLET_MINERS``; ``build_triplet_miner`` is the one place a name becomes a
miner. Unlike the library's, these miners read the similarity matrix rather than the embeddings,
so the weight view (``weights.py``) can mine on a matrix it differentiates.

Definitions ("Metric Learning: A Deep Dive", 2.3.1.2, "Dissecting the impact of different loss
functions with gradient surgery", section 4, and "A unified view of deep metric learning via
gradient analysis", 5.1):

* ``"hard"``: per anchor, the hardest positive (least similar, Eq. 2.18) and the hardest
  negative (most similar, Eq. 2.19): one triplet per anchor ("batch hard").
* ``"semihard"``: per anchor-positive pair, the most similar negative among those *less*
  similar than the positive, ``n_ap = argmax_{n: S_ap > S_an} S_an`` (Eq. 2.20): one triplet per
  positive pair that has such a negative. (pytorch-metric-learning's "semihard" is instead
  every triplet with ``0 < S_ap - S_an <= margin``.)
* ``"all"``: every valid triplet (batch all).
* ``"ephn"``: easy positive, hard negative: per anchor the *most* similar positive and the most
  similar negative (the gradient-surgery paper's protocol).
* ``VthmMiner``: the unified view's valid-triplet-based hard mining, which is also the
  multi-similarity paper's pair mining (pytorch-metric-learning's ``MultiSimilarityMiner``).

Ties are broken towards the lowest batch index, so results do not depend on sort stability.
Anchors without a positive or without a negative yield no triplet.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from core.registry import Registry

from ._common import check_finite, check_similarity, label_masks

__all__ = [
    "TRIPLET_MINERS",
    "AllTripletsMiner",
    "BaseMiner",
    "BatchHardMiner",
    "EasyPositiveHardNegativeMiner",
    "PairMasks",
    "SemihardMiner",
    "TripletMiner",
    "Triplets",
    "VthmMiner",
    "all_pairs",
    "build_triplet_miner",
    "mine_triplets",
]


class Triplets(NamedTuple):
    """Index tensors (long, same length) of anchors, positives and negatives."""

    anchor: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor


class PairMasks(NamedTuple):
    """Boolean m×m masks of the pairs kept for each anchor (row)."""

    positive: torch.Tensor
    negative: torch.Tensor


def all_pairs(labels: torch.Tensor, device: torch.device) -> PairMasks:
    """Every positive pair (same label, off the diagonal) and every negative pair: no mining."""
    return PairMasks(*label_masks(labels, device))


class BaseMiner:
    """``miner(sim, labels)``: indices mined from the m×m similarities, without gradient."""

    name: ClassVar[str] = ""

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets | PairMasks:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets | PairMasks:
        check_similarity(sim, labels)
        return self.mine(sim.detach(), labels)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TripletMiner(BaseMiner):
    """A miner returning ``Triplets``; configurations name one by its ``TRIPLET_MINERS`` key."""

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
        raise NotImplementedError


TRIPLET_MINERS: Registry[type[TripletMiner]] = Registry("triplet miner", base=TripletMiner)


def _per_anchor(sim: torch.Tensor, labels: torch.Tensor, easiest_positive: bool) -> Triplets:
    pos, neg = label_masks(labels, sim.device)
    if easiest_positive:
        p = sim.masked_fill(~pos, float("-inf")).argmax(dim=1)
    else:
        p = sim.masked_fill(~pos, float("inf")).argmin(dim=1)
    n = sim.masked_fill(~neg, float("-inf")).argmax(dim=1)
    anchors = torch.nonzero(pos.any(dim=1) & neg.any(dim=1)).flatten()
    return Triplets(anchors, p[anchors], n[anchors])


@TRIPLET_MINERS.register("hard")
class BatchHardMiner(TripletMiner):
    """Eq. 2.18-2.19: hardest positive and hardest negative of every anchor."""

    name = "hard"

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
        return _per_anchor(sim, labels, easiest_positive=False)


@TRIPLET_MINERS.register("ephn")
class EasyPositiveHardNegativeMiner(TripletMiner):
    """Most similar positive and most similar negative of every anchor."""

    name = "ephn"

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
        return _per_anchor(sim, labels, easiest_positive=True)


@TRIPLET_MINERS.register("all")
class AllTripletsMiner(TripletMiner):
    """Every (a, p, n) with p a positive and n a negative of a; O(m³) booleans."""

    name = "all"

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
        pos, neg = label_masks(labels, sim.device)
        a, p, n = torch.nonzero(pos.unsqueeze(2) & neg.unsqueeze(1), as_tuple=True)
        return Triplets(a, p, n)


@TRIPLET_MINERS.register("semihard")
class SemihardMiner(TripletMiner):
    """Eq. 2.20 for every positive pair, in O(m² log m) time and O(m²) memory.

    Per anchor the negatives' similarities are sorted once; for a positive with similarity
    ``S_ap`` the wanted negative is the last one strictly below ``S_ap`` (a binary search), and
    among equal similarities the lowest batch index (a second search for the first occurrence
    of that value in the stably sorted row).
    """

    name = "semihard"

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
        pos, neg = label_masks(labels, sim.device)
        # Non-negatives sort first at -inf and are never "strictly below" a finite S_ap by
        # accident: a hit on them is rejected below.
        row = sim.masked_fill(~neg, float("-inf"))
        sorted_row, order = torch.sort(row, dim=1, stable=True)
        a, p = torch.nonzero(pos, as_tuple=True)
        s_ap = sim[a, p].unsqueeze(1)
        below = torch.searchsorted(sorted_row[a], s_ap, side="left").squeeze(1) - 1
        valid = below >= 0
        a, p, below = a[valid], p[valid], below[valid]
        value = sorted_row[a, below]
        valid = torch.isfinite(value)
        a, p, value = a[valid], p[valid], value[valid]
        first = torch.searchsorted(sorted_row[a], value.unsqueeze(1), side="left").squeeze(1)
        return Triplets(a, p, order[a, first])


def build_triplet_miner(miner: str | TripletMiner) -> TripletMiner:
    """A triplet miner object, or the one a configuration names (a ``TRIPLET_MINERS`` key)."""
    return TRIPLET_MINERS.build(miner)


def mine_triplets(kind: str, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Mine with the triplet miner a configuration names."""
    return build_triplet_miner(kind)(sim, labels)


class VthmMiner(BaseMiner):
    """Valid-triplet-based hard mining (the unified view, 5.1), as m×m ``PairMasks``.

    With ``p*`` the least similar positive and ``n*`` the most similar negative of anchor i,
    keep negative j if ``s_ij > s_ip* - ε`` and positive j if ``s_ij < s_in* + ε``. This is also
    the multi-similarity paper's pair mining (the gradient-surgery paper's Eq. 12) and
    pytorch-metric-learning's ``MultiSimilarityMiner(epsilon=ε)``.

    * An anchor without negatives keeps no positive and one without positives (a singleton
      class) keeps no negative: the max/min of an empty set is taken as -inf/+inf, so the
      comparisons fail for every pair of that anchor ("no valid triplet, keep nothing").
    * Ties for ``p*``/``n*`` cannot matter: only the threshold value is used, never the index.
    * Pairs exactly at a threshold are dropped: the paper's inequalities are strict and are
      evaluated in the paper's form (``s_ij > s_ip* - ε``, ``s_ij < s_in* + ε``).
      pytorch-metric-learning evaluates ``s_ij + ε > s_ip*`` and ``s_ij - ε < s_in*``, which can
      round differently within ~1 ulp of a threshold; nowhere else.
    * Masks are per anchor: pair {i, j} may be kept for anchor i and not for anchor j.
    """

    name = "vthm"

    def __init__(self, epsilon: float = 0.1) -> None:
        check_finite(epsilon=epsilon)
        self.epsilon = float(epsilon)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(epsilon={self.epsilon})"

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> PairMasks:
        pos, neg = label_masks(labels, sim.device)
        hardest_neg = sim.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
        hardest_pos = sim.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
        return PairMasks(pos & (sim < hardest_neg + self.epsilon), neg & (sim > hardest_pos - self.epsilon))
