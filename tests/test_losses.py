"""Losses against pytorch-metric-learning (test-only oracle), the papers' formulas, and edge cases.

All oracle comparisons run in float64 and compare values and gradients (embeddings, proxies).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses  # noqa: E402
from pytorch_metric_learning import miners as pml_miners  # noqa: E402

import training.losses as losses_pkg
from training.losses import (
    available_losses,
    build_loss,
    cosine_similarity_matrix,
    get_loss_class,
    loss_requires_num_classes,
    register_loss,
)
from training.losses.proxy_anchor import ProxyAnchorLoss
from training.losses.raw_vthm import RawVthmLoss

F64 = torch.float64
RTOL = 1e-5
ATOL = 1e-10  # gradients of pairs/rows that are exactly 0 in one implementation

ALPHA, BETA, GAMMA, LAM = 2.0, 50.0, 0.5, 0.1


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def value_and_grads(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    extra: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    params = [x, *(extra or [])]
    value = fn(x)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return value.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


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
        from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

        pairs = lmu.get_all_pairs_indices(labels)
    if not paper_semantics:
        return loss_fn(x, labels, pairs)
    mat = loss_fn.distance(x)
    per_anchor = loss_fn.mat_based_loss(mat, pairs)["loss"]["losses"]
    return per_anchor.mean()


def pml_shortcut_fires(x: torch.Tensor, labels: torch.Tensor, lam: float = LAM) -> bool:
    pairs = pml_miners.MultiSimilarityMiner(epsilon=lam)(x, labels)
    return all(len(t) <= 1 for t in pairs)


def clustered(
    labels: list[int] | torch.Tensor,
    seed: int,
    d: int = 16,
    spread: float = 0.7,
    norm_spread: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings around per-class centres, so VTHM keeps some pairs and drops others."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.as_tensor(labels, dtype=torch.long)
    classes, idx = torch.unique(labels, return_inverse=True)
    centres = torch.randn(len(classes), d, generator=g, dtype=F64)
    centres = centres / centres.norm(dim=1, keepdim=True)
    x = centres[idx] + spread / math.sqrt(d) * torch.randn(len(labels), d, generator=g, dtype=F64)
    # Norms over several orders of magnitude: the losses normalise internally.
    x = x * torch.exp(norm_spread * torch.randn(len(labels), 1, generator=g, dtype=F64))
    return x, labels


def on_circle(cosines_to_anchor: list[float], signs: list[int], d: int, seed: int) -> torch.Tensor:
    """Row 0 is the anchor; row j has cosine ``cosines_to_anchor[j-1]`` to it (exact up to
    rounding), placed on a random 2-D plane of R^d."""
    g = torch.Generator().manual_seed(seed)
    angles = [0.0] + [sgn * math.acos(c) for c, sgn in zip(cosines_to_anchor, signs, strict=True)]
    pts = torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=F64)
    q, _ = torch.linalg.qr(torch.randn(d, 2, generator=g, dtype=F64))
    return pts @ q.t()


def _shuffle(x: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    return x[perm], labels[perm]


def raw_vthm_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Paper-style P×K batch.
    cases["pk_8x4"] = clustered([c for c in range(8) for _ in range(4)], seed=1)
    # Uneven class sizes including singletons, labels unsorted and non-contiguous.
    sizes = {1000: 1, -3: 2, 7: 3, 42: 5, 5: 7, 9: 1}
    lab = [c for c, n in sizes.items() for _ in range(n)]
    cases["uneven_unsorted"] = _shuffle(*clustered(lab, seed=2), seed=3)
    cases["mostly_singletons"] = _shuffle(*clustered([0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 7], 4), 5)
    cases["random_labels"] = clustered(torch.randint(0, 6, (24,), generator=torch.Generator().manual_seed(6)), seed=7)
    cases["wide_spread"] = clustered([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], seed=8, spread=3.0)
    # Duplicated embeddings: within a class (s=1 positive) and across classes (s=1 negative).
    x, y = clustered([0, 0, 0, 1, 1, 2, 2, 2], seed=9)
    x = torch.cat([x, x[1:2] * 3.0, x[3:4] * 0.5, x[5:6]])
    y = torch.cat([y, torch.tensor([0, 2, 1])])
    cases["duplicates"] = _shuffle(x, y, seed=10)
    # Ties: several positives equally far, several negatives equally close (exact copies).
    base, _ = clustered([0, 1, 2], seed=11, norm_spread=0.0)
    x = torch.stack([base[0], base[1], base[1], base[1], base[2], base[2], base[2], base[0]])
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 0])
    cases["ties"] = (x * torch.linspace(0.5, 4.0, len(y), dtype=F64).unsqueeze(1), y)
    cases["two_same"] = clustered([3, 3], seed=12)
    cases["two_different"] = clustered([3, 4], seed=13)
    cases["one_class"] = clustered([5] * 6, seed=14)
    cases["all_distinct"] = clustered(list(range(7)), seed=15)
    cases["single_sample"] = clustered([0], seed=16)
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
        x = on_circle(cos, signs=[1, -1, 1, -1, 1, -1, 1], d=6, seed=17)
        y = torch.tensor([0, 0, 0, 0, 1, 2, 1, 3])
        cases[f"near_threshold_{eps:g}"] = (x, y)
    return cases


RAW_CASES = raw_vthm_cases()


# --------------------------------------------------------------------------------------------
# RAW + VTHM vs pytorch-metric-learning
# --------------------------------------------------------------------------------------------


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
    x, y = clustered(y, seed=200 + seed, spread=float(torch.rand(1, generator=g)) * 3)
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


# --------------------------------------------------------------------------------------------
# RAW + VTHM: formulas, gradients, edge cases
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# ProxyAnchor
# --------------------------------------------------------------------------------------------


def proxy_pair(
    num_classes: int, dim: int, alpha: float = 32.0, margin: float = 0.1, seed: int = 0
) -> tuple[ProxyAnchorLoss, torch.nn.Module]:
    torch.manual_seed(seed)
    ours = ProxyAnchorLoss(num_classes, dim, alpha=alpha, margin=margin).double()
    ref = pml_losses.ProxyAnchorLoss(num_classes, dim, margin=margin, alpha=alpha)
    ref.proxies.data = ours.proxies.detach().clone()
    return ours, ref


def proxy_cases() -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    x, y = clustered([c for c in range(6) for _ in range(4)], seed=30, d=12)
    cases["pk_6x4_of_10"] = (10, x, y)
    x, y = clustered([9, 0, 3, 3, 9, 9, 9, 1, 3, 0, 7], seed=31, d=12)
    cases["uneven_unsorted"] = (12, x, y)
    x, y = clustered([2] * 5, seed=32, d=12)
    cases["one_class"] = (4, x, y)
    x, y = clustered(list(range(8)), seed=33, d=12)
    cases["all_classes_once"] = (8, x, y)
    x, y = clustered([5], seed=34, d=12)
    cases["single_sample"] = (6, x, y)
    x, y = clustered([0, 1, 1, 2], seed=35, d=12)
    cases["duplicates"] = (3, torch.cat([x, x[:2] * 7.0]), torch.cat([y, torch.tensor([0, 2])]))
    return cases


PROXY_CASES = proxy_cases()


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
@pytest.mark.parametrize(("alpha", "margin"), [(32.0, 0.1), (8.0, 0.3)])
def test_proxy_anchor_matches_pml(name: str, alpha: float, margin: float) -> None:
    num_classes, x, y = PROXY_CASES[name]
    ours, ref = proxy_pair(num_classes, x.shape[1], alpha=alpha, margin=margin)
    v, (gx, gp) = value_and_grads(lambda e: ours(e, y), x, [ours.proxies])
    v_ref, (gx_ref, gp_ref) = value_and_grads(lambda e: ref(e, y), x, [ref.proxies])
    assert_close(v, v_ref)
    assert_close(gx, gx_ref)
    assert_close(gp, gp_ref)


def eq231_reference(cos: torch.Tensor, y: torch.Tensor, alpha: float, delta: float) -> float:
    m, c = cos.shape
    pos_total, neg_total, n_pos = 0.0, 0.0, 0
    for w in range(c):
        pos = [i for i in range(m) if y[i] == w]
        neg = [i for i in range(m) if y[i] != w]
        if pos:
            n_pos += 1
            pos_total += math.log1p(sum(math.exp(-alpha * (float(cos[i, w]) - delta)) for i in pos))
        neg_total += math.log1p(sum(math.exp(alpha * (float(cos[i, w]) + delta)) for i in neg))
    return pos_total / n_pos + neg_total / c


@pytest.mark.parametrize("name", sorted(PROXY_CASES))
def test_proxy_anchor_matches_eq_2_31(name: str) -> None:
    num_classes, x, y = PROXY_CASES[name]
    ours, _ = proxy_pair(num_classes, x.shape[1])
    cos = cosine_similarity_matrix(x, ours.proxies.detach())
    assert ours(x, y).item() == pytest.approx(eq231_reference(cos, y, 32.0, 0.1), rel=1e-12)


def test_proxy_init_matches_official_code() -> None:
    torch.manual_seed(123)
    loss = build_loss("proxy_anchor", num_classes=50, embedding_dim=64)
    torch.manual_seed(123)
    expected = torch.empty(50, 64)
    torch.nn.init.kaiming_normal_(expected, mode="fan_out")
    assert isinstance(loss.proxies, torch.nn.Parameter)
    assert dict(loss.named_parameters()).keys() == {"proxies"}
    torch.testing.assert_close(loss.proxies.detach(), expected, rtol=0, atol=0)
    # The proxies can get their own learning rate.
    opt = torch.optim.AdamW([{"params": [loss.proxies], "lr": 1e-2}])
    assert opt.param_groups[0]["params"][0] is loss.proxies


def test_proxy_anchor_label_validation() -> None:
    loss = ProxyAnchorLoss(num_classes=4, embedding_dim=3)
    x = torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\).*\[0, 4\]"):
        loss(x, torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        loss(x, torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="integer"):
        loss(x, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="shape"):
        loss(x, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\(batch, 3\)"):
        loss(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="empty batch"):
        loss(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    for bad in (
        {"num_classes": 0, "embedding_dim": 3},
        {"num_classes": 2, "embedding_dim": 3, "alpha": 0},
    ):
        with pytest.raises(ValueError):
            ProxyAnchorLoss(**bad)


def test_proxy_anchor_dtypes_and_gradcheck() -> None:
    loss = ProxyAnchorLoss(num_classes=5, embedding_dim=6)
    x = torch.randn(7, 6)
    y = torch.tensor([0, 1, 1, 4, 4, 4, 2])
    assert loss(x, y).dtype == torch.float32
    assert loss(x.bfloat16(), y).dtype == torch.float32
    loss64 = loss.double()
    x64 = x.double().requires_grad_(True)
    p64 = loss64.proxies.detach().clone().requires_grad_(True)

    def fn(e: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(loss64, {"proxies": p}, (e, y))

    assert torch.autograd.gradcheck(fn, (x64, p64))


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def test_registry_lists_and_builds() -> None:
    assert {"raw_vthm", "proxy_anchor"} <= set(available_losses())
    assert available_losses() == sorted(available_losses())
    loss = build_loss("raw_vthm", alpha=3.0, mining=False)
    assert isinstance(loss, RawVthmLoss) and loss.alpha == 3.0 and not loss.mining
    assert get_loss_class("proxy_anchor") is ProxyAnchorLoss
    assert loss_requires_num_classes("proxy_anchor") is True
    assert loss_requires_num_classes("raw_vthm") is False
    assert RawVthmLoss().hyperparameters() == {
        "alpha": 2.0,
        "beta": 50.0,
        "gamma": 0.5,
        "margin": 0.1,
        "mining": True,
        "reduction": "mean",
    }


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown loss 'nope'.*proxy_anchor.*raw_vthm"):
        build_loss("nope")
    with pytest.raises(ValueError, match="unknown loss"):
        loss_requires_num_classes("nope")
    with pytest.raises(TypeError, match=r"'raw_vthm' got unknown option\(s\) 'lamda'.*margin"):
        build_loss("raw_vthm", lamda=0.1)
    with pytest.raises(TypeError, match=r"'raw_vthm' got unknown option\(s\) 'num_classes'"):
        build_loss("raw_vthm", num_classes=10)
    with pytest.raises(TypeError, match=r"'proxy_anchor' requires option\(s\) 'num_classes'"):
        build_loss("proxy_anchor", embedding_dim=8)
    with pytest.raises(ValueError, match="alpha"):
        build_loss("raw_vthm", alpha=-1.0)


def test_register_loss_rejects_conflicts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(losses_pkg, "LOSSES", losses_pkg.LOSSES.copy())

    @register_loss("test_only_loss")
    class Dummy(torch.nn.Module):
        def __init__(self, scale: float = 1.0) -> None:
            super().__init__()
            self.scale = scale

    assert "test_only_loss" in available_losses()
    assert build_loss("test_only_loss", scale=2.0).scale == 2.0
    with pytest.raises(ValueError, match="already registered"):

        @register_loss("raw_vthm")
        class Other(torch.nn.Module):
            pass

    with pytest.raises(TypeError, match="nn.Module"):
        register_loss("not_a_module")(int)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Device parity
# --------------------------------------------------------------------------------------------


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
    num_classes, xp, yp = PROXY_CASES["uneven_unsorted"]
    ours, _ = proxy_pair(num_classes, xp.shape[1])
    v, (gx, gp) = value_and_grads(lambda e: ours(e, yp), xp, [ours.proxies])
    ours_cuda = ours.cuda()
    v_c, (gx_c, gp_c) = value_and_grads(lambda e: ours_cuda(e, yp), xp.cuda(), [ours_cuda.proxies])
    assert_close(v_c.cpu(), v)
    assert_close(gx_c.cpu(), gx)
    assert_close(gp_c.cpu(), gp)
    with torch.autocast("cuda", dtype=torch.float16):
        v_amp = RawVthmLoss()(x.float().cuda(), y.cuda())
    assert v_amp.dtype == torch.float32
    assert v_amp.item() == pytest.approx(RawVthmLoss()(x.float(), y).item(), rel=1e-4)
