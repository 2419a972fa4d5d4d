"""ProxyNCA (thesis Eq. 2.27-2.28) against pytorch-metric-learning's conventions and the formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses

from tests.training.losses.helpers import EXACT, PROXY_CASES, assert_close, seeded, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses.proxy_based import ProxyNCALoss


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
