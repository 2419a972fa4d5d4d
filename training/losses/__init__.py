"""Metric-learning losses behind a name registry (timm style).

    from training.losses import build_loss, loss_requires_num_classes

    options = dict(cfg.loss_options)
    if loss_requires_num_classes(cfg.loss):
        options.update(num_classes=n_train_classes, embedding_dim=dim)
    criterion = build_loss(cfg.loss, **options)

A loss module registers itself with ``@register_loss("name")``. A loss with learnable
per-class parameters (proxies) sets the class attribute ``requires_num_classes = True`` and
takes ``num_classes`` and ``embedding_dim`` as constructor options, so the training loop needs
no if-chain on loss names. Every loss is an ``nn.Module`` whose ``forward(embeddings, labels)``
returns a scalar.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch.nn as nn

from .similarity import cosine_similarity_matrix, log1p_sum_exp

__all__ = [
    "available_losses",
    "build_loss",
    "cosine_similarity_matrix",
    "get_loss_class",
    "log1p_sum_exp",
    "loss_requires_num_classes",
    "register_loss",
]

_LossT = TypeVar("_LossT", bound=type[nn.Module])

_REGISTRY: dict[str, type[nn.Module]] = {}


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_loss(name: str) -> Callable[[_LossT], _LossT]:
    """Class decorator adding a loss to the registry under ``name``."""
    if not name or name != name.strip():
        raise ValueError(f"invalid loss name {name!r}")

    def decorator(cls: _LossT) -> _LossT:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register_loss({name!r}) expects an nn.Module subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        # Re-registering the same class (e.g. importlib.reload) is harmless; two different
        # classes under one name would make configs silently ambiguous.
        if existing is not None and _qualified_name(existing) != _qualified_name(cls):
            raise ValueError(f"loss name {name!r} is already registered to {_qualified_name(existing)}")
        _REGISTRY[name] = cls
        return cls

    return decorator


def available_losses() -> list[str]:
    """Sorted names of every registered loss."""
    return sorted(_REGISTRY)


def get_loss_class(name: str) -> type[nn.Module]:
    """The class registered under ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(available_losses()) or "(none)"
        raise ValueError(f"unknown loss {name!r}; known losses: {known}") from None


def loss_requires_num_classes(name: str) -> bool:
    """Whether the loss needs ``num_classes`` and ``embedding_dim`` (proxy-based losses)."""
    return bool(getattr(get_loss_class(name), "requires_num_classes", False))


def _constructor_options(cls: type[nn.Module]) -> tuple[dict[str, inspect.Parameter], bool]:
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self", None)
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        n: p
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return named, takes_var_kw


def build_loss(name: str, **options: Any) -> nn.Module:
    """Instantiate the loss registered under ``name`` with keyword ``options``.

    Raises ``ValueError`` for an unknown name and ``TypeError`` naming the offending option for
    unknown or missing options (checked against the constructor signature before calling it, so
    the message lists the valid options). Invalid option values raise the loss's own
    ``ValueError``.
    """
    cls = get_loss_class(name)
    named, takes_var_kw = _constructor_options(cls)
    if not takes_var_kw:
        unknown = sorted(set(options) - set(named))
        if unknown:
            valid = ", ".join(named) or "(none)"
            raise TypeError(
                f"loss {name!r} got unknown option(s) {', '.join(map(repr, unknown))}; valid options: {valid}"
            )
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in options]
    if missing:
        raise TypeError(f"loss {name!r} requires option(s) {', '.join(map(repr, missing))}")
    return cls(**options)


# The loss modules import register_loss from this package, so they are imported only after the
# registry above exists; importing them here is what populates the registry.
from . import direct_gradient, histogram, pair_based, proxy_anchor, proxy_based, raw_vthm, reference  # noqa: E402, F401
