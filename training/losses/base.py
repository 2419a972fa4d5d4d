"""The base classes of every loss in the registry, in pytorch-metric-learning's shape.

``BaseMetricLoss`` (the library's ``BaseMetricLossFunction``): ``compute_loss`` returns named
sub-losses of per-element terms (``ElementLosses``), the loss's ``reducer`` turns each into a
scalar and the scalars are added (the library's ``sub_loss_names``). Two families:

* ``PairBasedLoss``: a function of the m×m cosine-similarity matrix and of mined indices,
  ``loss(embeddings, labels, indices_tuple=None)``. The indices come from ``indices_tuple``, else
  from the loss's ``miner`` (see ``mining.py``), else every pair. ``loss_from_similarity`` is
  public so the pair-weight view (``weights.py``) can differentiate a loss with respect to the
  similarities themselves.
* ``ProxyBasedLoss``: learnable per-class vectors in ``proxies`` (``requires_num_classes``), a
  function of the (m, rows) cosines between embeddings and proxies.

Both normalise the embeddings, so every loss is invariant to embedding norms, and both
validate their inputs in one place (``_common``).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn

from ._common import check_batch, check_similarity
from .mining import BaseMiner, PairMasks, Triplets, all_pairs
from .reducers import BaseReducer, build_reducer
from .similarity import cosine_similarity_matrix

__all__ = ["BaseMetricLoss", "ElementLosses", "PairBasedLoss", "ProxyBasedLoss"]


class ElementLosses(NamedTuple):
    """Per-element terms of one sub-loss and, optionally, the mask of the elements that count
    (the others must be exactly 0); any shape."""

    losses: torch.Tensor
    valid: torch.Tensor | None = None


class BaseMetricLoss(nn.Module):
    """A loss whose value is ``Σ_sub-losses reducer(per-element terms)``.

    Subclasses implement ``compute_loss`` and ``hyperparameters`` (the resolved options, for run
    manifests; ``build_loss(name, **loss.hyperparameters())`` rebuilds the loss).
    """

    requires_num_classes: ClassVar[bool] = False

    def __init__(self, reduction: str | BaseReducer = "mean") -> None:
        super().__init__()
        self.reducer = build_reducer(reduction)

    @property
    def reduction(self) -> str:
        return self.reducer.name

    def hyperparameters(self) -> dict[str, Any]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())

    def reduce(self, sub_losses: dict[str, ElementLosses]) -> torch.Tensor:
        """Each sub-loss through the reducer, added up."""
        total: torch.Tensor | None = None
        for terms in sub_losses.values():
            value = self.reducer(*terms)
            total = value if total is None else total + value
        if total is None:
            raise ValueError(f"{type(self).__name__}.compute_loss returned no sub-loss")
        return total


class PairBasedLoss(BaseMetricLoss):
    """Base of the pair- and triplet-based losses: a function of the m×m cosine similarities.

    ``compute_loss(sim, labels, indices)`` gets the mined indices (``PairMasks`` or
    ``Triplets``); a loss that reads pairs gets every pair when nothing is mined.
    """

    def __init__(self, reduction: str | BaseReducer = "mean", miner: BaseMiner | None = None) -> None:
        super().__init__(reduction)
        self.miner = miner

    def compute_loss(
        self, sim: torch.Tensor, labels: torch.Tensor, indices: PairMasks | Triplets
    ) -> dict[str, ElementLosses]:
        raise NotImplementedError

    def mine(self, sim: torch.Tensor, labels: torch.Tensor) -> PairMasks | Triplets:
        """The loss's miner on ``sim``, or every pair without one."""
        check_similarity(sim, labels)
        return self._mine(sim, labels)

    @torch.no_grad()
    def _mine(self, sim: torch.Tensor, labels: torch.Tensor) -> PairMasks | Triplets:
        # Inputs already checked: the training step validates a batch once.
        if self.miner is not None:
            return self.miner.mine(sim.detach(), labels)
        return all_pairs(labels, sim.device)

    def element_losses(
        self, sim: torch.Tensor, labels: torch.Tensor, indices_tuple: PairMasks | Triplets | None = None
    ) -> dict[str, ElementLosses]:
        """The per-element terms on a precomputed m×m similarity matrix, before the reducer."""
        check_similarity(sim, labels)
        if sim.shape[0] == 0:
            raise ValueError(f"{type(self).__name__} got an empty batch")
        indices = self._mine(sim, labels) if indices_tuple is None else indices_tuple
        return self.compute_loss(sim, labels, indices)

    def loss_from_similarity(
        self, sim: torch.Tensor, labels: torch.Tensor, indices_tuple: PairMasks | Triplets | None = None
    ) -> torch.Tensor:
        """The loss on a precomputed m×m similarity matrix."""
        return self.reduce(self.element_losses(sim, labels, indices_tuple))

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: PairMasks | Triplets | None = None
    ) -> torch.Tensor:
        check_batch(embeddings, labels, type(self).__name__)
        return self.loss_from_similarity(cosine_similarity_matrix(embeddings), labels, indices_tuple)


class ProxyBasedLoss(BaseMetricLoss):
    """Base of the losses with learnable per-class parameters (``requires_num_classes``).

    ``proxies`` holds ``proxies_per_class`` rows per class, class-major, so the optimiser can
    put them in their own parameter group. Only directions matter (every loss here
    L2-normalises them), so the initialisation is the official Proxy-Anchor code's
    ``kaiming_normal_(mode="fan_out")``: isotropic, i.e. uniformly random directions (the scale
    still interacts with the proxies' larger learning rate under Adam/AdamW).
    """

    requires_num_classes = True

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        proxies_per_class: int = 1,
        reduction: str | BaseReducer = "mean",
    ) -> None:
        super().__init__(reduction)
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

    def compute_loss(self, cos: torch.Tensor, labels: torch.Tensor) -> dict[str, ElementLosses]:
        raise NotImplementedError

    def loss_from_cosines(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss on (m, rows) cosines to the proxies and long labels."""
        return self.reduce(self.compute_loss(cos, labels))

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
