"""Image-text contrastive loss (InfoNCE, CLIP's symmetric form) with a learned temperature.

For a batch of N (text, image) pairs, row i of each the same thing described and shown::

    logits = exp(t) · T Iᵀ            (T, I: L2-normalised text and image embeddings)
    L = ½ [CE(logits, diag) + CE(logitsᵀ, diag)]

Every other pair of the batch is a negative, so a batch must not hold two pairs of one caption
(`training/text/train_text.py` samples distinct captions). `t` is the log of the inverse
temperature, learned as CLIP learns it (initialised at 1/0.07, clamped at 100 so the logits
cannot grow without bound — CLIP's own cap).

Not in the `LOSSES` registry: those are metric losses of one tower's `(embeddings, labels)`,
every one of which `training benchmark` and the loss tests run; this loss compares two towers'
embeddings of paired rows and takes no labels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_positive

__all__ = ["ImageTextContrastiveLoss"]

MAX_LOGIT_SCALE = 100.0


class ImageTextContrastiveLoss(nn.Module):
    """Symmetric InfoNCE between paired rows of text and image embeddings.

    Args:
        temperature: the starting temperature (> 0); its log-inverse is the `logit_scale`
            parameter the optimiser learns.
    """

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        check_positive(temperature=temperature)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale().item()

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        if text.shape != image.shape or text.ndim != 2:
            raise ValueError(
                f"text and image embeddings must be paired (N, D) rows, got {text.shape} and {image.shape}"
            )
        logits = self.scale() * F.normalize(text, dim=-1) @ F.normalize(image, dim=-1).T
        target = torch.arange(len(text), device=text.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
