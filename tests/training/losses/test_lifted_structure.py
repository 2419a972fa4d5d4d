"""Generalized lifted structure loss (thesis Eq. 2.21) against pytorch-metric-learning, the formula and its weights."""

from __future__ import annotations

import math

import pytest

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.reducers import SumReducer

from tests.training.losses.helpers import (
    PAIR_CASES,
    assert_close,
    every_anchor_has_both,
    negatives,
    positives,
    sim_list,
    value_and_grads,
)
from training.losses import cosine_similarity_matrix
from training.losses.pair_based import LiftedStructureLoss
from training.losses.weights import pair_weights


def lifted_reference(s: list[list[float]], y: list[int], margin: float) -> float:
    """Eq. 2.21; an anchor without positives or negatives: log of an empty sum, hinge → 0."""
    total = 0.0
    for i in range(len(y)):
        ps, ns = positives(y, i), negatives(y, i)
        if ps and ns:
            v = math.log(sum(math.exp(margin - s[i][k]) for k in ps)) + math.log(sum(math.exp(s[i][k]) for k in ns))
            total += max(v, 0.0)
    return total


@pytest.mark.parametrize("name", [n for n in sorted(PAIR_CASES) if every_anchor_has_both(PAIR_CASES[n][1])])
def test_lifted_matches_pml_generalized(name: str) -> None:
    x, y = PAIR_CASES[name]
    ours = LiftedStructureLoss(margin=0.5)
    ref = pml_losses.GeneralizedLiftedStructureLoss(
        neg_margin=0.0, pos_margin=0.5, distance=CosineSimilarity(), reducer=SumReducer()
    )
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)
    mean = LiftedStructureLoss(margin=0.5, reduction="mean")(x, y)
    assert mean.item() == pytest.approx(v.item() / len(y), rel=1e-12)


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_lifted_matches_eq_2_21(name: str) -> None:
    x, y = PAIR_CASES[name]
    expected = lifted_reference(sim_list(x), y.tolist(), 0.5)
    assert LiftedStructureLoss()(x, y).item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_lifted_anchor_without_positive_contributes_zero_unlike_pml() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]  # two singleton classes
    ours = LiftedStructureLoss(margin=0.5)(x, y).item()
    ref = pml_losses.GeneralizedLiftedStructureLoss(
        neg_margin=0.0, pos_margin=0.5, distance=CosineSimilarity(), reducer=SumReducer()
    )(x, y).item()
    assert ours == pytest.approx(lifted_reference(sim_list(x), y.tolist(), 0.5), rel=1e-12)
    assert ref > ours + 1.0  # the singletons' negative log-sum-exp terms


def test_lifted_weights_are_eq_10_11() -> None:
    x, y = PAIR_CASES["pk_4x4"]
    sim = cosine_similarity_matrix(x)
    w = pair_weights("lifted_structure", sim, y)
    s = sim.tolist()
    for i in range(len(y)):
        ps, ns = positives(y.tolist(), i), negatives(y.tolist(), i)
        for j in ps:
            assert w.positive[i, j].item() == pytest.approx(1 / sum(math.exp(s[i][j] - s[i][k]) for k in ps), rel=1e-12)
        for j in ns:
            assert w.negative[i, j].item() == pytest.approx(1 / sum(math.exp(s[i][k] - s[i][j]) for k in ns), rel=1e-12)
