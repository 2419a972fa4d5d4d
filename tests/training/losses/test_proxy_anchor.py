"""Proxy-Anchor (Kim et al.) against pytorch-metric-learning, Eq. 2.31 and the official initialisation."""

from __future__ import annotations

import math

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses

from tests.training.losses.helpers import assert_close, clustered, value_and_grads
from training.losses import build_loss, cosine_similarity_matrix
from training.losses.proxy_anchor import ProxyAnchorLoss


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    num_classes, xp, yp = PROXY_CASES["uneven_unsorted"]
    ours, _ = proxy_pair(num_classes, xp.shape[1])
    v, (gx, gp) = value_and_grads(lambda e: ours(e, yp), xp, [ours.proxies])
    ours_cuda = ours.cuda()
    v_c, (gx_c, gp_c) = value_and_grads(lambda e: ours_cuda(e, yp), xp.cuda(), [ours_cuda.proxies])
    assert_close(v_c.cpu(), v)
    assert_close(gx_c.cpu(), gx)
    assert_close(gp_c.cpu(), gp)
