"""SoftTriple (thesis Eq. 2.30) against pytorch-metric-learning and the formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses

from tests.training.losses.helpers import PROXY_CASES, assert_close, seeded, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses.proxy_based import SoftTripleLoss


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
