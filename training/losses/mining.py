"""Triplet and pair miners, kept apart from the loss math (pytorch-metric-learning style).

Every miner reads a similarity matrix without gradient and returns indices or masks that the
losses treat as constants. Definitions ("Metric Learning: A Deep Dive", 2.3.1.2, and "Dissecting
the impact of different loss functions with gradient surgery", section 4):

* ``"hard"``: per anchor, the hardest positive (least similar, Eq. 2.18) and the hardest
  negative (most similar, Eq. 2.19): one triplet per anchor ("batch hard").
* ``"semihard"``: per anchor-positive pair, the most similar negative among those *less*
  similar than the positive, ``n_ap = argmax_{n: S_ap > S_an} S_an`` (Eq. 2.20): one triplet per
  positive pair that has such a negative. (pytorch-metric-learning's "semihard" is instead
  every triplet with ``0 < S_ap - S_an <= margin``.)
* ``"all"``: every valid triplet (batch all).
* ``"ephn"``: easy positive, hard negative: per anchor the *most* similar positive and the most
  similar negative (the gradient-surgery paper's protocol).

Ties are broken towards the lowest batch index, so results do not depend on sort stability.
Anchors without a positive or without a negative yield no triplet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._common import label_masks

__all__ = [
    "TRIPLET_MINERS",
    "Triplets",
    "all_triplets",
    "easy_positive_hard_negative_triplets",
    "hardest_triplets",
    "mine_triplets",
    "multi_similarity_pairs",
    "semihard_triplets",
]


class Triplets(NamedTuple):
    """Index tensors (long, same length) of anchors, positives and negatives."""

    anchor: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor


def _per_anchor(sim: torch.Tensor, labels: torch.Tensor, easiest_positive: bool) -> Triplets:
    pos, neg = label_masks(labels, sim.device)
    if easiest_positive:
        p = sim.masked_fill(~pos, float("-inf")).argmax(dim=1)
    else:
        p = sim.masked_fill(~pos, float("inf")).argmin(dim=1)
    n = sim.masked_fill(~neg, float("-inf")).argmax(dim=1)
    anchors = torch.nonzero(pos.any(dim=1) & neg.any(dim=1)).flatten()
    return Triplets(anchors, p[anchors], n[anchors])


@torch.no_grad()
def hardest_triplets(sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Eq. 2.18-2.19: hardest positive and hardest negative of every anchor."""
    return _per_anchor(sim.detach(), labels, easiest_positive=False)


@torch.no_grad()
def easy_positive_hard_negative_triplets(sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Most similar positive and most similar negative of every anchor."""
    return _per_anchor(sim.detach(), labels, easiest_positive=True)


@torch.no_grad()
def all_triplets(sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Every (a, p, n) with p a positive and n a negative of a; O(m³) booleans."""
    pos, neg = label_masks(labels, sim.device)
    a, p, n = torch.nonzero(pos.unsqueeze(2) & neg.unsqueeze(1), as_tuple=True)
    return Triplets(a, p, n)


@torch.no_grad()
def semihard_triplets(sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Eq. 2.20 for every positive pair, in O(m² log m) time and O(m²) memory.

    Per anchor the negatives' similarities are sorted once; for a positive with similarity
    ``S_ap`` the wanted negative is the last one strictly below ``S_ap`` (a binary search), and
    among equal similarities the lowest batch index (a second search for the first occurrence
    of that value in the stably sorted row).
    """
    s = sim.detach()
    pos, neg = label_masks(labels, s.device)
    # Non-negatives sort first at -inf and are never "strictly below" a finite S_ap by accident:
    # a hit on them is rejected below.
    row = s.masked_fill(~neg, float("-inf"))
    sorted_row, order = torch.sort(row, dim=1, stable=True)
    a, p = torch.nonzero(pos, as_tuple=True)
    s_ap = s[a, p].unsqueeze(1)
    below = torch.searchsorted(sorted_row[a], s_ap, side="left").squeeze(1) - 1
    valid = below >= 0
    a, p, below = a[valid], p[valid], below[valid]
    value = sorted_row[a, below]
    valid = torch.isfinite(value)
    a, p, value = a[valid], p[valid], value[valid]
    first = torch.searchsorted(sorted_row[a], value.unsqueeze(1), side="left").squeeze(1)
    return Triplets(a, p, order[a, first])


TRIPLET_MINERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Triplets]] = {
    "all": all_triplets,
    "ephn": easy_positive_hard_negative_triplets,
    "hard": hardest_triplets,
    "semihard": semihard_triplets,
}


def mine_triplets(kind: str, sim: torch.Tensor, labels: torch.Tensor) -> Triplets:
    """Dispatch on a miner name from ``TRIPLET_MINERS``."""
    try:
        miner = TRIPLET_MINERS[kind]
    except KeyError:
        raise ValueError(f"unknown triplet miner {kind!r}; known: {', '.join(sorted(TRIPLET_MINERS))}") from None
    return miner(sim, labels)


@torch.no_grad()
def multi_similarity_pairs(
    sim: torch.Tensor, labels: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-similarity pair mining as (positive, negative) m×m masks of kept pairs.

    The gradient-surgery paper's Eq. 12 (the MS paper's rule): keep positive j of anchor i if
    ``S_ij < max_{k∈N_i} S_ik + ε`` and negative j if ``S_ij > min_{k∈P_i} S_ik - ε``. An anchor
    without negatives keeps no positive and one without positives keeps no negative (max/min of
    an empty set taken as -inf/+inf). Comparisons are strict, in the paper's form.
    """
    s = sim.detach()
    pos, neg = label_masks(labels, s.device)
    hardest_neg = s.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
    hardest_pos = s.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
    return pos & (s < hardest_neg + epsilon), neg & (s > hardest_pos - epsilon)
