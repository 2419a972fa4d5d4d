"""Contrastive loss (thesis Eq. 2.15) against pytorch-metric-learning, the formula and its weights."""

from __future__ import annotations

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.reducers import SumReducer

from tests.training.losses.helpers import EXACT, F64, PAIR_CASES, assert_close, counts, sim_list, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses.pair_based import ContrastiveLoss
from training.losses.weights import pair_weights


def contrastive_reference(s: list[list[float]], y: list[int], margin: float, reduction: str) -> float:
    total, count = 0.0, 0
    for i in range(len(y)):
        for j in range(len(y)):
            if i != j:
                count += 1
                total += -s[i][j] if y[i] == y[j] else max(s[i][j] - margin, 0.0)
    return total / max(count, 1) if reduction == "mean" else total


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_contrastive_matches_pml(name: str) -> None:
    """pml's positive term is [pos_margin - S]_+; with pos_margin = 2 it is 2 - S for every S in
    [-1, 1], i.e. Eq. 2.15's -S plus 2 per positive pair, and the same gradient."""
    x, y = PAIR_CASES[name]
    ours = ContrastiveLoss(margin=0.5, reduction="sum")
    ref = pml_losses.ContrastiveLoss(pos_margin=2.0, neg_margin=0.5, distance=CosineSimilarity(), reducer=SumReducer())
    n_pos = int(counts(y)[0].sum())
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y) - 2.0 * n_pos, x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_contrastive_matches_eq_2_15(name: str, reduction: str) -> None:
    x, y = PAIR_CASES[name]
    value = ContrastiveLoss(reduction=reduction)(x, y).item()
    assert value == pytest.approx(contrastive_reference(sim_list(x), y.tolist(), 0.5, reduction), rel=1e-12, abs=1e-15)


def test_contrastive_duplicate_positive_keeps_its_weight() -> None:
    """Paper: a positive pair's weight is 1 whatever its similarity (unified view, Eq. 6). pml's
    [1 - S]_+ drops a duplicate positive whose S rounds to >= 1."""
    x = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [-1.0, 0.5, 0.0]], dtype=F64)
    y = torch.tensor([0, 0, 1])
    sim = cosine_similarity_matrix(x)
    w = pair_weights("contrastive", sim, y, reduction="sum")
    assert w.positive[0, 1].item() == 1.0 and w.positive[1, 0].item() == 1.0


def test_contrastive_weights_are_eq_6() -> None:
    x, y = PAIR_CASES["wide_spread"]
    sim = cosine_similarity_matrix(x)
    pos = (y.unsqueeze(0) == y.unsqueeze(1)) & ~torch.eye(len(y), dtype=torch.bool)
    neg = y.unsqueeze(0) != y.unsqueeze(1)
    w = pair_weights("contrastive", sim, y, reduction="sum")
    assert torch.all(w.positive[pos] == 1.0) and torch.all(w.positive[~pos] == 0.0)
    assert torch.all(w.negative[neg & (sim > 0.5)] == 1.0)
    assert torch.all(w.negative[neg & (sim <= 0.5)] == 0.0) and bool((neg & (sim <= 0.5)).any())
    mean = pair_weights("contrastive", sim, y)  # default mean: one constant over all pairs
    n_pairs = len(y) * (len(y) - 1)
    torch.testing.assert_close(mean.positive, w.positive / n_pairs, **EXACT)
    torch.testing.assert_close(mean.negative, w.negative / n_pairs, **EXACT)


def test_one_class_value_is_the_papers() -> None:
    x, y = PAIR_CASES["one_class"]
    s, yl = sim_list(x), y.tolist()
    assert ContrastiveLoss()(x, y).item() == pytest.approx(contrastive_reference(s, yl, 0.5, "mean"), rel=1e-12)
