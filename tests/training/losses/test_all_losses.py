"""Every registered loss: registry round trip, defaults, invariances, degenerate batches, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.training.losses.helpers import F64, PAIR_CASES, PAPER_DEFAULTS, PROXY_CASES, assert_close, value_and_grads
from training.losses import build_loss, get_loss_class, loss_requires_num_classes

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
