"""Miners (``training.losses.mining``) against their definitions and pytorch-metric-learning."""

from __future__ import annotations

import pytest

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from tests.training.losses.helpers import (
    PAIR_CASES,
    TIE_FREE,
    negatives,
    per_anchor_reference,
    positives,
    semihard_reference,
    sim_list,
    triplet_set,
)
from training.losses import cosine_similarity_matrix
from training.losses.mining import TRIPLET_MINERS, BatchHardMiner, VthmMiner, all_pairs, mine_triplets
from training.losses.pair_based import ContrastiveLoss, TripletLoss
from training.losses.raw_vthm import RawVthmLoss


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_miners_follow_the_definitions(name: str) -> None:
    x, y = PAIR_CASES[name]
    sim, s, yl = cosine_similarity_matrix(x), sim_list(x), y.tolist()
    assert triplet_set(mine_triplets("semihard", sim, y)) == semihard_reference(s, yl)
    assert triplet_set(mine_triplets("hard", sim, y)) == per_anchor_reference(s, yl, easiest_positive=False)
    assert triplet_set(mine_triplets("ephn", sim, y)) == per_anchor_reference(s, yl, easiest_positive=True)
    assert triplet_set(mine_triplets("all", sim, y)) == triplet_set(lmu.get_all_triplets_indices(y))


@pytest.mark.parametrize("name", TIE_FREE + ["duplicates"])
def test_hard_miner_matches_pml_batch_hard(name: str) -> None:
    x, y = PAIR_CASES[name]
    ours = mine_triplets("hard", cosine_similarity_matrix(x), y)
    ref = pml_miners.BatchHardMiner(distance=CosineSimilarity())(x, y)
    assert triplet_set(ours) == triplet_set(ref)


def test_semihard_disagrees_with_pml_as_documented() -> None:
    """pml's "semihard" keeps every triplet with 0 < S_ap - S_an <= margin; Eq. 2.20 keeps one
    negative per positive pair, the most similar one below S_ap. Where pml has triplets for
    (a, p), ours exists and is exactly their most similar negative."""
    margin, extra = 0.1, 0
    for name in TIE_FREE:
        x, y = PAIR_CASES[name]
        sim = cosine_similarity_matrix(x)
        ours = {(a, p): n for a, p, n in triplet_set(mine_triplets("semihard", sim, y))}
        miner = pml_miners.TripletMarginMiner(margin=margin, type_of_triplets="semihard", distance=CosineSimilarity())
        by_pair: dict[tuple[int, int], list[int]] = {}
        for a, p, n in triplet_set(miner(x, y)):
            by_pair.setdefault((a, p), []).append(n)
        for (a, p), ns in by_pair.items():
            assert float(sim[a, ours[(a, p)]]) == max(float(sim[a, n]) for n in ns)
            extra += len(ns) - 1
    assert extra > 0  # the library keeps more than one negative for some positive pairs


def test_miners_are_objects_composed_with_the_losses() -> None:
    """A miner is a callable object: a loss owns a configured one (configurations name it) or
    takes its output as ``indices_tuple``, as in pytorch-metric-learning."""
    x, y = PAIR_CASES["uneven_unsorted"]
    sim = cosine_similarity_matrix(x)
    hard = BatchHardMiner()
    assert isinstance(TripletLoss(miner="hard").miner, BatchHardMiner)
    assert TripletLoss(miner=hard).miner is hard and TripletLoss(miner=hard).hyperparameters()["miner"] == "hard"
    assert TripletLoss(miner=hard)(x, y).item() == TripletLoss(miner="hard")(x, y).item()
    # Indices passed in replace the loss's own mining.
    triplets = hard(sim, y)
    assert TripletLoss(miner="all")(x, y, triplets).item() == TripletLoss(miner="hard")(x, y).item()
    vthm = VthmMiner(epsilon=0.1)
    masks = vthm(sim, y)
    assert isinstance(RawVthmLoss().miner, VthmMiner) and RawVthmLoss(mining=False).miner is None
    assert RawVthmLoss(mining=False)(x, y, masks).item() == RawVthmLoss()(x, y).item()
    # Any pair loss reads mined pairs; without them it reads every pair.
    every = all_pairs(y, sim.device)
    assert ContrastiveLoss()(x, y, every).item() == ContrastiveLoss()(x, y).item()
    assert ContrastiveLoss()(x, y, masks).item() != ContrastiveLoss()(x, y).item()
    known = r"triplet miner must be one of \['all', 'ephn', 'hard', 'semihard'\] or a TripletMiner object"
    with pytest.raises(ValueError, match=known + ", got 'random'"):
        mine_triplets("random", sim, y)
    assert TRIPLET_MINERS.names() == ["all", "ephn", "hard", "semihard"]


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_vthm_miner_follows_the_definition(name: str) -> None:
    """Keep positive j of anchor i if S_ij < max_{N_i} S + ε, negative j if S_ij > min_{P_i} S - ε."""
    x, y = PAIR_CASES[name]
    s, yl = sim_list(x), y.tolist()
    masks = VthmMiner(epsilon=0.1)(cosine_similarity_matrix(x), y)
    for i in range(len(yl)):
        ps, ns = positives(yl, i), negatives(yl, i)
        for j in range(len(yl)):
            keep_p = bool(ps and ns) and j in ps and s[i][j] < max(s[i][k] for k in ns) + 0.1
            keep_n = bool(ps and ns) and j in ns and s[i][j] > min(s[i][k] for k in ps) - 0.1
            assert bool(masks.positive[i, j]) == keep_p and bool(masks.negative[i, j]) == keep_n
