"""Triplet loss (thesis Eq. 2.17) against pytorch-metric-learning, the formula and its weights."""

from __future__ import annotations

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.reducers import MeanReducer, SumReducer

from tests.training.losses.helpers import (
    EXACT,
    PAIR_CASES,
    TIE_FREE,
    assert_close,
    per_anchor_reference,
    semihard_reference,
    sim_list,
    value_and_grads,
)
from training.losses import cosine_similarity_matrix
from training.losses.mining import mine_triplets
from training.losses.pair_based import TripletLoss
from training.losses.weights import pair_weights


@pytest.mark.parametrize("miner", ["semihard", "hard", "all"])
@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_triplet_matches_pml_on_the_same_triplets(name: str, miner: str) -> None:
    x, y = PAIR_CASES[name]
    triplets = tuple(mine_triplets(miner, cosine_similarity_matrix(x), y))
    ours = TripletLoss(margin=0.1, miner=miner)
    ref = pml_losses.TripletMarginLoss(margin=0.1, distance=CosineSimilarity(), reducer=MeanReducer())
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y, indices_tuple=triplets), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


@pytest.mark.parametrize("name", TIE_FREE)
def test_triplet_all_matches_pml_miner_and_loss(name: str) -> None:
    """Batch-all through pml's own miner: its "all" type keeps the margin-violating triplets,
    so with pml's default (average over non-zero) reduction both give the same number."""
    x, y = PAIR_CASES[name]
    ours = TripletLoss(margin=0.1, miner="all", reduction="sum")
    miner = pml_miners.TripletMarginMiner(margin=0.1, type_of_triplets="all", distance=CosineSimilarity())
    ref = pml_losses.TripletMarginLoss(margin=0.1, distance=CosineSimilarity(), reducer=SumReducer())
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y, miner(e, y)), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


def test_triplet_matches_eq_2_17_loop() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]
    s, yl = sim_list(x), y.tolist()
    for miner, trip in (
        ("semihard", semihard_reference(s, yl)),
        ("hard", per_anchor_reference(s, yl, easiest_positive=False)),
    ):
        expected = sum(max(s[a][n] - s[a][p] + 0.1, 0.0) for a, p, n in trip) / len(trip)
        assert TripletLoss(miner=miner)(x, y).item() == pytest.approx(expected, rel=1e-12)


def test_hard_triplet_weights_are_eq_8() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]
    sim = cosine_similarity_matrix(x)
    w = pair_weights("triplet", sim, y, miner="hard", reduction="sum")
    expected_pos, expected_neg = torch.zeros_like(sim), torch.zeros_like(sim)
    for a, p, n in per_anchor_reference(sim.tolist(), y.tolist(), easiest_positive=False):
        if sim[a, n] - sim[a, p] + 0.1 > 0:  # the set B of Eq. 8
            expected_pos[a, p] += 1.0
            expected_neg[a, n] += 1.0
    torch.testing.assert_close(w.positive, expected_pos, **EXACT)
    torch.testing.assert_close(w.negative, expected_neg, **EXACT)
