"""Input checks, label masks, reductions and a proxy base shared by the loss-zoo modules.

Private to ``training.losses``: the public surface is the registry. Label validation is
``raw_vthm``'s so every loss rejects the same inputs with the same message.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .raw_vthm import _check_labels
from .similarity import cosine_similarity_matrix

REDUCTIONS = ("mean", "sum")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_batch(embeddings: torch.Tensor, labels: torch.Tensor, loss_name: str) -> None:
    """``embeddings`` (m, d) with m >= 1 and ``labels`` (m,)."""
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
        raise ValueError(f"embeddings must be (batch, dim), got {shape}")
    _check_labels(labels, embeddings.shape[0])
    if embeddings.shape[0] == 0:
        raise ValueError(f"{loss_name} got an empty batch")


def check_similarity(sim: torch.Tensor, labels: torch.Tensor) -> None:
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"sim must be a square matrix, got shape {tuple(sim.shape)}")
    _check_labels(labels, sim.shape[0])


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_finite(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"{name} must be finite, got {value!r}")


@torch.no_grad()
def label_masks(labels: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positive, negative) m×m masks: same label off the diagonal, different label."""
    labels = labels.to(device)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=device)
    return same & ~eye, ~same


def reduce(total: torch.Tensor, count: torch.Tensor | int, reduction: str) -> torch.Tensor:
    """``total`` (already summed) as a sum or a mean over ``count`` terms.

    An empty mean is 0 rather than 0/0: ``total`` is then a masked sum that is exactly 0 and
    still carries the graph, so backward yields zeros instead of NaN.
    """
    if reduction == "sum":
        return total
    if isinstance(count, torch.Tensor):
        return total / count.clamp_min(1).to(total.dtype)
    return total / max(int(count), 1)


def masked_logsumexp(logits: torch.Tensor, keep: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``log Σ_{keep} exp(logits)`` along ``dim`` and whether anything was kept.

    Rows with nothing kept get a finite dummy (0) so that neither the value nor the gradient
    of ``torch.logsumexp`` turns into NaN; callers mask those rows out with the returned flag.
    """
    nonempty = keep.any(dim=dim)
    # A row with nothing kept is computed over all-True (finite) entries and then discarded.
    safe_keep = keep | ~nonempty.unsqueeze(dim)
    lse = torch.logsumexp(logits.masked_fill(~safe_keep, float("-inf")), dim=dim)
    return torch.where(nonempty, lse, torch.zeros_like(lse)), nonempty


def normalized_embeddings(embeddings: torch.Tensor) -> torch.Tensor:
    """L2-normalised rows with ``cosine_similarity_matrix``'s conventions: fp16/bf16 upcast to
    float32 with autocast off, and the same epsilon (a zero row stays zero)."""
    with torch.autocast(device_type=embeddings.device.type, enabled=False):
        x = embeddings.float() if embeddings.dtype in _LOW_PRECISION else embeddings
        return F.normalize(x, p=2.0, dim=1, eps=1e-12)


def pairwise_distance(embeddings: torch.Tensor) -> torch.Tensor:
    """m×m Euclidean distances between the normalised embeddings, from their coordinates.

    Unlike ``sqrt(2 - 2 s)`` this resolves near-duplicates (``2 - 2s`` loses everything below
    ~1e-8 in float64, ~3e-4 in float32), so a collapsed batch still gets a push-apart direction.
    The matrix-multiply shortcut is disabled for the same reason. At exactly zero distance
    ``torch.cdist``'s gradient is 0.
    """
    f = normalized_embeddings(embeddings)
    with torch.autocast(device_type=f.device.type, enabled=False):
        return torch.cdist(f, f, compute_mode="donot_use_mm_for_euclid_dist")


def distance_from_similarity(sim: torch.Tensor) -> torch.Tensor:
    """Euclidean distance between unit vectors, ``sqrt(2 - 2 s)``.

    ``2 - 2s`` is floored at the dtype's epsilon, the size of its rounding error: it keeps the
    gradient finite for duplicates (s = 1, where d sqrt/dx is infinite) and for s rounded to
    slightly above 1, where the gradient is then 0 (like ``torch.cdist``'s at zero distance).
    """
    return torch.sqrt(torch.clamp(2.0 - 2.0 * sim, min=torch.finfo(sim.dtype).eps))


class ProxyLoss(nn.Module):
    """Base of the losses with learnable per-class parameters (``requires_num_classes``).

    ``proxies`` holds ``proxies_per_class`` rows per class, class-major. Only directions matter
    (every loss here L2-normalises them), so the initialisation is ProxyAnchor's
    ``kaiming_normal_(mode="fan_out")``: isotropic, i.e. uniformly random directions.
    """

    requires_num_classes = True

    def __init__(self, num_classes: int, embedding_dim: int, proxies_per_class: int = 1) -> None:
        super().__init__()
        for name, value in (
            ("num_classes", num_classes),
            ("embedding_dim", embedding_dim),
            ("proxies_per_class", proxies_per_class),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim
        self.proxies = nn.Parameter(torch.empty(num_classes * proxies_per_class, embedding_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def hyperparameters(self) -> dict[str, Any]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())

    def loss_from_cosines(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, labels = self.proxy_similarity(embeddings, labels)
        return self.loss_from_cosines(cos, labels)

    def proxy_similarity(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated inputs → (cosine to every proxy (m, rows), labels as long on the device)."""
        check_batch(embeddings, labels, type(self).__name__)
        if embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"embeddings must have shape (batch, {self.embedding_dim}), got {tuple(embeddings.shape)}")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
        # One host sync per step: an out-of-range label would otherwise be a cryptic indexing
        # error (or a device-side assert on CUDA).
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(f"labels must lie in [0, {self.num_classes}); got values in [{lo}, {hi}]")
        labels = labels.to(device=embeddings.device, dtype=torch.long)
        return cosine_similarity_matrix(embeddings, self.proxies), labels


class SimilarityLoss(nn.Module):
    """Base of the pair-based losses: a function of the m×m cosine-similarity matrix.

    ``forward`` normalises the embeddings (norm-invariant) and hands the matrix to
    ``loss_from_similarity``, which is public so the pair-weight view (``weights.py``) can
    differentiate a loss with respect to the similarities themselves.
    """

    requires_num_classes = False

    def hyperparameters(self) -> dict[str, Any]:
        """Resolved hyper-parameters, for run manifests."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())

    def _loss(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss_from_similarity(self, sim: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss on a precomputed m×m similarity matrix."""
        check_similarity(sim, labels)
        if sim.shape[0] == 0:
            raise ValueError(f"{type(self).__name__} got an empty batch")
        return self._loss(sim, labels)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_batch(embeddings, labels, type(self).__name__)
        return self.loss_from_similarity(cosine_similarity_matrix(embeddings), labels)
