"""Margin loss (Wu et al.) against pytorch-metric-learning and the per-pair formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.reducers import SumReducer

from tests.training.losses.helpers import F64, PAIR_CASES, assert_close, counts, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses._common import pairwise_distance
from training.losses.pair_based import MarginLoss


def margin_reference(x: torch.Tensor, y: list[int], margin: float, beta: float) -> float:
    f = F.normalize(x, dim=1).tolist()
    total, count = 0.0, 0
    for i in range(len(y)):
        for j in range(len(y)):
            if i != j:
                count += 1
                d = math.dist(f[i], f[j])
                total += max(margin + d - beta, 0.0) if y[i] == y[j] else max(margin - d + beta, 0.0)
    return total / max(count, 1)


@pytest.mark.parametrize("learn_beta", [False, True])
@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_margin_pair_terms_match_pml(name: str, learn_beta: bool) -> None:
    """pml sums Wu et al.'s terms over all triplets, i.e. each positive pair |N_a| times and each
    negative pair |P_a| times; weighting our per-pair terms by those counts must give pml's sum
    (values, embedding and β gradients). The pair-level mean is pinned by the next test."""
    x, y = PAIR_CASES[name]
    ours = MarginLoss(margin=0.5, beta=1.2, learn_beta=learn_beta).double()
    ref = pml_losses.MarginLoss(margin=0.5, beta=1.2, learn_beta=learn_beta, reducer=SumReducer()).double()
    n_pos, n_neg = counts(y)
    same = y.unsqueeze(0) == y.unsqueeze(1)
    weight = torch.where(same, n_neg.unsqueeze(1), n_pos.unsqueeze(1)).to(F64)

    def weighted(e: torch.Tensor) -> torch.Tensor:
        return (weight * ours.pair_terms(pairwise_distance(e), y)).sum()

    extra, extra_ref = ([ours.beta], [ref.beta]) if learn_beta else ([], [])
    v, grads = value_and_grads(weighted, x, extra)
    v_ref, grads_ref = value_and_grads(lambda e: ref(e, y), x, extra_ref)
    assert_close(v, v_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close(g.reshape(-1), g_ref.reshape(-1))


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_margin_matches_wu_per_pair_mean(name: str) -> None:
    x, y = PAIR_CASES[name]
    expected = margin_reference(x, y.tolist(), 0.5, 1.2)
    assert MarginLoss()(x, y).item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # The weight view's S-only path: D = sqrt(2 - 2S), floored at sqrt(eps) ≈ 1.5e-8.
    margin_sim = MarginLoss().loss_from_similarity(cosine_similarity_matrix(x), y).item()
    assert margin_sim == pytest.approx(expected, rel=1e-9, abs=1e-8)


def test_margin_pushes_apart_a_collapsed_negative_pair() -> None:
    """Two embeddings of different classes 1e-9 apart: distances from the coordinates still
    give the negative term its full push (|∂D/∂f| = 1 along f_0 - f_1); sqrt(2 - 2S) cannot
    resolve such a pair (2 - 2S ≈ 1e-18 is below float64's rounding)."""
    base = F.normalize(torch.randn(5, generator=torch.Generator().manual_seed(0), dtype=F64), dim=0)
    nudge = F.normalize(torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=F64), dim=0)
    x = torch.stack([base, base + 1e-9 * nudge])
    _, (g,) = value_and_grads(lambda e: MarginLoss(reduction="sum")(e, torch.tensor([0, 1])), x)
    assert float(g[0].norm()) == pytest.approx(2.0, rel=1e-3)  # both ordered pairs, unit push each


def test_margin_learnable_beta_gets_the_pair_gradient() -> None:
    x, y = PAIR_CASES["wide_spread"]
    loss = MarginLoss(learn_beta=True).double()
    assert isinstance(loss.beta, torch.nn.Parameter)
    loss(x, y).backward()
    d = torch.cdist(F.normalize(x, dim=1), F.normalize(x, dim=1))
    same = y.unsqueeze(0) == y.unsqueeze(1)
    off = ~torch.eye(len(y), dtype=torch.bool)
    active_pos = (same & off & (0.5 + d - 1.2 > 0)).sum()
    active_neg = (~same & (0.5 - d + 1.2 > 0)).sum()
    expected = (active_neg - active_pos).item() / off.sum().item()
    assert loss.beta.grad.item() == pytest.approx(expected, rel=1e-12)


def test_one_class_value_is_the_papers() -> None:
    x, y = PAIR_CASES["one_class"]
    assert MarginLoss()(x, y).item() == pytest.approx(margin_reference(x, y.tolist(), 0.5, 1.2), rel=1e-9)
