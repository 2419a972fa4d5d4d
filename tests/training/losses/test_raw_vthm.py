"""RAW + VTHM (the unified view, 5.1-5.2) against pytorch-metric-learning, the paper and edge cases.

``multi_similarity`` is an alias of ``raw_vthm``: its tests are here too. Library comparisons run
in float64 and compare values and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from tests.training.losses.helpers import (
    EXACT,
    F64,
    PAIR_CASES,
    assert_close,
    clustered,
    on_circle,
    shuffled,
    value_and_grads,
)
from training.losses import (
    available_losses,
    build_loss,
    cosine_similarity_matrix,
    get_loss_class,
    loss_requires_num_classes,
)
from training.losses.raw_vthm import RawVthmLoss
from training.losses.weights import pair_weights

ALPHA, BETA, GAMMA, LAM = 2.0, 50.0, 0.5, 0.1


def pml_raw_vthm(
    x: torch.Tensor,
    labels: torch.Tensor,
    *,
    mining: bool = True,
    paper_semantics: bool = True,
    alpha: float = ALPHA,
    beta: float = BETA,
    gamma: float = GAMMA,
    lam: float = LAM,
) -> torch.Tensor:
    """MultiSimilarityLoss (+ MultiSimilarityMiner) from pytorch-metric-learning.

    pml's reduction is MeanReducer over the per-anchor terms ("element" reduction over all m
    anchors, 0 for an anchor with nothing mined), i.e. exactly the 1/m of docs/architecture.md. The only
    difference is GenericPairLoss.compute_loss returning 0 when every index list it gets has at
    most one entry; with ``paper_semantics`` the oracle skips that shortcut by calling the
    loss's matrix path directly (same distance, same masks, same log-sum-exp, same mean).
    """
    loss_fn = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=gamma)
    if mining:
        pairs = pml_miners.MultiSimilarityMiner(epsilon=lam)(x, labels)
    else:
        pairs = lmu.get_all_pairs_indices(labels)
    if not paper_semantics:
        return loss_fn(x, labels, pairs)
    mat = loss_fn.distance(x)
    per_anchor = loss_fn.mat_based_loss(mat, pairs)["loss"]["losses"]
    return per_anchor.mean()


def pml_shortcut_fires(x: torch.Tensor, labels: torch.Tensor, lam: float = LAM) -> bool:
    pairs = pml_miners.MultiSimilarityMiner(epsilon=lam)(x, labels)
    return all(len(t) <= 1 for t in pairs)


def raw_vthm_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Paper-style P×K batch.
    cases["pk_8x4"] = clustered([c for c in range(8) for _ in range(4)], seed=1, d=16)
    # Uneven class sizes including singletons, labels unsorted and non-contiguous.
    sizes = {1000: 1, -3: 2, 7: 3, 42: 5, 5: 7, 9: 1}
    lab = [c for c, n in sizes.items() for _ in range(n)]
    cases["uneven_unsorted"] = shuffled(*clustered(lab, seed=2, d=16), seed=3)
    cases["mostly_singletons"] = shuffled(*clustered([0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 7], 4, d=16), 5)
    labels = torch.randint(0, 6, (24,), generator=torch.Generator().manual_seed(6))
    cases["random_labels"] = clustered(labels, seed=7, d=16)
    cases["wide_spread"] = clustered([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], seed=8, spread=3.0, d=16)
    # Duplicated embeddings: within a class (s=1 positive) and across classes (s=1 negative).
    x, y = clustered([0, 0, 0, 1, 1, 2, 2, 2], seed=9, d=16)
    x = torch.cat([x, x[1:2] * 3.0, x[3:4] * 0.5, x[5:6]])
    y = torch.cat([y, torch.tensor([0, 2, 1])])
    cases["duplicates"] = shuffled(x, y, seed=10)
    # Ties: several positives equally far, several negatives equally close (exact copies).
    base, _ = clustered([0, 1, 2], seed=11, norm_spread=0.0, d=16)
    x = torch.stack([base[0], base[1], base[1], base[1], base[2], base[2], base[2], base[0]])
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 0])
    cases["ties"] = (x * torch.linspace(0.5, 4.0, len(y), dtype=F64).unsqueeze(1), y)
    cases["two_same"] = clustered([3, 3], seed=12, d=16)
    cases["two_different"] = clustered([3, 4], seed=13, d=16)
    cases["one_class"] = clustered([5] * 6, seed=14, d=16)
    cases["all_distinct"] = clustered(list(range(7)), seed=15, d=16)
    cases["single_sample"] = clustered([0], seed=16, d=16)
    # Similarities within 1e-9 / 1e-7 of both VTHM thresholds for anchor 0.
    for eps in (1e-9, 1e-7):
        s_n_star, s_p_star = 0.3, 0.2
        cos = [
            s_p_star,  # p*: least similar positive (kept: 0.2 < 0.3 + λ)
            s_n_star + LAM - eps,  # positive just inside  s < s_n* + λ
            s_n_star + LAM + eps,  # positive just outside
            s_n_star,  # n*: most similar negative (kept)
            s_p_star - LAM + eps,  # negative just inside  s > s_p* - λ
            s_p_star - LAM - eps,  # negative just outside
            -0.4,  # easy negative
        ]
        x = on_circle(cos, signs=[1, -1, 1, -1, 1, -1, 1], d=6, seed=17, scaled=False)
        y = torch.tensor([0, 0, 0, 0, 1, 2, 1, 3])
        cases[f"near_threshold_{eps:g}"] = (x, y)
    return cases


RAW_CASES = raw_vthm_cases()


@pytest.mark.parametrize("name", sorted(RAW_CASES))
@pytest.mark.parametrize("mining", [True, False], ids=["vthm", "all_pairs"])
def test_raw_vthm_matches_pml(name: str, mining: bool) -> None:
    x, y = RAW_CASES[name]
    ours = RawVthmLoss(mining=mining)
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: pml_raw_vthm(e, y, mining=mining), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)
    # Where pml's ≤1-pair shortcut does not fire, its public API agrees as well.
    if not (mining and pml_shortcut_fires(x, y)):
        v_pub, (g_pub,) = value_and_grads(lambda e: pml_raw_vthm(e, y, mining=mining, paper_semantics=False), x)
        assert_close(v, v_pub)
        assert_close(g, g_pub)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("alpha", "beta", "gamma", "lam"),
    [(ALPHA, BETA, GAMMA, LAM), (1.0, 10.0, 0.3, 0.25), (5.0, 80.0, 0.7, 0.0)],
)
def test_raw_vthm_random_batches_and_hparams(seed: int, alpha: float, beta: float, gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    m = int(torch.randint(2, 40, (1,), generator=g))
    n_classes = int(torch.randint(1, max(2, m // 2), (1,), generator=g))
    y = torch.randint(0, n_classes, (m,), generator=g) * 17 - 5
    x, y = clustered(y, seed=200 + seed, spread=float(torch.rand(1, generator=g)) * 3, d=16)
    ours = RawVthmLoss(alpha=alpha, beta=beta, gamma=gamma, margin=lam)
    v, (gr,) = value_and_grads(lambda e: ours(e, y), x)
    v_ref, (g_ref,) = value_and_grads(lambda e: pml_raw_vthm(e, y, alpha=alpha, beta=beta, gamma=gamma, lam=lam), x)
    assert_close(v, v_ref)
    assert_close(gr, g_ref)


def test_cases_exercise_partial_mining() -> None:
    """Guard against vacuous comparisons: the clustered batches must keep some pairs and drop
    others, so that mining actually matters."""
    loss = RawVthmLoss()
    kept = dropped = 0
    for name in ("pk_8x4", "uneven_unsorted", "random_labels", "wide_spread"):
        x, y = RAW_CASES[name]
        sim = cosine_similarity_matrix(x)
        keep = loss.mine(sim, y)
        every = RawVthmLoss(mining=False).mine(sim, y)
        kept += int(keep.positive.sum() + keep.negative.sum())
        dropped += int((every.positive & ~keep.positive).sum() + (every.negative & ~keep.negative).sum())
    assert kept > 20 and dropped > 20


@pytest.mark.parametrize("eps", [1e-9, 1e-7])
def test_near_threshold_masks_follow_the_paper(eps: float) -> None:
    x, y = RAW_CASES[f"near_threshold_{eps:g}"]
    keep = RawVthmLoss().mine(cosine_similarity_matrix(x), y)
    # Anchor 0: rows 1..3 positives, 4..7 negatives (see raw_vthm_cases).
    assert keep.positive[0].tolist() == [False, True, True, False, False, False, False, False]
    assert keep.negative[0].tolist() == [False, False, False, False, True, True, False, False]


def test_strict_inequalities_at_exact_thresholds() -> None:
    # Dyadic similarities and λ make the comparisons exact: a pair sitting exactly on its
    # threshold is dropped (paper: s_ij > s_ip* - λ and s_ij < s_in* + λ, both strict).
    sim = torch.tensor([[1.0, 0.75, 0.5], [0.75, 1.0, 0.25], [0.5, 0.25, 1.0]], dtype=F64)
    y = torch.tensor([0, 0, 1])
    at = RawVthmLoss(margin=0.25).mine(sim, y)
    assert not at.positive[0, 1] and not at.negative[0, 2]
    above = RawVthmLoss(margin=0.25 + 2**-20).mine(sim, y)
    assert above.positive[0, 1] and above.negative[0, 2]
    assert RawVthmLoss(margin=0.25).loss_from_similarity(sim, y).item() == 0.0


def test_pml_zero_shortcut_disagreement_paper_wins() -> None:
    """pml returns 0 when mining leaves at most one positive and one negative pair; the paper
    (and this loss) keep those pairs' Eq. 17 terms."""
    deg = math.pi / 180
    pts = [
        (1.0, 0.0),
        (math.cos(60 * deg), math.sin(60 * deg)),
        (math.cos(-60 * deg), math.sin(-60 * deg)),
    ]
    x = torch.tensor(pts, dtype=F64)
    y = torch.tensor([0, 0, 1])
    # Anchor 0 keeps (0,1) and (0,2) (s=0.5 each); anchor 1's pairs are easy; anchor 2 has no
    # positive. One positive and one negative pair in total.
    assert pml_shortcut_fires(x, y)
    pml_value = pml_raw_vthm(x, y, paper_semantics=False)
    assert pml_value.item() == 0.0
    ours = RawVthmLoss()
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    expected = (math.log(2) / ALPHA + math.log(2) / BETA) / 3
    assert v.item() == pytest.approx(expected, rel=1e-12)
    assert g.abs().sum() > 0
    v_ref, (g_ref,) = value_and_grads(lambda e: pml_raw_vthm(e, y), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


def eq17_reference(sim: torch.Tensor, y: torch.Tensor, loss: RawVthmLoss) -> float:
    """Eq. 17 and VTHM with explicit loops, straight from the paper's text."""
    m = len(y)
    total = 0.0
    for i in range(m):
        pos = [j for j in range(m) if j != i and y[j] == y[i]]
        neg = [j for j in range(m) if y[j] != y[i]]
        if not pos or not neg:
            continue
        p_star = min(float(sim[i, j]) for j in pos)
        n_star = max(float(sim[i, j]) for j in neg)
        kept_p = [j for j in pos if float(sim[i, j]) < n_star + loss.margin]
        kept_n = [j for j in neg if float(sim[i, j]) > p_star - loss.margin]
        total += math.log1p(sum(math.exp(-loss.alpha * (float(sim[i, k]) - loss.gamma)) for k in kept_p)) / loss.alpha
        total += math.log1p(sum(math.exp(loss.beta * (float(sim[i, k]) - loss.gamma)) for k in kept_n)) / loss.beta
    return total / m


@pytest.mark.parametrize("name", ["pk_8x4", "uneven_unsorted", "duplicates", "ties", "near_threshold_1e-07"])
def test_raw_vthm_matches_paper_loop(name: str) -> None:
    x, y = RAW_CASES[name]
    loss = RawVthmLoss()
    sim = cosine_similarity_matrix(x)
    assert loss(x, y).item() == pytest.approx(eq17_reference(sim, y, loss), rel=1e-12)


@pytest.mark.parametrize("name", ["pk_8x4", "uneven_unsorted", "duplicates", "ties", "mostly_singletons"])
@pytest.mark.parametrize("mining", [True, False])
def test_pair_weights_are_the_gradient(name: str, mining: bool) -> None:
    """∂L/∂s_ij = (w_neg_ij - w_pos_ij)/m: Eq. 17 is gradient-equivalent to Eq. 15-16."""
    x, y = RAW_CASES[name]
    loss = RawVthmLoss(mining=mining)
    sim = cosine_similarity_matrix(x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss.loss_from_similarity(sim, y), sim)
    w = loss.pair_weights(x, y)
    m = len(y)
    torch.testing.assert_close(grad, (w.negative - w.positive) / m, rtol=1e-10, atol=1e-14)
    keep = loss.mine(sim, y)
    assert torch.all(w.positive[~keep.positive] == 0) and torch.all(w.negative[~keep.negative] == 0)
    assert torch.all(w.positive[keep.positive] > 0) and torch.all(w.negative[keep.negative] > 0)


def test_pair_weights_match_eq_15_16_literally() -> None:
    x, y = RAW_CASES["uneven_unsorted"]
    loss = RawVthmLoss()
    sim = cosine_similarity_matrix(x)
    keep = loss.mine(sim, y)
    w = loss.pair_weights(x, y)
    a, b, g = loss.alpha, loss.beta, loss.gamma
    m = len(y)
    for i in range(m):
        p_idx = keep.positive[i].nonzero().flatten().tolist()
        n_idx = keep.negative[i].nonzero().flatten().tolist()
        for j in p_idx:
            s = sim[i]
            denom = sum(math.exp(a * (s[j] - s[k])) for k in p_idx) + math.exp(a * (s[j] - g))
            assert w.positive[i, j].item() == pytest.approx(1 / denom, rel=1e-10)
        for j in n_idx:
            s = sim[i]
            denom = sum(math.exp(-b * (s[j] - s[k])) for k in n_idx) + math.exp(-b * (s[j] - g))
            assert w.negative[i, j].item() == pytest.approx(1 / denom, rel=1e-10)


@pytest.mark.parametrize("labels", [[4] * 5, [4], list(range(6))], ids=["one_class", "one_sample", "all_distinct"])
def test_degenerate_batches_give_zero_with_usable_backward(labels: list[int]) -> None:
    x = torch.randn(len(labels), 8, requires_grad=True)
    y = torch.tensor(labels)
    v = RawVthmLoss()(x, y)
    assert v.item() == 0.0
    assert v.grad_fn is not None and v.requires_grad
    v.backward()
    assert x.grad is not None and torch.all(x.grad == 0)


def test_mining_false_keeps_one_class_positive_terms() -> None:
    x, y = RAW_CASES["one_class"]
    assert RawVthmLoss(mining=False)(x, y).item() > 0


def test_invariant_to_input_norm() -> None:
    x, y = RAW_CASES["pk_8x4"]
    scales = torch.logspace(-4, 4, len(y), dtype=F64).unsqueeze(1)
    loss = RawVthmLoss()
    v, (g,) = value_and_grads(lambda e: loss(e, y), x)
    v_scaled = loss(x * scales, y)
    assert v_scaled.item() == pytest.approx(v.item(), rel=1e-12)
    # Gradient w.r.t. the raw input scales as 1/norm (chain rule through normalisation).
    _, (g_scaled,) = value_and_grads(lambda e: loss(e, y), x * scales)
    torch.testing.assert_close(g_scaled * scales, g, rtol=1e-8, atol=1e-14)


def test_large_beta_is_finite() -> None:
    x, y = RAW_CASES["duplicates"]  # cross-class duplicates: s=1, β(s-γ) = 1000
    loss = RawVthmLoss(beta=2000.0)
    v, (g,) = value_and_grads(lambda e: loss(e, y), x)
    assert math.isfinite(v.item()) and torch.isfinite(g).all()
    v_ref, (g_ref,) = value_and_grads(lambda e: pml_raw_vthm(e, y, beta=2000.0), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


def test_float32_and_mixed_precision() -> None:
    x, y = RAW_CASES["pk_8x4"]
    loss = RawVthmLoss()
    v64 = loss(x, y)
    v32 = loss(x.float(), y)
    assert v32.dtype == torch.float32
    assert v32.item() == pytest.approx(v64.item(), rel=1e-4)
    xb = x.float().bfloat16()
    vb = loss(xb, y)
    assert vb.dtype == torch.float32  # similarities upcast before mining
    assert vb.item() == pytest.approx(loss(xb.float(), y).item(), rel=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        va = loss(x.float(), y)
    assert va.dtype == torch.float32
    assert va.item() == pytest.approx(v32.item(), rel=1e-6)


def test_gradcheck_raw_vthm() -> None:
    x, y = RAW_CASES["uneven_unsorted"]
    loss = RawVthmLoss()
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x.clone().requires_grad_(True),))


def test_raw_vthm_input_validation() -> None:
    loss = RawVthmLoss()
    with pytest.raises(ValueError, match="empty batch"):
        loss(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(torch.randn(4, 3), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="embeddings must be"):
        loss(torch.randn(4), torch.tensor([0, 1, 0, 1]))
    for bad in ({"alpha": 0.0}, {"beta": -1.0}, {"margin": float("nan")}):
        with pytest.raises(ValueError):
            RawVthmLoss(**bad)


@pytest.mark.parametrize("name", ["pk_4x4", "uneven_unsorted", "ties"])
def test_raw_vthm_weights_are_eq_15_16(name: str) -> None:
    x, y = PAIR_CASES[name]
    sim = cosine_similarity_matrix(x)
    w = pair_weights("raw_vthm", sim, y)
    expected = RawVthmLoss().pair_weights(x, y)
    torch.testing.assert_close(w.positive, expected.positive / len(y), **EXACT)
    torch.testing.assert_close(w.negative, expected.negative / len(y), **EXACT)


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


def test_multi_similarity_is_an_alias_with_the_thesis_option_names() -> None:
    """``multi_similarity`` is registered once, as an alias of ``raw_vthm``: the thesis's margin
    λ (0.5) is γ and its ε (0.1) is raw_vthm's mining margin λ."""
    assert "multi_similarity" not in available_losses()
    assert get_loss_class("multi_similarity") is RawVthmLoss
    assert loss_requires_num_classes("multi_similarity") is False
    assert build_loss("multi_similarity").hyperparameters() == RawVthmLoss().hyperparameters()
    loss = build_loss("multi_similarity", alpha=3.0, beta=40.0, margin=0.4, epsilon=0.2, mining=False, reduction="sum")
    assert loss.hyperparameters() == {
        "alpha": 3.0,
        "beta": 40.0,
        "gamma": 0.4,
        "margin": 0.2,
        "mining": False,
        "reduction": "sum",
    }
    with pytest.raises(TypeError, match=r"'multi_similarity' got unknown option\(s\) 'gamma'.*margin, epsilon"):
        build_loss("multi_similarity", gamma=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    x, y = RAW_CASES["uneven_unsorted"]
    for mining in (True, False):
        loss = RawVthmLoss(mining=mining)
        v, (g,) = value_and_grads(lambda e, loss=loss: loss(e, y), x)
        # Labels left on the CPU on purpose: the loss moves them.
        v_cuda, (g_cuda,) = value_and_grads(lambda e, loss=loss: loss(e, y), x.cuda())
        assert_close(v_cuda.cpu(), v)
        assert_close(g_cuda.cpu(), g)
    v_deg = RawVthmLoss()(x[:3].cuda().requires_grad_(True), torch.tensor([1, 1, 1]).cuda())
    assert v_deg.item() == 0.0 and v_deg.grad_fn is not None
    with torch.autocast("cuda", dtype=torch.float16):
        v_amp = RawVthmLoss()(x.float().cuda(), y.cuda())
    assert v_amp.dtype == torch.float32
    assert v_amp.item() == pytest.approx(RawVthmLoss()(x.float(), y).item(), rel=1e-4)
