"""The loss zoo against pytorch-metric-learning (test-only oracle) and the papers' formulas.

Library comparisons run in float64 and compare values and gradients (embeddings and, for proxy
losses, proxies) to 1e-5 relative, with the library configured to the same parameters. Where
the papers and the library disagree, brute-force references written from the papers' formulas
(plain loops over pairs/triplets) pin the papers' behaviour; each such test says which rule.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses  # noqa: E402
from pytorch_metric_learning import miners as pml_miners  # noqa: E402
from pytorch_metric_learning.distances import CosineSimilarity  # noqa: E402
from pytorch_metric_learning.reducers import MeanReducer, SumReducer  # noqa: E402
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu  # noqa: E402

from tests.test_losses import assert_close, value_and_grads
from training.losses import (
    build_loss,
    cosine_similarity_matrix,
    get_loss_class,
    loss_requires_num_classes,
)
from training.losses._common import pairwise_distance
from training.losses.direct_gradient import (
    PRESETS,
    DirectGradientConfig,
    DirectGradientLoss,
    designed_gradient,
    direct_gradient,
)
from training.losses.histogram import HistogramLoss, histogram_overlap, similarity_histogram
from training.losses.mining import mine_triplets
from training.losses.pair_based import (
    BinomialDevianceLoss,
    ContrastiveLoss,
    LiftedStructureLoss,
    MarginLoss,
    NPairLoss,
    TripletLoss,
)
from training.losses.plot_weights import plot_pair_weights, weight_curve
from training.losses.proxy_based import ArcFaceLoss, NormalizedSoftmaxLoss, ProxyNCALoss, SoftTripleLoss
from training.losses.raw_vthm import RawVthmLoss
from training.losses.weights import pair_based_losses, pair_weights

F64 = torch.float64
EXACT = {"rtol": 1e-10, "atol": 1e-12}  # brute-force loops: same math, different summation order


# --------------------------------------------------------------------------------------------
# helpers and batches
# --------------------------------------------------------------------------------------------


def clustered(
    labels: list[int] | torch.Tensor, seed: int, d: int = 8, spread: float = 0.7, norm_spread: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings around per-class centres, with norms over orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.as_tensor(labels, dtype=torch.long)
    _, idx = torch.unique(labels, return_inverse=True)
    centres = F.normalize(torch.randn(int(idx.max()) + 1, d, generator=g, dtype=F64), dim=1)
    x = centres[idx] + spread / math.sqrt(d) * torch.randn(len(labels), d, generator=g, dtype=F64)
    return x * torch.exp(norm_spread * torch.randn(len(labels), 1, generator=g, dtype=F64)), labels


def shuffled(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm], y[perm]


def on_circle(cosines: list[float], signs: list[int], d: int, seed: int) -> torch.Tensor:
    """Row 0 is the anchor; row j has cosine ``cosines[j-1]`` to it, on a random plane of R^d."""
    g = torch.Generator().manual_seed(seed)
    angles = [0.0] + [sgn * math.acos(c) for c, sgn in zip(cosines, signs, strict=True)]
    pts = torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=F64)
    q, _ = torch.linalg.qr(torch.randn(d, 2, generator=g, dtype=F64))
    return pts @ q.t() * torch.linspace(0.5, 3.0, len(angles), dtype=F64).unsqueeze(1)


def pair_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    cases["pk_4x4"] = clustered([c for c in range(4) for _ in range(4)], seed=1)
    sizes = {1000: 1, -3: 2, 7: 3, 42: 5, 5: 4, 9: 1}  # singletons, unsorted, non-contiguous
    cases["uneven_unsorted"] = shuffled(*clustered([c for c, n in sizes.items() for _ in range(n)], seed=2), seed=3)
    cases["random_labels"] = clustered(torch.randint(0, 5, (18,), generator=torch.Generator().manual_seed(4)), 5)
    cases["wide_spread"] = clustered([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], seed=6, spread=3.0)
    # Exact duplicates: within a class (s = 1 positive) and across classes (s = 1 negative).
    x, y = clustered([0, 0, 0, 1, 1, 2, 2, 2], seed=7)
    cases["duplicates"] = shuffled(
        torch.cat([x, x[1:2] * 3.0, x[3:4] * 0.5, x[5:6]]), torch.cat([y, torch.tensor([0, 2, 1])]), seed=8
    )
    # Ties: equally similar positives and negatives (copies of three directions).
    base, _ = clustered([0, 1, 2], seed=9, norm_spread=0.0)
    x = torch.stack([base[0], base[1], base[1], base[1], base[2], base[2], base[2], base[0]])
    cases["ties"] = (x * torch.linspace(0.5, 4.0, 8, dtype=F64).unsqueeze(1), torch.tensor([0, 0, 0, 1, 1, 2, 2, 0]))
    # Anchor 0's similarities within 1e-9 of the contrastive/lifted margin (0.5), of the triplet
    # margin (S_ap - S_an = 0.1) and of S_an = S_ap (semi-hard boundary, sc1).
    cos = [0.5 + 1e-9, 0.5 - 1e-9, 0.7, 0.6 + 1e-9, 0.6 - 1e-9, 0.7 - 1e-9, 0.5, -0.3]
    cases["near_thresholds"] = (
        on_circle(cos, signs=[1, -1, 1, -1, 1, -1, 1, -1], d=6, seed=15),
        torch.tensor([0, 1, 2, 0, 1, 2, 1, 0, 2]),
    )
    cases["two_same"] = clustered([3, 3], seed=10)
    cases["two_different"] = clustered([3, 4], seed=11)
    cases["one_class"] = clustered([5] * 5, seed=12)
    cases["all_distinct"] = clustered(list(range(6)), seed=13)
    cases["single_sample"] = clustered([0], seed=14)
    return cases


PAIR_CASES = pair_cases()
TIE_FREE = ["pk_4x4", "uneven_unsorted", "random_labels", "wide_spread"]


def counts(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor: number of positives and of negatives."""
    same = y.unsqueeze(0) == y.unsqueeze(1)
    return same.sum(dim=1) - 1, (~same).sum(dim=1)


def every_anchor_has_both(y: torch.Tensor) -> bool:
    n_pos, n_neg = counts(y)
    return bool((n_pos > 0).all() and (n_neg > 0).all())


def sim_list(x: torch.Tensor) -> list[list[float]]:
    return cosine_similarity_matrix(x).tolist()


def positives(y: list[int], a: int) -> list[int]:
    return [j for j in range(len(y)) if j != a and y[j] == y[a]]


def negatives(y: list[int], a: int) -> list[int]:
    return [j for j in range(len(y)) if y[j] != y[a]]


# --------------------------------------------------------------------------------------------
# miners
# --------------------------------------------------------------------------------------------


def triplet_set(t: tuple[torch.Tensor, ...]) -> list[tuple[int, int, int]]:
    return sorted(zip(*(v.tolist() for v in t), strict=True))


def semihard_reference(s: list[list[float]], y: list[int]) -> list[tuple[int, int, int]]:
    """Eq. 2.20: per (a, p), argmax_{n: S_ap > S_an} S_an (lowest index among ties)."""
    out = []
    for a in range(len(y)):
        for p in positives(y, a):
            cands = [n for n in negatives(y, a) if s[a][n] < s[a][p]]
            if cands:
                best = max(s[a][n] for n in cands)
                out.append((a, p, min(n for n in cands if s[a][n] == best)))
    return sorted(out)


def per_anchor_reference(s: list[list[float]], y: list[int], easiest_positive: bool) -> list[tuple[int, int, int]]:
    """Eq. 2.18-2.19 (hardest positive) or easy positive; hardest negative; lowest index on ties."""
    out = []
    for a in range(len(y)):
        ps, ns = positives(y, a), negatives(y, a)
        if ps and ns:
            target = max(s[a][p] for p in ps) if easiest_positive else min(s[a][p] for p in ps)
            p = min(p for p in ps if s[a][p] == target)
            hardest = max(s[a][n] for n in ns)
            out.append((a, p, min(n for n in ns if s[a][n] == hardest)))
    return out


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


# --------------------------------------------------------------------------------------------
# contrastive
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# triplet
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# lifted structure
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# N-pair
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# margin
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# multi-similarity
# --------------------------------------------------------------------------------------------


def pml_multi_similarity(x: torch.Tensor, y: torch.Tensor, mining: bool = True) -> torch.Tensor:
    """pml's MS loss through its matrix path: skips the "at most one pair → 0" shortcut."""
    loss_fn = pml_losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5)
    pairs = pml_miners.MultiSimilarityMiner(epsilon=0.1)(x, y) if mining else lmu.get_all_pairs_indices(y)
    return loss_fn.mat_based_loss(loss_fn.distance(x), pairs)["loss"]["losses"].mean()


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_multi_similarity_matches_pml_and_raw_vthm(name: str, mining: bool) -> None:
    x, y = PAIR_CASES[name]
    ours = build_loss("multi_similarity", mining=mining)
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: pml_multi_similarity(e, y, mining), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)
    # The texts' MS mining is VTHM and Eq. 2.24 is Eq. 17: the same loss.
    v_raw, (g_raw,) = value_and_grads(lambda e: RawVthmLoss(mining=mining)(e, y), x)
    torch.testing.assert_close(v, v_raw, **EXACT)
    torch.testing.assert_close(g, g_raw, **EXACT)


# --------------------------------------------------------------------------------------------
# binomial deviance
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# histogram
# --------------------------------------------------------------------------------------------


def histogram_reference(values: list[float], nodes: int) -> list[float]:
    """Eq. 3 with half-open intervals [t_r, t_{r+1}) (the last one closed)."""
    step = 2.0 / (nodes - 1)
    t = [-1.0 + r * step for r in range(nodes)]
    h = [0.0] * nodes
    for v in values:
        for r in range(nodes - 1):
            if t[r] <= v < t[r + 1] or (r == nodes - 2 and v >= t[r + 1]):
                h[r] += (t[r + 1] - v) / step
                h[r + 1] += (v - t[r]) / step
                break
    return [hr / len(values) for hr in h]


def histogram_loss_reference(s: list[list[float]], y: list[int], nodes: int) -> float:
    pos = [s[i][j] for i in range(len(y)) for j in range(i + 1, len(y)) if y[i] == y[j]]
    neg = [s[i][j] for i in range(len(y)) for j in range(i + 1, len(y)) if y[i] != y[j]]
    if not pos or not neg:
        return 0.0
    h_pos, h_neg = histogram_reference(pos, nodes), histogram_reference(neg, nodes)
    return sum(h_neg[r] * sum(h_pos[: r + 1]) for r in range(nodes))  # Eq. 2


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
@pytest.mark.parametrize("bins", [201, 21])
def test_histogram_matches_eq_1_5(name: str, bins: int) -> None:
    x, y = PAIR_CASES[name]
    expected = histogram_loss_reference(sim_list(x), y.tolist(), bins)
    assert HistogramLoss(bins=bins)(x, y).item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


PML_INDEXING_WARNING = "ignore:Using a non-tuple sequence for multidimensional indexing"


@pytest.mark.filterwarnings(PML_INDEXING_WARNING)
@pytest.mark.parametrize("name", ["pk_4x4", "wide_spread", "random_labels"])
@pytest.mark.parametrize("step", [0.01, 0.1])
def test_histogram_matches_pml(name: str, step: float) -> None:
    x, y = PAIR_CASES[name]
    if name == "random_labels":  # pml builds pairs from triplets: drop singleton classes
        keep = torch.isin(y, torch.unique(y)[torch.bincount(y)[torch.unique(y)] > 1])
        x, y = x[keep], y[keep]
    ours = HistogramLoss(step=step)
    ref = pml_losses.HistogramLoss(n_bins=round(2 / step), distance=CosineSimilarity())
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    with float64_default():
        v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    """pml computes its histogram nodes as ``long_tensor * delta``, which lands in the default
    dtype: float32 unless changed, i.e. ~1e-7 relative error on float64 inputs."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.filterwarnings(PML_INDEXING_WARNING)
def test_histogram_keeps_negative_pairs_between_singletons_unlike_pml() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]  # classes 1000 and 9 are singletons
    ours = HistogramLoss(step=0.1)(x, y).item()
    assert ours == pytest.approx(histogram_loss_reference(sim_list(x), y.tolist(), 21), rel=1e-9)
    with float64_default():
        ref = pml_losses.HistogramLoss(n_bins=20, distance=CosineSimilarity())(x, y).item()
    assert ours != pytest.approx(ref, rel=1e-6)


def test_histogram_gradient_is_eq_4_5() -> None:
    """∂L/∂h⁻_r = Σ_{q≤r} h⁺_q and ∂L/∂h⁺_r = Σ_{q≥r} h⁻_q (Eq. 4 with its superscripts in
    the order Eq. 2 implies), and Eq. 5: ∂h_r/∂s = ±1/(Δ|S|) inside the two adjacent bins."""
    g = torch.Generator().manual_seed(0)
    pos = (torch.rand(9, generator=g, dtype=F64) * 2 - 1).requires_grad_(True)
    neg = (torch.rand(13, generator=g, dtype=F64) * 2 - 1).requires_grad_(True)
    nodes = 11
    h_pos = similarity_histogram(pos, nodes)
    h_neg = similarity_histogram(neg, nodes)
    hp, hn = h_pos.detach().requires_grad_(True), h_neg.detach().requires_grad_(True)
    d_hp, d_hn = torch.autograd.grad(histogram_overlap(hp, hn), (hp, hn))
    torch.testing.assert_close(d_hn, torch.cumsum(h_pos.detach(), 0), **EXACT)
    torch.testing.assert_close(d_hp, torch.flip(torch.cumsum(torch.flip(h_neg.detach(), [0]), 0), [0]), **EXACT)
    # Eq. 5 composed with Eq. 4: a positive s in [t_r, t_{r+1}) gets (∂L/∂h_{r+1} - ∂L/∂h_r)/(Δ|S+|).
    (g_pos,) = torch.autograd.grad(histogram_overlap(h_pos, h_neg), pos)
    step = 2.0 / (nodes - 1)
    r = torch.floor((pos.detach() + 1) / step).long()
    expected = (d_hp[r + 1] - d_hp[r]) / (step * len(pos))
    torch.testing.assert_close(g_pos, expected, **EXACT)


def test_histogram_options_and_edges() -> None:
    assert HistogramLoss().nodes == 201 and HistogramLoss(bins=21).step == pytest.approx(0.1)
    assert HistogramLoss(step=0.1).nodes == 21
    with pytest.raises(ValueError, match="whole number"):
        HistogramLoss(step=0.3)
    with pytest.raises(ValueError, match="bins"):
        HistogramLoss(bins=1)
    # s exactly on a node counts once, fully in that node; s = ±1 sits on the end nodes.
    h = similarity_histogram(torch.tensor([-1.0, 0.0, 1.0], dtype=F64), 5)
    torch.testing.assert_close(h, torch.tensor([1, 0, 1, 0, 1], dtype=F64) / 3)


# --------------------------------------------------------------------------------------------
# proxy losses
# --------------------------------------------------------------------------------------------


def proxy_cases() -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    x, y = clustered([c for c in range(4) for _ in range(3)], seed=30)
    cases["pk_4x3_of_6"] = (6, x, y)
    x, y = clustered([7, 0, 3, 3, 7, 7, 1, 3, 0, 5], seed=31)
    cases["uneven_unsorted"] = (8, x, y)
    x, y = clustered([2] * 4, seed=32)
    cases["one_class"] = (3, x, y)
    x, y = clustered([1], seed=33)
    cases["single_sample"] = (3, x, y)
    x, y = clustered([0, 1, 1, 2], seed=34)
    cases["duplicates"] = (3, torch.cat([x, x[:2] * 7.0]), torch.cat([y, torch.tensor([0, 2])]))
    return cases


PROXY_CASES = proxy_cases()


def seeded(cls: type, num_classes: int, dim: int, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(num_classes, dim, **kw).double()


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_normalized_softmax_matches_pml(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    ours = seeded(NormalizedSoftmaxLoss, c, x.shape[1], temperature=0.05)
    ref = pml_losses.NormalizedSoftmaxLoss(c, x.shape[1], temperature=0.05)
    ref.W.data = ours.proxies.detach().t().clone()
    v, (gx, gp) = value_and_grads(lambda e: ours(e, y), x, [ours.proxies])
    v_ref, (gx_ref, gw) = value_and_grads(lambda e: ref(e, y), x, [ref.W])
    assert_close(v, v_ref)
    assert_close(gx, gx_ref)
    assert_close(gp, gw.t())
    summed = seeded(NormalizedSoftmaxLoss, c, x.shape[1], reduction="sum")
    assert summed(x, y).item() == pytest.approx(v.item() * len(y), rel=1e-12)


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_proxy_nca_with_library_conventions_matches_pml(name: str) -> None:
    """pml: softmax over *all* proxies of -||x̂ - ŵ||² = 2cos - 2, averaged."""
    c, x, y = PROXY_CASES[name]
    ours = seeded(ProxyNCALoss, c, x.shape[1], scale=2.0, exclude_positive=False, reduction="mean")
    ref = pml_losses.ProxyNCALoss(c, x.shape[1], softmax_scale=1)
    ref.proxies.data = ours.proxies.detach().clone()
    v, (gx, gp) = value_and_grads(lambda e: ours(e, y), x, [ours.proxies])
    v_ref, (gx_ref, gp_ref) = value_and_grads(lambda e: ref(e, y), x, [ref.proxies])
    assert_close(v, v_ref)
    assert_close(gx, gx_ref)
    assert_close(gp, gp_ref)


def proxy_nca_reference(cos: list[list[float]], y: list[int], scale: float) -> float:
    return sum(
        math.log(sum(math.exp(scale * cos[i][j]) for j in range(len(cos[i])) if j != y[i])) - scale * cos[i][y[i]]
        for i in range(len(y))
    )


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_proxy_nca_matches_eq_2_27_and_2_28(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    ours = seeded(ProxyNCALoss, c, x.shape[1])
    cos = cosine_similarity_matrix(x, ours.proxies.detach())
    assert ours(x, y).item() == pytest.approx(proxy_nca_reference(cos.tolist(), y.tolist(), 1.0), rel=1e-12)
    # Eq. 2.28: -1 on the positive proxy, a softmax over the negatives elsewhere (scale s: × s).
    scale = 3.0
    loss = seeded(ProxyNCALoss, c, x.shape[1], scale=scale)
    cos = cos.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss.loss_from_cosines(cos, y), cos)
    target = F.one_hot(y, c).bool()
    soft = torch.softmax((scale * cos.detach()).masked_fill(target, float("-inf")), dim=1)
    torch.testing.assert_close(grad, torch.where(target, -scale, scale * soft), **EXACT)


def arcface_reference(cos: list[list[float]], y: list[int], margin_deg: float, scale: float) -> float:
    total = 0.0
    for i in range(len(y)):
        target = scale * math.cos(math.acos(cos[i][y[i]]) + math.radians(margin_deg))
        others = [scale * cos[i][j] for j in range(len(cos[i])) if j != y[i]]
        top = max([target, *others])
        total += -(target - top) + math.log(math.exp(target - top) + sum(math.exp(o - top) for o in others))
    return total


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_arcface_matches_pml(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    ours = seeded(ArcFaceLoss, c, x.shape[1], margin=28.6, scale=64.0, reduction="mean")
    ref = pml_losses.ArcFaceLoss(c, x.shape[1], margin=28.6, scale=64)
    ref.W.data = ours.proxies.detach().t().clone()
    # pml's monotonic fallback only differs beyond θ_y > π - λ; these batches stay below it.
    cos = cosine_similarity_matrix(x, ours.proxies.detach())
    assert bool((cos[torch.arange(len(y)), y] > math.cos(math.pi - math.radians(28.6))).all())
    v, (gx, gp) = value_and_grads(lambda e: ours(e, y), x, [ours.proxies])
    v_ref, (gx_ref, gw) = value_and_grads(lambda e: ref(e, y), x, [ref.W])
    assert_close(v, v_ref)
    assert_close(gx, gx_ref)
    assert_close(gp, gw.t())


def test_arcface_follows_eq_2_29_beyond_pi_minus_margin() -> None:
    """An embedding nearly opposite its class weight: Eq. 2.29 keeps cos(θ + λ); pml switches
    to cos θ - λ sin λ there. The paper's value is pinned."""
    ours = seeded(ArcFaceLoss, 3, 4)
    w = F.normalize(ours.proxies.detach(), dim=1)
    x = torch.stack([-w[0] + 0.05 * w[1], w[1] + 0.3 * w[2], w[2]])
    y = torch.tensor([0, 1, 2])
    cos = cosine_similarity_matrix(x, ours.proxies.detach())
    assert cos[0, 0] < math.cos(math.pi - math.radians(28.6))
    value = ours(x, y).item()
    assert value == pytest.approx(arcface_reference(cos.tolist(), y.tolist(), 28.6, 64.0), rel=1e-10)
    ref = pml_losses.ArcFaceLoss(3, 4, margin=28.6, scale=64)
    ref.W.data = ours.proxies.detach().t().clone()
    assert ref(x, y).item() * 3 != pytest.approx(value, rel=1e-3)


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_arcface_matches_eq_2_29(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    ours = seeded(ArcFaceLoss, c, x.shape[1])
    cos = cosine_similarity_matrix(x, ours.proxies.detach()).tolist()
    assert ours(x, y).item() == pytest.approx(arcface_reference(cos, y.tolist(), 28.6, 64.0), rel=1e-10)


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_soft_triple_matches_pml(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    k = 3
    ours = seeded(SoftTripleLoss, c, x.shape[1], centers_per_class=k, tau=0.0, reduction="mean")
    ref = pml_losses.SoftTripleLoss(c, x.shape[1], centers_per_class=k, la=20, gamma=0.1, margin=0.1)
    ref.fc.data = ours.proxies.detach().t().clone()
    v, (gx, gp) = value_and_grads(lambda e: ours(e, y), x, [ours.proxies])
    v_ref, (gx_ref, gfc) = value_and_grads(lambda e: ref(e, y), x, [ref.fc])
    assert_close(v, v_ref)
    assert_close(gx, gx_ref)
    assert_close(gp, gfc.t())


def soft_triple_reference(x: torch.Tensor, y: list[int], proxies: torch.Tensor, c: int, k: int) -> float:
    """Eq. 2.30 with the relaxed similarity, + τR (Table 4: α=20, γ=10, λ=0.1, τ=0.2)."""
    scale, gamma, margin, tau = 20.0, 10.0, 0.1, 0.2
    cos = cosine_similarity_matrix(x, proxies).tolist()
    total = 0.0
    for i in range(len(y)):
        relaxed = []
        for cls in range(c):
            cs = cos[i][cls * k : (cls + 1) * k]
            z = sum(math.exp(gamma * v) for v in cs)
            relaxed.append(sum(math.exp(gamma * v) / z * v for v in cs))
        logits = [scale * (relaxed[cls] - (margin if cls == y[i] else 0.0)) for cls in range(c)]
        total += math.log(sum(math.exp(v) for v in logits)) - logits[y[i]]
    w = F.normalize(proxies, dim=1).tolist()
    reg = sum(
        math.sqrt(2 + 1e-5 - 2 * sum(a * b for a, b in zip(w[cls * k + t], w[cls * k + u], strict=True)))
        for cls in range(c)
        for t in range(k)
        for u in range(t + 1, k)
    )
    return total + tau * reg / (c * k * (k - 1))


@pytest.mark.parametrize("name", ["pk_4x3_of_6", "uneven_unsorted", "one_class"])
def test_soft_triple_matches_eq_2_30(name: str) -> None:
    c, x, y = PROXY_CASES[name]
    ours = seeded(SoftTripleLoss, c, x.shape[1], centers_per_class=4)
    expected = soft_triple_reference(x, y.tolist(), ours.proxies.detach(), c, 4)
    assert ours(x, y).item() == pytest.approx(expected, rel=1e-10)


def test_normalized_softmax_matches_eq_2_26() -> None:
    c, x, y = PROXY_CASES["uneven_unsorted"]
    ours = seeded(NormalizedSoftmaxLoss, c, x.shape[1])
    cos = cosine_similarity_matrix(x, ours.proxies.detach()).tolist()
    expected = sum(
        math.log(sum(math.exp(v / 0.05) for v in cos[i])) - cos[i][y[i]] / 0.05 for i in range(len(y))
    ) / len(y)
    assert ours(x, y).item() == pytest.approx(expected, rel=1e-10)


# --------------------------------------------------------------------------------------------
# direct gradient
# --------------------------------------------------------------------------------------------


def _unit(v: torch.Tensor) -> torch.Tensor:
    n = float(v.norm())
    return v / n if n > 1e-12 else torch.zeros_like(v)


def direct_gradient_reference(f: torch.Tensor, y: list[int], cfg: DirectGradientConfig) -> torch.Tensor:
    """Section 3 of the gradient-surgery paper, one triplet at a time: Eq. 5-19."""
    s = sim_list(f)  # the project's one definition of S (ties break identically)
    triplets = per_anchor_reference(s, y, easiest_positive=cfg.miner == "ephn")
    a_, b_, lam, eps, tau = cfg.alpha, cfg.beta, cfg.lam, cfg.epsilon, cfg.tau
    grad = torch.zeros_like(f)
    for a, p, n in triplets:
        s_ap, s_an = s[a][p], s[a][n]
        ps, ns = positives(y, a), negatives(y, a)
        max_neg, min_pos = max(s[a][k] for k in ns), min(s[a][k] for k in ps)
        rel_p = [s[a][i] for i in ps if i != p and s[a][i] < max_neg + eps]  # Eq. 12
        rel_n = [s[a][j] for j in ns if j != n and s[a][j] > min_pos - eps]
        pw = cfg.pair_weight
        if pw == "con":
            wp, wn = 1.0, 1.0
        elif pw == "euc":
            wp, wn = float((f[a] - f[p]).norm()), float((f[a] - f[n]).norm())
        elif pw == "lin":
            wp, wn = 1 - s_ap, s_an
        elif pw == "sig":
            wp, wn = 1 / (1 + math.exp(a_ * (s_ap - lam))), 1 / (1 + math.exp(-b_ * (s_an - lam)))
        elif pw == "sig-ms":
            mp = sum(math.exp(a_ * (s_ap - r)) for r in rel_p) / len(rel_p) if rel_p else 1.0
            mn = sum(math.exp(-b_ * (s_an - r)) for r in rel_n) / len(rel_n) if rel_n else 1.0
            wp, wn = 1 / (mp + math.exp(a_ * (s_ap - lam))), 1 / (mn + math.exp(-b_ * (s_an - lam)))
        else:
            mp = sum(s_ap - r for r in rel_p) / len(rel_p) if rel_p else 0.0
            mn = sum(s_an - r for r in rel_n) / len(rel_n) if rel_n else 0.0
            wp, wn = (1 - mp) * (1 - s_ap), (1 + mn) * s_an
        tw = {
            "con": 0.5,
            "cos": 1 / (1 + math.exp(tau * (s_ap - s_an))),
            "cir": 1 / (1 + math.exp(tau * (s_ap * (2 - s_ap) - s_an**2))),
        }[cfg.triplet_weight]
        if (cfg.selective == "sc1" and s_an > s_ap) or (cfg.selective == "sc2" and s_ap * (2 - s_ap) - s_an**2 < 0.5):
            wp = 0.0
        fa, fp, fn = f[a], f[p], f[n]
        if cfg.direction.startswith("cos"):
            e_p, e_n, e_ap, e_an = -fa, fa, -fp, fn  # Eq. 6
        else:
            e_p, e_n = _unit(fp - fa), _unit(fa - fn)  # Eq. 5
            e_ap, e_an = -e_p, -e_n
        if cfg.direction.endswith("orth"):  # Eq. 7
            u = _unit(fa - fp)
            if float(u.norm()) > 0:
                e_n, e_an = _unit(e_n - (e_n @ u) * u), _unit(e_an - (e_an @ u) * u)
        grad[p] += tw * wp * e_p
        grad[n] += tw * wn * e_n
        grad[a] += tw * (wp * e_ap + wn * e_an)
    return grad / max(len(triplets), 1)


DG_CONFIGS = {
    **{
        name: dict(zip(("direction", "pair_weight", "triplet_weight", "selective"), c, strict=True))
        for name, c in PRESETS.items()
    },
    "euc_orth_lin": {"direction": "euc-orth", "pair_weight": "lin", "triplet_weight": "cos"},
    "cir_sc2": {"direction": "cos", "pair_weight": "lin", "triplet_weight": "cir", "selective": "sc2"},
    "sig_ms_hard_miner": {"direction": "cos", "pair_weight": "sig-ms", "triplet_weight": "con", "miner": "hard"},
    "lin_ms_wide_eps": {"direction": "euc", "pair_weight": "lin-ms", "triplet_weight": "cir", "epsilon": 0.5},
}


@pytest.mark.parametrize("case", ["pk_4x4", "uneven_unsorted", "ties", "wide_spread"])
@pytest.mark.parametrize("config", sorted(DG_CONFIGS))
def test_direct_gradient_backward_is_the_designed_gradient(config: str, case: str) -> None:
    x, y = PAIR_CASES[case]
    cfg = DirectGradientConfig(**DG_CONFIGS[config])
    f = F.normalize(x, dim=1).detach().requires_grad_(True)
    value = direct_gradient(f, y, cfg)
    value.backward()
    expected = direct_gradient_reference(f.detach(), y.tolist(), cfg)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(f.grad, expected, rtol=1e-9, atol=1e-13)


def test_direct_gradient_through_the_loss_module() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]
    loss = DirectGradientLoss()
    x = x.clone().requires_grad_(True)
    (3.0 * loss(x, y)).backward()  # backward scales by grad_output
    f = F.normalize(x.detach(), dim=1)
    designed = direct_gradient_reference(f, y.tolist(), loss.config)
    xr = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(F.normalize(xr, dim=1), xr, grad_outputs=3.0 * designed)
    torch.testing.assert_close(x.grad, expected, rtol=1e-9, atol=1e-13)


def test_direct_gradient_hand_example() -> None:
    """Anchor 0, positive 1 (S_ap = 0.8), negative 2 (S_an = 0.6) in a plane; anchor 1 is the
    only other anchor. Check anchor 0's triplet contribution with cosine direction, P^lin, T^cir."""
    f = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, -0.8]], dtype=F64)
    y = torch.tensor([0, 0, 1])
    cfg = DirectGradientConfig(direction="cos", pair_weight="lin", triplet_weight="cir")
    designed = designed_gradient(f, y, cfg)
    tw = 1 / (1 + math.exp(0.8 * 1.2 - 0.36))  # T^cir, τ = 1
    # Anchor 1: S_10 = 0.8, S_12 = 0.8*0.6 - 0.6*0.8 = 0.
    tw1 = 1 / (1 + math.exp(0.8 * 1.2 - 0.0))
    expected = torch.zeros(3, 2, dtype=F64)
    expected[1] += tw * 0.2 * -f[0]
    expected[2] += tw * 0.6 * f[0]
    expected[0] += tw * (0.2 * -f[1] + 0.6 * f[2])
    expected[0] += tw1 * 0.2 * -f[1]  # anchor 1's positive is 0
    expected[2] += tw1 * 0.0 * f[1]
    expected[1] += tw1 * (0.2 * -f[0] + 0.0 * f[2])
    torch.testing.assert_close(designed.grad, expected / 2, **EXACT)


def test_direct_gradient_reproduces_table_1_losses() -> None:
    """(euc, euc, con) is ¼ of Eq. 3's gradient where the hinge is active; (cos, con, cos) is
    1/τ of Eq. 4's; (cos, sig, con) is ½ of binomial deviance's per triplet."""
    x, y = PAIR_CASES["pk_4x4"]
    f0 = F.normalize(x, dim=1)
    trip = per_anchor_reference(f0.mm(f0.t()).tolist(), y.tolist(), easiest_positive=True)
    a, p, n = (torch.tensor(v) for v in zip(*trip, strict=True))

    def autograd_of(fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        f = f0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(f), f)
        return g

    def designed(**kw: object) -> torch.Tensor:
        return designed_gradient(f0, y, DirectGradientConfig(**kw)).grad

    margin = 5.0  # D² ∈ [0, 4]: every hinge active
    eq3 = autograd_of(lambda f: ((f[a] - f[p]).pow(2).sum(1) - (f[a] - f[n]).pow(2).sum(1) + margin).mean())
    torch.testing.assert_close(designed(direction="euc", pair_weight="euc", triplet_weight="con"), eq3 / 4, **EXACT)
    tau = 2.0
    eq4 = autograd_of(lambda f: F.softplus(-tau * ((f[a] * f[p]).sum(1) - (f[a] * f[n]).sum(1))).mean())
    torch.testing.assert_close(
        designed(direction="cos", pair_weight="con", triplet_weight="cos", tau=tau), eq4 / tau, **EXACT
    )
    al, be, lam = 2.0, 10.0, 0.5
    binomial = autograd_of(
        lambda f: (
            F.softplus(-al * ((f[a] * f[p]).sum(1) - lam)) / al + F.softplus(be * ((f[a] * f[n]).sum(1) - lam)) / be
        ).mean()
    )
    torch.testing.assert_close(
        designed(direction="cos", pair_weight="sig", triplet_weight="con"), binomial / 2, **EXACT
    )


@pytest.mark.parametrize("seed", range(4))
def test_direct_gradient_orthogonal_direction(seed: int) -> None:
    """Eq. 7 on a 3-sample batch (anchors 0 and 1 share the positive pair, 2 is the negative):
    the negative's update is orthogonal to f_0 - f_1 with the orth directions only."""
    f = F.normalize(torch.randn(3, 5, generator=torch.Generator().manual_seed(seed), dtype=F64), dim=1)
    y = torch.tensor([0, 0, 1])
    axis = f[0] - f[1]
    for direction in ("cos", "euc"):
        plain = designed_gradient(f, y, DirectGradientConfig(direction=direction)).grad[2]
        orth = designed_gradient(f, y, DirectGradientConfig(direction=f"{direction}-orth")).grad[2]
        assert abs(float(plain @ axis)) > 1e-3
        assert abs(float(orth @ axis)) < 1e-13 and float(orth.norm()) > 1e-3


@pytest.mark.parametrize("case", ["wide_spread", "pk_4x4"])
def test_relative_similarity_terms_are_exercised(case: str) -> None:
    """Guard against vacuous MS-weight checks: the relative terms of Eq. 13-14 are non-trivial
    on the batches used above, so "-ms" differs from its plain form."""
    x, y = PAIR_CASES[case]
    f = F.normalize(x, dim=1)
    for ms, plain, extra in (("lin-ms", "lin", {"epsilon": 0.5}), ("sig-ms", "sig", {"miner": "hard"})):
        g_ms = designed_gradient(f, y, DirectGradientConfig(pair_weight=ms, **extra)).grad
        g_plain = designed_gradient(f, y, DirectGradientConfig(pair_weight=plain, **extra)).grad
        assert (g_ms - g_plain).abs().max() > 1e-6


def test_direct_gradient_presets_and_options() -> None:
    best = DirectGradientLoss()
    assert (best.config.direction, best.config.pair_weight, best.config.triplet_weight) == ("cos-orth", "lin-ms", "cir")
    circle = DirectGradientLoss(preset="circle", triplet_weight="cos")
    assert (circle.config.pair_weight, circle.config.triplet_weight) == ("lin", "cos")
    assert DirectGradientLoss(preset="selectively_contrastive").config.selective == "sc1"
    assert DirectGradientLoss(preset="selectively_contrastive", selective="none").config.selective == "none"
    for bad in ({"preset": "nope"}, {"direction": "up"}, {"pair_weight": "x"}, {"tau": 0.0}, {"miner": "nope"}):
        with pytest.raises(ValueError):
            DirectGradientLoss(**bad)


def test_direct_gradient_cos_surrogate_has_the_designed_gradient() -> None:
    """With the cosine direction, the forward value (weights frozen) differentiates to the
    designed gradient: the weight view and the direct gradient agree."""
    x, y = PAIR_CASES["random_labels"]
    loss = DirectGradientLoss(direction="cos")
    f = F.normalize(x, dim=1).requires_grad_(True)
    (via_sim,) = torch.autograd.grad(loss.loss_from_similarity(f @ f.t(), y), f)
    torch.testing.assert_close(designed_gradient(f.detach(), y, loss.config).grad, via_sim, **EXACT)


# --------------------------------------------------------------------------------------------
# weight view
# --------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("name", ["pk_4x4", "uneven_unsorted", "ties"])
def test_raw_vthm_weights_are_eq_15_16(name: str) -> None:
    x, y = PAIR_CASES[name]
    sim = cosine_similarity_matrix(x)
    w = pair_weights("raw_vthm", sim, y)
    expected = RawVthmLoss().pair_weights(x, y)
    torch.testing.assert_close(w.positive, expected.positive / len(y), **EXACT)
    torch.testing.assert_close(w.negative, expected.negative / len(y), **EXACT)


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


def test_weight_view_api() -> None:
    x, y = PAIR_CASES["pk_4x4"]
    sim = cosine_similarity_matrix(x)
    assert set(pair_based_losses()) >= {
        "binomial_deviance",
        "contrastive",
        "direct_gradient",
        "histogram",
        "lifted_structure",
        "margin",
        "npair",
        "raw_vthm",
        "triplet",
    }
    assert not {"arcface", "proxy_anchor", "soft_triple"} & set(pair_based_losses())
    module = ContrastiveLoss(reduction="sum")
    assert torch.equal(
        pair_weights(module, sim, y).positive, pair_weights("contrastive", sim, y, reduction="sum").positive
    )
    with pytest.raises(ValueError, match="not a function of the similarity matrix"):
        pair_weights(ArcFaceLoss(4, 8), sim, y)
    with pytest.raises(TypeError):
        pair_weights(module, sim, y, margin=0.3)
    for name in pair_based_losses():
        w = pair_weights(name, sim, y)
        assert torch.isfinite(w.positive).all() and torch.isfinite(w.negative).all()
        assert torch.all(w.positive.diagonal() == 0) and torch.all(w.negative.diagonal() == 0)


def test_plot_pair_weights(tmp_path: Path) -> None:
    out = plot_pair_weights(tmp_path / "w.png", ["contrastive", "binomial_deviance"], points=11)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    grid = torch.tensor([-0.5, 0.2, 0.9], dtype=F64)
    torch.testing.assert_close(
        weight_curve("contrastive", grid, positive=False, reduction="sum"), torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    )
    torch.testing.assert_close(
        weight_curve("contrastive", grid, positive=True, reduction="sum"), torch.ones(3, dtype=F64)
    )


# --------------------------------------------------------------------------------------------
# every loss: registry, defaults, invariances, degenerate batches
# --------------------------------------------------------------------------------------------

PAPER_DEFAULTS: dict[str, dict[str, object]] = {
    "contrastive": {"margin": 0.5, "reduction": "mean"},
    "triplet": {"margin": 0.1, "miner": "semihard", "reduction": "mean"},
    "lifted_structure": {"margin": 0.5, "reduction": "sum"},
    "npair": {"reduction": "mean", "l2_reg": 0.0},
    "margin": {"margin": 0.5, "beta": 1.2, "learn_beta": False, "reduction": "mean"},
    "raw_vthm": {
        "alpha": 2.0,
        "beta": 50.0,
        "gamma": 0.5,
        "margin": 0.1,
        "mining": True,
        "reduction": "mean",
    },
    "binomial_deviance": {"alpha": 2.0, "beta": 50.0, "gamma": 0.5, "reduction": "sum"},
    "histogram": {"step": 0.01, "bins": 201},
    "direct_gradient": {
        "preset": "best",
        "direction": "cos-orth",
        "pair_weight": "lin-ms",
        "triplet_weight": "cir",
        "selective": "none",
        "tau": 1.0,
        "alpha": 2.0,
        "beta": 10.0,
        "lam": 0.5,
        "epsilon": 0.1,
        "miner": "ephn",
    },
    "normalized_softmax": {"temperature": 0.05, "reduction": "mean"},
    "proxy_nca": {"scale": 1.0, "exclude_positive": True, "reduction": "sum"},
    "arcface": {"margin": 28.6, "scale": 64.0, "reduction": "sum"},
    "soft_triple": {
        "centers_per_class": 10,
        "scale": 20.0,
        "gamma": 10.0,
        "margin": 0.1,
        "tau": 0.2,
        "reduction": "sum",
    },
}
PROXY_NAMES = {"normalized_softmax", "proxy_nca", "arcface", "soft_triple"}
ZOO = sorted(PAPER_DEFAULTS)
# Single-class batch: zero where the paper's formula has no term (no negative → no triplet, no
# hinge term, no histogram overlap); contrastive, margin and binomial deviance keep their
# positive-pair terms; proxy losses still have the other classes' proxies.
ZERO_ON_ONE_CLASS = {"triplet", "lifted_structure", "npair", "raw_vthm", "histogram", "direct_gradient"}


def make(name: str, num_classes: int = 6, dim: int = 8, **options: object) -> torch.nn.Module:
    if loss_requires_num_classes(name):
        options.update(num_classes=num_classes, embedding_dim=dim)
    torch.manual_seed(0)
    return build_loss(name, **options).double()


@pytest.mark.parametrize("name", ZOO)
def test_registry_round_trip_and_defaults(name: str) -> None:
    loss = make(name)
    assert isinstance(loss, get_loss_class(name))
    assert loss_requires_num_classes(name) is (name in PROXY_NAMES)
    hp = loss.hyperparameters()
    assert {k: hp[k] for k in PAPER_DEFAULTS[name]} == PAPER_DEFAULTS[name]
    rebuilt = build_loss(name, **hp)
    assert rebuilt.hyperparameters() == hp
    assert type(loss).__name__ in repr(loss)
    with pytest.raises(TypeError, match="unknown option"):
        build_loss(name, not_an_option=1, **({"num_classes": 3, "embedding_dim": 4} if name in PROXY_NAMES else {}))


@pytest.mark.parametrize("name", ZOO)
def test_invariant_to_embedding_norm(name: str) -> None:
    c, x, y = PROXY_CASES["uneven_unsorted"] if name in PROXY_NAMES else (6, *PAIR_CASES["pk_4x4"])
    loss = make(name, num_classes=c)
    scales = torch.logspace(-3, 3, len(y), dtype=F64).unsqueeze(1)
    v, (g,) = value_and_grads(lambda e: loss(e, y), x)
    v_scaled, (g_scaled,) = value_and_grads(lambda e: loss(e, y), x * scales)
    assert v_scaled.item() == pytest.approx(v.item(), rel=1e-10)
    torch.testing.assert_close(g_scaled * scales, g, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("name", ZOO)
def test_degenerate_batches(name: str) -> None:
    c, x1, y1 = PROXY_CASES["single_sample"] if name in PROXY_NAMES else (6, *PAIR_CASES["single_sample"])
    loss = make(name, num_classes=c)
    x1 = x1.clone().requires_grad_(True)
    v = loss(x1, y1)
    v.backward()
    if name in PROXY_NAMES:
        assert torch.isfinite(v) and torch.isfinite(x1.grad).all()
    else:  # no pair at all: a zero that backpropagates zeros
        assert v.item() == 0.0 and v.grad_fn is not None and torch.all(x1.grad == 0)
    c, x, y = PROXY_CASES["one_class"] if name in PROXY_NAMES else (6, *PAIR_CASES["one_class"])
    loss = make(name, num_classes=c)
    x = x.clone().requires_grad_(True)
    v = loss(x, y)
    assert v.grad_fn is not None
    v.backward()
    assert torch.isfinite(x.grad).all()
    if name in ZERO_ON_ONE_CLASS:
        assert v.item() == 0.0 and torch.all(x.grad == 0)
    else:
        assert v.item() != 0.0


def test_one_class_values_are_the_papers() -> None:
    x, y = PAIR_CASES["one_class"]
    s, yl = sim_list(x), y.tolist()
    assert ContrastiveLoss()(x, y).item() == pytest.approx(contrastive_reference(s, yl, 0.5, "mean"), rel=1e-12)
    assert MarginLoss()(x, y).item() == pytest.approx(margin_reference(x, yl, 0.5, 1.2), rel=1e-9)
    assert BinomialDevianceLoss()(x, y).item() == pytest.approx(binomial_reference(s, yl, 2.0, 50.0, 0.5), rel=1e-12)


@pytest.mark.parametrize("name", ZOO)
def test_duplicates_give_finite_gradients(name: str) -> None:
    c, x, y = PROXY_CASES["duplicates"] if name in PROXY_NAMES else (6, *PAIR_CASES["duplicates"])
    loss = make(name, num_classes=c)
    params = [p for p in loss.parameters() if p.requires_grad]
    v, grads = value_and_grads(lambda e: loss(e, y), x, params)
    assert torch.isfinite(v)
    assert all(torch.isfinite(g).all() for g in grads)
    if name == "arcface":  # an embedding exactly on its class weight: acos' infinite slope
        w = F.normalize(loss.proxies.detach(), dim=1)
        v, grads = value_and_grads(lambda e: loss(e, torch.tensor([0, 1])), torch.stack([w[0], 2 * w[1]]), params)
        assert torch.isfinite(v) and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ZOO)
def test_low_precision_inputs(name: str) -> None:
    c, x, y = PROXY_CASES["uneven_unsorted"] if name in PROXY_NAMES else (6, *PAIR_CASES["pk_4x4"])
    torch.manual_seed(0)
    kw = {"num_classes": c, "embedding_dim": x.shape[1]} if name in PROXY_NAMES else {}
    loss = build_loss(name, **kw)
    v32 = loss(x.float(), y)
    assert v32.dtype == torch.float32 and torch.isfinite(v32)
    vb = loss(x.float().bfloat16(), y)
    assert vb.dtype == torch.float32 and torch.isfinite(vb)
    v64 = loss.double()(x, y)
    assert v32.item() == pytest.approx(v64.item(), rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("name", ZOO)
def test_input_validation(name: str) -> None:
    loss = make(name, num_classes=4, dim=3)
    with pytest.raises(ValueError, match="empty batch"):
        loss(torch.zeros(0, 3, dtype=F64), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="embeddings must be"):
        loss(torch.randn(4, dtype=F64), torch.tensor([0, 1, 0, 1]))
    if name in PROXY_NAMES:
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
            loss(torch.randn(3, 3, dtype=F64), torch.tensor([0, 4, 1]))


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("contrastive", {"reduction": "max"}),
        ("triplet", {"miner": "random"}),
        ("multi_similarity", {"alpha": 0.0}),
        ("binomial_deviance", {"beta": -1.0}),
        ("margin", {"margin": float("nan")}),
        ("npair", {"l2_reg": -0.1}),
        ("normalized_softmax", {"temperature": 0.0}),
        ("proxy_nca", {"num_classes": 1, "exclude_positive": True}),
        ("arcface", {"scale": -1.0}),
        ("soft_triple", {"centers_per_class": 0}),
    ],
)
def test_invalid_options(name: str, bad: dict[str, object]) -> None:
    options: dict[str, object] = {"num_classes": 3, "embedding_dim": 4} if name in PROXY_NAMES else {}
    options.update(bad)
    with pytest.raises(ValueError):
        build_loss(name, **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ZOO)
def test_cuda_matches_cpu(name: str) -> None:
    c, x, y = PROXY_CASES["uneven_unsorted"] if name in PROXY_NAMES else (6, *PAIR_CASES["uneven_unsorted"])
    loss = make(name, num_classes=c)
    params = [p for p in loss.parameters() if p.requires_grad]
    v, grads = value_and_grads(lambda e: loss(e, y), x, params)
    loss_cuda = loss.cuda()
    params_cuda = [p for p in loss_cuda.parameters() if p.requires_grad]
    v_c, grads_c = value_and_grads(lambda e: loss_cuda(e, y), x.cuda(), params_cuda)  # labels stay on the CPU
    assert_close(v_c.cpu(), v)
    for g, g_c in zip(grads, grads_c, strict=True):
        assert_close(g_c.cpu(), g)
