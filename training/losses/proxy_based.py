"""Classification (proxy) losses, thesis "Metric Learning: A Deep Dive" section 2.3.2.

Each loss holds learnable per-class vectors in ``proxies`` (``requires_num_classes``) and works
on cosine similarities: embeddings and proxies are both L2-normalised, so the losses are
invariant to embedding norms and ``w^T x`` in the thesis's formulas is ``cos θ``.

Reduction: each loss computes one term per sample (``base.ProxyBasedLoss``) and its reducer
turns them into the scalar. Eq. 2.27, 2.29 and 2.30 sum over the batch, so ProxyNCA, ArcFace and
SoftTriple default to ``reduction="sum"`` (``SumReducer``); Eq. 2.26 is per sample and
normalized softmax defaults to the mean (``MeanReducer``). pytorch-metric-learning averages all
four.

Where the thesis and pytorch-metric-learning disagree (the tests pin the thesis):

* ProxyNCA (Eq. 2.27-2.28): the denominator runs over the *other* classes' proxies only, which
  is what makes ``∂L/∂(w_y^T x) = -1`` (Eq. 2.28); the library's ``ProxyNCALoss`` is a softmax
  over all proxies on ``-||x̂ - ŵ||²`` (``exclude_positive=False, scale=2·softmax_scale`` here
  reproduces it).
* ArcFace (Eq. 2.29): the target logit is ``cos(θ_y + λ)`` for every angle; the library swaps
  in ``cos θ - λ sin λ`` when ``θ_y > π - λ`` to keep it monotonic.
* SoftTriple: Table 4's ``tau`` regulariser is not in the library's version (compare with
  ``tau=0``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._common import check_finite, check_positive, masked_logsumexp
from .base import ElementLosses, ProxyBasedLoss
from .reducers import BaseReducer
from .registry import LOSSES

__all__ = ["ArcFaceLoss", "NormalizedSoftmaxLoss", "ProxyNCALoss", "SoftTripleLoss"]

# acos has an infinite derivative at ±1: an embedding exactly on (or opposite to) its proxy
# would get an inf gradient. Clamping the cosine to 1e-7 inside that keeps it finite.
_ACOS_EPS = 1e-7


def _target_mask(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(labels, num_classes).bool()


@LOSSES.register("normalized_softmax")
class NormalizedSoftmaxLoss(ProxyBasedLoss):
    """Softmax cross-entropy (thesis Eq. 2.25-2.26) on normalised embeddings and class weights.

    ``-log softmax(cos(x_i, w_j) / T)_{y_i}``: Eq. 2.26 with ``w`` and ``x`` L2-normalised and
    scaled, i.e. ArcFace's Eq. 2.29 with no margin (Zhai & Wu's "normalized softmax").

    Args:
        num_classes: number of training classes; labels in ``[0, num_classes)``.
        embedding_dim: width of the embeddings.
        temperature: T (the texts give no value; 0.05 is Zhai & Wu's and the library's).
        reduction: "mean" over the batch (default) or "sum".
    """

    def __init__(
        self, num_classes: int, embedding_dim: int, temperature: float = 0.05, reduction: str | BaseReducer = "mean"
    ) -> None:
        super().__init__(num_classes, embedding_dim, reduction=reduction)
        check_positive(temperature=temperature)
        self.temperature = float(temperature)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "temperature": self.temperature,
            "reduction": self.reduction,
        }

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        """One term per sample on (m, C) cosines to the class weights."""
        return {"loss": ElementLosses(F.cross_entropy(cos / self.temperature, labels, reduction="none"))}


@LOSSES.register("proxy_nca")
class ProxyNCALoss(ProxyBasedLoss):
    """ProxyNCA, thesis Eq. 2.27::

        L = Σ_i -log( e^{s·cos(x_i, w_{y_i})} / Σ_{j≠y_i} e^{s·cos(x_i, w_j)} )

    Unbounded below (the positive proxy is not in the denominator); its gradient with respect
    to the positive logit is the constant -1 of Eq. 2.28.

    Args:
        num_classes: number of training classes (>= 2 unless ``exclude_positive=False``).
        embedding_dim: width of the embeddings.
        scale: s, multiplying the cosines (Eq. 2.27 has none: 1).
        exclude_positive: Eq. 2.27's denominator; ``False`` gives a softmax over all proxies.
        reduction: "sum" over the batch (default, as Eq. 2.27) or "mean".

    Table 4 trains the proxies at lr 1e-5 (an optimiser setting, not an option here).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        scale: float = 1.0,
        exclude_positive: bool = True,
        reduction: str | BaseReducer = "sum",
    ) -> None:
        super().__init__(num_classes, embedding_dim, reduction=reduction)
        check_positive(scale=scale)
        if exclude_positive and num_classes < 2:
            raise ValueError("ProxyNCA with exclude_positive=True needs num_classes >= 2")
        self.scale = float(scale)
        self.exclude_positive = bool(exclude_positive)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "scale": self.scale,
            "exclude_positive": self.exclude_positive,
            "reduction": self.reduction,
        }

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        """One term per sample on (m, C) cosines to the proxies."""
        logits = self.scale * cos
        target = _target_mask(labels, self.num_classes)
        keep = ~target if self.exclude_positive else torch.ones_like(target)
        denominator, _ = masked_logsumexp(logits, keep, dim=1)
        return {"loss": ElementLosses(denominator - logits[target])}


@LOSSES.register("arcface")
class ArcFaceLoss(ProxyBasedLoss):
    """ArcFace, thesis Eq. 2.29::

        L = Σ_i -log( e^{s cos(θ_{y_i} + λ)} / (e^{s cos(θ_{y_i} + λ)} + Σ_{j≠y_i} e^{s cos θ_j}) )

    Args:
        num_classes: number of training classes.
        embedding_dim: width of the embeddings.
        margin: λ in degrees (Table 4: 28.6°, i.e. the ArcFace paper's 0.5 rad).
        scale: s (Table 4: 64).
        reduction: "sum" over the batch (default, as Eq. 2.29) or "mean".

    Table 4 trains the class weights at lr 1e-4.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        margin: float = 28.6,
        scale: float = 64.0,
        reduction: str | BaseReducer = "sum",
    ) -> None:
        super().__init__(num_classes, embedding_dim, reduction=reduction)
        check_finite(margin=margin)
        check_positive(scale=scale)
        self.margin = float(margin)
        self.scale = float(scale)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "margin": self.margin,
            "scale": self.scale,
            "reduction": self.reduction,
        }

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        """One term per sample on (m, C) cosines to the class weights."""
        index = labels.unsqueeze(1)
        target_cos = cos.gather(1, index).clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS)
        target_logit = torch.cos(torch.acos(target_cos) + math.radians(self.margin))
        logits = self.scale * cos.scatter(1, index, target_logit)
        return {"loss": ElementLosses(F.cross_entropy(logits, labels, reduction="none"))}


@LOSSES.register("soft_triple")
class SoftTripleLoss(ProxyBasedLoss):
    """SoftTriple, thesis Eq. 2.30, with K centres per class::

        L = Σ_i -log( e^{α(S'_{i,y_i} - λ)} / (e^{α(S'_{i,y_i} - λ)} + Σ_{j≠y_i} e^{α S'_{i,j}}) )  +  τ R

    ``S'_{i,c} = Σ_k softmax_k(γ cos(x_i, w_c^k)) cos(x_i, w_c^k)`` is the relaxed similarity to
    class c (the thesis's ``w_c^T x`` with several proxies per class). ``R`` is the SoftTriple
    paper's centre-merging regulariser (the thesis names it, via the L2,1 norm, without a
    formula; this is the authors' code): ``Σ_c Σ_{t<k} sqrt(2 + 1e-5 - 2 cos(w_c^t, w_c^k))``
    divided by ``C·K·(K-1)``.

    Args:
        num_classes: number of training classes.
        embedding_dim: width of the embeddings.
        centers_per_class: K (not in the texts; the SoftTriple paper's 10).
        scale: α (Table 4: 20).
        gamma: γ, multiplying the cosines inside the softmax over centres (Table 4: 10; the
            library's ``gamma=0.1`` is its reciprocal).
        margin: λ (Table 4: 0.1).
        tau: τ, regulariser weight (Table 4: 0.2).
        reduction: "sum" over the batch (default, as Eq. 2.30) or "mean"; ``τ R`` is added once.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        centers_per_class: int = 10,
        scale: float = 20.0,
        gamma: float = 10.0,
        margin: float = 0.1,
        tau: float = 0.2,
        reduction: str | BaseReducer = "sum",
    ) -> None:
        super().__init__(num_classes, embedding_dim, proxies_per_class=centers_per_class, reduction=reduction)
        check_positive(scale=scale, gamma=gamma)
        check_finite(margin=margin, tau=tau)
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau!r}")
        self.centers_per_class = centers_per_class
        self.scale = float(scale)
        self.gamma = float(gamma)
        self.margin = float(margin)
        self.tau = float(tau)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "num_classes": self.num_classes,
            "embedding_dim": self.embedding_dim,
            "centers_per_class": self.centers_per_class,
            "scale": self.scale,
            "gamma": self.gamma,
            "margin": self.margin,
            "tau": self.tau,
            "reduction": self.reduction,
        }

    def relaxed_similarity(self, cos: torch.Tensor) -> torch.Tensor:
        """(m, C·K) cosines to the centres → (m, C) relaxed class similarities ``S'``."""
        per_class = cos.view(cos.shape[0], self.num_classes, self.centers_per_class)
        return (F.softmax(self.gamma * per_class, dim=2) * per_class).sum(dim=2)

    def regularizer(self) -> torch.Tensor:
        """``R``: mean distance between the centres of each class over pairs ``t < k``."""
        k = self.centers_per_class
        centers = F.normalize(self.proxies, dim=1).view(self.num_classes, k, -1)
        cos = centers @ centers.transpose(1, 2)
        upper = torch.triu(torch.ones(k, k, dtype=torch.bool, device=cos.device), diagonal=1)
        return torch.sqrt(2.0 + 1e-5 - 2.0 * cos[:, upper]).sum() / (self.num_classes * k * (k - 1))

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        """The classification term per sample on (m, C·K) cosines to the centres (without ``τ R``)."""
        sim = self.relaxed_similarity(cos)
        logits = self.scale * (sim - self.margin * _target_mask(labels, self.num_classes).to(sim.dtype))
        return {"loss": ElementLosses(F.cross_entropy(logits, labels, reduction="none"))}

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(embeddings, labels)
        if self.tau > 0 and self.centers_per_class > 1:
            loss = loss + self.tau * self.regularizer().to(loss.dtype)
        return loss
