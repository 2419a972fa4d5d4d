"""ArcFace (thesis Eq. 2.29) against pytorch-metric-learning and the formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses

from tests.training.losses.helpers import PROXY_CASES, assert_close, seeded, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses.proxy_based import ArcFaceLoss


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
