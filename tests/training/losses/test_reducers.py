"""Reducers: per-element losses → the scalar a loss returns."""

from __future__ import annotations

import pytest
import torch

from training.losses import build_loss
from training.losses.reducers import MeanReducer, SumReducer, build_reducer


def test_mean_and_sum() -> None:
    losses = torch.tensor([1.0, 2.0, 0.0, 5.0])
    assert MeanReducer()(losses).item() == 2.0
    assert SumReducer()(losses).item() == 8.0
    # Only the valid elements count in the mean (the others are 0 by contract).
    assert MeanReducer()(losses, torch.tensor([True, True, False, True])).item() == pytest.approx(8.0 / 3)
    assert SumReducer()(losses, torch.tensor([True, True, False, True])).item() == 8.0


def test_empty_mean_is_a_zero_that_backpropagates_zeros() -> None:
    x = torch.ones(3, requires_grad=True)
    for losses, valid in ((x[:0] * 2, None), (x * 0, torch.zeros(3, dtype=torch.bool))):
        value = MeanReducer()(losses, valid)
        assert value.item() == 0.0
        (grad,) = torch.autograd.grad(value, x)
        assert torch.all(grad == 0) and torch.isfinite(grad).all()


def test_build_reducer_and_losses_use_it() -> None:
    assert isinstance(build_reducer("mean"), MeanReducer) and isinstance(build_reducer("sum"), SumReducer)
    reducer = SumReducer()
    assert build_reducer(reducer) is reducer
    with pytest.raises(ValueError, match=r"reduction must be one of \['mean', 'sum'\] or a BaseReducer object"):
        build_reducer("max")
    assert isinstance(build_loss("raw_vthm").reducer, MeanReducer)
    assert isinstance(build_loss("binomial_deviance").reducer, SumReducer)
    assert isinstance(build_loss("contrastive", reduction="sum").reducer, SumReducer)
