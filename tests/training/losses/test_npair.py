"""Multi-class N-pair loss (thesis Eq. 2.22)."""

from __future__ import annotations

import math

import pytest

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity

from tests.training.losses.helpers import PAIR_CASES, negatives, positives, sim_list
from training.losses.pair_based import NPairLoss


def npair_reference(s: list[list[float]], y: list[int]) -> float:
    total = 0.0
    for i in range(len(y)):
        total += math.log1p(sum(math.exp(s[i][k] - s[i][j]) for k in negatives(y, i) for j in positives(y, i)))
    return total / len(y)


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_npair_matches_eq_2_22(name: str) -> None:
    x, y = PAIR_CASES[name]
    assert NPairLoss()(x, y).item() == pytest.approx(npair_reference(sim_list(x), y.tolist()), rel=1e-12, abs=1e-15)
    assert NPairLoss(reduction="sum")(x, y).item() == pytest.approx(
        npair_reference(sim_list(x), y.tolist()) * len(y), rel=1e-12, abs=1e-15
    )


def test_npair_differs_from_pml_by_design() -> None:
    """pml keeps one positive pair per class and the other classes' positives as negatives;
    Eq. 2.22 uses every positive and every negative of every anchor."""
    x, y = PAIR_CASES["pk_4x4"]
    ref = pml_losses.NPairsLoss(distance=CosineSimilarity())(x, y).item()
    ours = NPairLoss()(x, y).item()
    assert ours == pytest.approx(npair_reference(sim_list(x), y.tolist()), rel=1e-12)
    assert abs(ours - ref) > 1e-3


def test_npair_l2_reg_is_sohns_regulariser_on_raw_norms() -> None:
    x, y = PAIR_CASES["pk_4x4"]
    expected = NPairLoss()(x, y) + 0.02 * x.pow(2).sum(dim=1).mean()
    assert NPairLoss(l2_reg=0.02)(x, y).item() == pytest.approx(expected.item(), rel=1e-12)
