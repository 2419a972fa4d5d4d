"""Reducers: per-element losses → the scalar a loss returns (pytorch-metric-learning's ``reducers``).

A loss computes one term per element (anchor, pair, triplet, proxy or sample) and hands them to
its reducer, optionally with ``valid``, a boolean mask of the elements that count: the rest
must be exactly 0 (masked out by the loss). Which reducer a loss uses is its ``reduction``
option; each loss's default is the one its paper writes (a sum over anchors, or ``1/m``).

* ``MeanReducer``: ``Σ losses / #counted`` (all elements, or the ``valid`` ones). An empty mean
  is 0 rather than 0/0: the sum is then a masked sum that is exactly 0 and still carries the
  graph, so backward yields zeros instead of NaN. pytorch-metric-learning's ``MeanReducer``
  averages over every element it is given, i.e. the same.
* ``SumReducer``: ``Σ losses``.

pytorch-metric-learning's default for many losses is ``AvgNonZeroReducer`` (the mean over the
non-zero terms); no loss here uses it, since none of the papers averages that way.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from core.registry import Registry

__all__ = ["REDUCERS", "BaseReducer", "MeanReducer", "SumReducer", "build_reducer"]


class BaseReducer:
    """``reducer(losses, valid=None)`` → a 0-d tensor."""

    name: ClassVar[str] = ""

    def __call__(self, losses: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


REDUCERS: Registry[type[BaseReducer]] = Registry("reduction", base=BaseReducer)


@REDUCERS.register("mean")
class MeanReducer(BaseReducer):
    name = "mean"

    def __call__(self, losses: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        total = losses.sum()
        if valid is None:
            return total / max(losses.numel(), 1)
        return total / valid.sum().clamp_min(1).to(total.dtype)


@REDUCERS.register("sum")
class SumReducer(BaseReducer):
    name = "sum"

    def __call__(self, losses: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        return losses.sum()


def build_reducer(reduction: str | BaseReducer) -> BaseReducer:
    """A reducer object, or the one a configuration names (``"mean"``, ``"sum"``)."""
    return REDUCERS.build(reduction)
