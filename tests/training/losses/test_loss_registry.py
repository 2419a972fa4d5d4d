"""The loss registry: names, construction from options, errors."""

from __future__ import annotations

import pytest
import torch

import training.losses.registry as losses_pkg
from tests.training.losses.helpers import PAPER_DEFAULTS
from training.losses import available_losses, build_loss, get_loss_class, loss_requires_num_classes, register_loss
from training.losses.proxy_anchor import ProxyAnchorLoss
from training.losses.raw_vthm import RawVthmLoss


def test_registry_lists_and_builds() -> None:
    assert {"raw_vthm", "proxy_anchor"} <= set(available_losses())
    assert available_losses() == sorted(available_losses())
    loss = build_loss("raw_vthm", alpha=3.0, mining=False)
    assert isinstance(loss, RawVthmLoss) and loss.alpha == 3.0 and not loss.mining
    assert get_loss_class("proxy_anchor") is ProxyAnchorLoss
    assert loss_requires_num_classes("proxy_anchor") is True
    assert loss_requires_num_classes("raw_vthm") is False
    assert RawVthmLoss().hyperparameters() == PAPER_DEFAULTS["raw_vthm"]  # exactly: nothing more


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
