"""Directly designed gradients (the gradient-surgery paper's section 3) against a per-triplet reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.training.losses.helpers import EXACT, F64, PAIR_CASES, negatives, per_anchor_reference, positives, sim_list
from training.losses.direct_gradient import (
    PRESETS,
    DirectGradientConfig,
    DirectGradientLoss,
    designed_gradient,
    direct_gradient,
)


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
