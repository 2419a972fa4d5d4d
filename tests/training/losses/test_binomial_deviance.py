"""Binomial deviance loss (unified view Eq. 12) and its weights (Eq. 13-14)."""

from __future__ import annotations

import math

import pytest

from tests.training.losses.helpers import PAIR_CASES, negatives, positives, sim_list
from training.losses import cosine_similarity_matrix
from training.losses.pair_based import BinomialDevianceLoss
from training.losses.weights import pair_weights


def binomial_reference(s: list[list[float]], y: list[int], alpha: float, beta: float, gamma: float) -> float:
    total = 0.0
    for i in range(len(y)):
        ps, ns = positives(y, i), negatives(y, i)
        if ps:
            total += sum(math.log1p(math.exp(alpha * (gamma - s[i][k]))) for k in ps) / len(ps)
        if ns:
            total += sum(math.log1p(math.exp(beta * (s[i][k] - gamma))) for k in ns) / len(ns)
    return total


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_binomial_deviance_matches_eq_12(name: str) -> None:
    x, y = PAIR_CASES[name]
    expected = binomial_reference(sim_list(x), y.tolist(), 2.0, 50.0, 0.5)
    assert BinomialDevianceLoss()(x, y).item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert BinomialDevianceLoss(reduction="mean")(x, y).item() == pytest.approx(expected / len(y), rel=1e-12, abs=1e-15)


def test_binomial_weights_are_eq_13_14() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]
    sim = cosine_similarity_matrix(x)
    w = pair_weights("binomial_deviance", sim, y)
    al, be, ga = 2.0, 50.0, 0.5
    s, yl = sim.tolist(), y.tolist()
    for i in range(len(yl)):
        ps, ns = positives(yl, i), negatives(yl, i)
        for j in ps:
            e = math.exp(al * (ga - s[i][j]))
            assert w.positive[i, j].item() == pytest.approx(al * e / (len(ps) * (1 + e)), rel=1e-10)
        for j in ns:
            e = math.exp(be * (s[i][j] - ga))
            assert w.negative[i, j].item() == pytest.approx(be * e / (len(ns) * (1 + e)), rel=1e-10)


def test_one_class_value_is_the_papers() -> None:
    x, y = PAIR_CASES["one_class"]
    s, yl = sim_list(x), y.tolist()
    assert BinomialDevianceLoss()(x, y).item() == pytest.approx(binomial_reference(s, yl, 2.0, 50.0, 0.5), rel=1e-12)
