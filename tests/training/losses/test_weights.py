"""The weight view (``training.losses.weights``) and its plot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.losses.helpers import F64, PAIR_CASES
from training.losses import cosine_similarity_matrix
from training.losses.pair_based import ContrastiveLoss
from training.losses.plot_weights import plot_pair_weights, weight_curve
from training.losses.proxy_based import ArcFaceLoss
from training.losses.weights import pair_based_losses, pair_weights


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
