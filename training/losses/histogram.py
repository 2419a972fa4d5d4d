"""Histogram loss (Ustinova & Lempitsky), "Learning deep embeddings with histogram loss", Eq. 1-5.

The loss is the probability that a random negative pair is more similar than a random positive
pair, estimated from soft histograms of the batch's similarities:

* nodes ``t_1 = -1, ..., t_R = +1`` with step ``Δ = 2/(R - 1)``;
* Eq. 3: a similarity ``s`` in ``[t_r, t_{r+1}]`` adds ``(t_{r+1} - s)/Δ`` to ``h_r`` and
  ``(s - t_r)/Δ`` to ``h_{r+1}`` (linear interpolation), and each histogram is divided by its
  number of pairs, so it sums to 1;
* Eq. 2: ``L = Σ_r h⁻_r φ⁺_r`` with ``φ⁺_r = Σ_{q≤r} h⁺_q`` the positive CDF at node r.

Its gradient is Eq. 4-5 through autograd. Eq. 4 as printed on the poster swaps the superscripts:
from Eq. 2, ``∂L/∂h⁻_r = Σ_{q≤r} h⁺_q`` and ``∂L/∂h⁺_r = Σ_{q≥r} h⁻_q`` (the tests check these).

Choices the poster leaves open:

* Pairs are unordered (``i < j``): the ordered pairs would count each twice, which the
  normalisation cancels.
* Eq. 3's closed intervals would count a similarity lying exactly on a node twice; the
  intervals are half-open, ``[t_r, t_{r+1})``, so it counts once, entirely in ``h_r``, and its
  gradient is the right-hand derivative. ``s = +1`` falls in the last interval with weight 1
  on ``t_R``; similarities rounded outside ``[-1, 1]`` are clamped.
* A batch with no positive pair or no negative pair has no overlap to estimate: the loss is 0
  (and backpropagates zeros).

pytorch-metric-learning's ``HistogramLoss(n_bins=R-1)`` computes the same value when every
class has at least two samples; it builds its pairs from triplets, so a negative pair between
two singleton classes is missing there (kept here), and ``s = 1`` indexes past its last node.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import ElementLosses, PairBasedLoss
from .mining import PairMasks
from .reducers import SumReducer
from .registry import LOSSES

__all__ = ["HistogramLoss", "histogram_overlap", "similarity_histogram"]


def similarity_histogram(values: torch.Tensor, nodes: int) -> torch.Tensor:
    """Eq. 3: the soft histogram (sums to 1) of 1-D ``values`` in [-1, 1] on ``nodes`` nodes."""
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(f"values must be a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    step = 2.0 / (nodes - 1)
    position = (values.clamp(-1.0, 1.0) + 1.0) / step
    # The bin index is a constant of the piecewise-linear map; only the fraction carries grad.
    lower = torch.floor(position.detach()).clamp(0, nodes - 2).long()
    frac = position - lower.to(position.dtype)
    hist = values.new_zeros(nodes)
    hist = hist.index_add(0, lower, 1.0 - frac).index_add(0, lower + 1, frac)
    return hist / values.numel()


def _overlap_terms(h_pos: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    """Eq. 2's per-node terms ``h⁻_r Σ_{q≤r} h⁺_q``."""
    return h_neg * torch.cumsum(h_pos, dim=0)


def histogram_overlap(h_pos: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    """Eq. 2: ``Σ_r h⁻_r Σ_{q≤r} h⁺_q``."""
    return SumReducer()(_overlap_terms(h_pos, h_neg))


@LOSSES.register("histogram")
class HistogramLoss(PairBasedLoss):
    """Histogram loss over all positive and negative pairs of the batch (or the ``PairMasks``
    passed to it, read on the upper triangle).

    Its elements are Eq. 2's per-node terms and its reducer is ``SumReducer``: the loss is
    already a probability, with no batch size to divide by.

    Args:
        step: Δ, the node spacing (the poster: "bin size of 0.01", i.e. 201 nodes). ``2/step``
            must be a whole number.
        bins: R, the number of nodes (histogram entries) instead of ``step``; ``step`` is then
            ``2/(bins - 1)``. pytorch-metric-learning's ``n_bins`` is ``R - 1``.
    """

    def __init__(self, step: float = 0.01, bins: int | None = None) -> None:
        super().__init__("sum")
        if bins is not None:
            if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
                raise ValueError(f"bins must be an int >= 2, got {bins!r}")
            self.nodes = bins
        else:
            if not (isinstance(step, (int, float)) and math.isfinite(step) and 0 < step <= 2):
                raise ValueError(f"step must be in (0, 2], got {step!r}")
            intervals = round(2.0 / step)
            if abs(intervals * step - 2.0) > 1e-9:
                raise ValueError(f"2/step must be a whole number, got step={step!r}")
            self.nodes = intervals + 1
        self.step = 2.0 / (self.nodes - 1)

    def hyperparameters(self) -> dict[str, Any]:
        return {"step": self.step, "bins": self.nodes}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks) -> dict[str, ElementLosses]:
        """Eq. 2's per-node terms (a zero, still in the graph, without both kinds of pair)."""
        m = sim.shape[0]
        i, j = torch.triu_indices(m, m, offset=1, device=sim.device)
        s = sim[i, j]
        s_pos, s_neg = s[indices.positive[i, j]], s[indices.negative[i, j]]
        if s_pos.numel() == 0 or s_neg.numel() == 0:
            return {"loss": ElementLosses(s.sum() * 0.0)}
        h_pos, h_neg = similarity_histogram(s_pos, self.nodes), similarity_histogram(s_neg, self.nodes)
        return {"loss": ElementLosses(_overlap_terms(h_pos, h_neg))}
