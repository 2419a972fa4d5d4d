"""Input checks, label masks and distances shared by the losses and miners.

Private to ``training.losses``: the public surface is the registry. Every loss validates its
inputs here, so all of them reject the same inputs with the same message.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_labels(labels: torch.Tensor, m: int) -> None:
    """``labels`` is a tensor of shape (m,)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != m:
        raise ValueError(f"labels must have shape ({m},) to match the batch, got {tuple(labels.shape)}")


def check_batch(embeddings: torch.Tensor, labels: torch.Tensor, loss_name: str) -> None:
    """``embeddings`` (m, d) with m >= 1 and ``labels`` (m,)."""
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
        raise ValueError(f"embeddings must be (batch, dim), got {shape}")
    check_labels(labels, embeddings.shape[0])
    if embeddings.shape[0] == 0:
        raise ValueError(f"{loss_name} got an empty batch")


def check_similarity(sim: torch.Tensor, labels: torch.Tensor) -> None:
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"sim must be a square matrix, got shape {tuple(sim.shape)}")
    check_labels(labels, sim.shape[0])


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
