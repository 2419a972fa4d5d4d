"""Normalized softmax loss (thesis Eq. 2.26) against pytorch-metric-learning and the formula."""

from __future__ import annotations

import math

import pytest

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses

from tests.training.losses.helpers import PROXY_CASES, assert_close, seeded, value_and_grads
from training.losses import cosine_similarity_matrix
from training.losses.proxy_based import NormalizedSoftmaxLoss


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


def test_normalized_softmax_matches_eq_2_26() -> None:
    c, x, y = PROXY_CASES["uneven_unsorted"]
    ours = seeded(NormalizedSoftmaxLoss, c, x.shape[1])
    cos = cosine_similarity_matrix(x, ours.proxies.detach()).tolist()
    expected = sum(
        math.log(sum(math.exp(v / 0.05) for v in cos[i])) - cos[i][y[i]] / 0.05 for i in range(len(y))
    ) / len(y)
    assert ours(x, y).item() == pytest.approx(expected, rel=1e-10)
