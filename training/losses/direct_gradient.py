"""Directly designed gradients ("Dissecting the impact of different loss functions with gradient surgery").

The method has no loss function: for every mined triplet (a, p, n) it *sets* the gradient with
respect to the L2-normalised features ``f`` (section 3, Eq. 2) to

    ∂L/∂f = T · P · e       (triplet weight × pair weight × unit direction)

and lets back-propagation carry it into the network. ``DirectGradientLoss`` does this with a
``torch.autograd.Function`` (section 4, "PyTorch Implementation") whose ``backward`` returns
exactly that gradient. With ``S`` the cosine similarity and ``D = ||f_a - f_x||``:

Direction ``e`` (section 3.2), for the positive, the negative and the anchor:

* ``"euc"`` (Eq. 5): ``e_p = (f_p - f_a)/D_ap``, ``e_n = (f_a - f_n)/D_an``; the anchor gets
  ``-P₊ e_p - P₋ e_n``. Positive pulled straight towards the anchor, negative pushed straight
  away.
* ``"cos"`` (Eq. 6): ``e_p = -f_a``, ``e_n = f_a``; the anchor gets ``P₊(-f_p) + P₋ f_n``: each
  feature moves along its partner's direction.
* ``"euc-orth"`` / ``"cos-orth"`` (Eq. 7): as above, but the negative pair's directions (the
  negative's and the anchor's negative component) are projected orthogonally to
  ``f_a - f_p`` and re-normalised, so the negative pair never moves along the positive pair's
  direction (``e_n · (f_a - f_p) = 0``). If ``f_a = f_p`` there is nothing to be orthogonal to
  and the direction is left unchanged; a direction that projects to 0 stays 0.

Pair weight ``P₊`` (anchor-positive) and ``P₋`` (anchor-negative) (section 3.3):

* ``"con"`` (Eq. 8): 1 and 1.
* ``"euc"`` (Eq. 9): ``D_ap`` and ``D_an``.
* ``"lin"`` (Eq. 10, Circle loss): ``1 - S_ap`` and ``S_an`` (no clipping: a negative ``S_an``
  turns the push into a pull, as the formula says).
* ``"sig"`` (Eq. 11, binomial deviance): ``1/(1 + e^{α(S_ap - λ)})`` and ``1/(1 + e^{-β(S_an - λ)})``.
* ``"sig-ms"`` (Eq. 12-13, multi-similarity): the sigmoid with the relative term
  ``m₊ = mean_{i∈𝒫} e^{α(S_ap - R^i_ap)}`` (resp. ``m₋ = mean_{j∈𝒩} e^{-β(S_an - R^j_an)}``) in
  place of the 1, where ``R^i_ap`` are the anchor's other positives kept by
  ``R < max(S_an, R_an) + ε`` and ``R^j_an`` its other negatives kept by ``R > min(S_ap, R_ap) - ε``.
* ``"lin-ms"`` (Eq. 14): ``(1 - m₊)(1 - S_ap)`` and ``(1 + m₋) S_an`` with the linear relative
  terms ``m₊ = mean_{𝒫}(S_ap - R^i_ap)``, ``m₋ = mean_{𝒩}(S_an - R^j_an)``.

  An empty 𝒫 or 𝒩 means no relative information, i.e. every ``ΔS = 0`` (appendix 2): ``m = 1``
  for the sigmoid form and ``m = 0`` for the linear form, which reduce to Eq. 11 and Eq. 10.

Triplet weight ``T`` (section 3.4):

* ``"con"`` (Eq. 15): 0.5.
* ``"cos"`` (Eq. 16): ``1/(1 + e^{τ(S_ap - S_an)})``.
* ``"cir"`` (Eq. 17, Circle loss): ``1/(1 + e^{τ(S_ap(2 - S_ap) - S_an²)})``.

Selective-contrastive operators on ``P₊`` (Eq. 18-19), combined with a triplet weight:

* ``"sc1"``: ``P₊ = 0`` if ``S_an > S_ap`` (hard negative: only push the negative).
* ``"sc2"``: ``P₊ = 0`` if ``S_ap(2 - S_ap) - S_an² < 0.5``, i.e. outside the circle
  ``(S_ap - 1)² + S_an² = 0.5`` around the easy corner. Eq. 19 as printed says "> 0.5", which
  would mask the *easy* triplets, contradicting its own text (corner cases selected to only
  separate the negative pair), Figure 3 (the positive pair keeps its weight below the boundary)
  and ``sc1``; the text's reading is implemented.

Presets (``PRESETS``) give Table 1's rows and section 6's best combination, the default:
``e^{cos-orth}``, ``P^{lin-ms}``, ``T^{cir}``.

Other choices the paper leaves open:

* Triplets come from easy-positive/hard-negative mining (section 4: the most similar positive
  and the most similar negative of each anchor), ``miner="ephn"``; any triplet miner of
  ``mining.py`` works, and triplets passed to ``forward`` (``indices_tuple``) replace it.
* The relative terms' kept pairs (Eq. 12) are VTHM's (``mining.VthmMiner`` with ε), minus the
  triplet's own positive and negative.
* The batch gradient is the mean over triplets (``MeanReducer``; the paper does not say; the
  scale only rescales the learning rate). No triplet, no gradient: the value is 0 and backward
  gives 0.
* Constants that only rescale a whole gradient are dropped (Eq. 5's factor 2, Eq. 6's τ), so
  ``(euc, euc, con)`` is ¼ of Eq. 3's gradient and ``(cos, con, cos)`` is ``1/τ`` of Eq. 4's.
* Hyper-parameters: α=2, β=10, λ=0.5, ε=0.1 (appendix 4); τ=1, the only value the paper gives
  (Figure 3).
* The forward value is the weight-view surrogate ``mean_t T (P₋ S_an - P₊ S_ap)`` with the weights
  held constant (the unified view's Eq. 2), for logging only: backward never differentiates
  it. For the cosine direction its gradient is the designed one; for the others it is not.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._common import check_batch, check_positive, distance_from_similarity, normalized_embeddings
from .base import ElementLosses, PairBasedLoss
from .mining import TRIPLET_MINERS, TripletMiner, Triplets, VthmMiner, build_triplet_miner
from .reducers import MeanReducer
from .registry import LOSSES
from .similarity import cosine_similarity_matrix

__all__ = [
    "DIRECTIONS",
    "PAIR_WEIGHTS",
    "PRESETS",
    "SELECTIVE",
    "TRIPLET_WEIGHTS",
    "DesignedGradient",
    "DirectGradientConfig",
    "DirectGradientLoss",
    "TripletWeights",
    "designed_gradient",
    "direct_gradient",
    "triplet_weights",
]

DIRECTIONS = ("euc", "cos", "euc-orth", "cos-orth")
PAIR_WEIGHTS = ("con", "euc", "lin", "sig", "sig-ms", "lin-ms")
TRIPLET_WEIGHTS = ("con", "cos", "cir")
SELECTIVE = ("none", "sc1", "sc2")

# (direction, pair weight, triplet weight, selective operator): Table 1 and section 6.
PRESETS: dict[str, tuple[str, str, str, str]] = {
    "triplet_euclidean": ("euc", "euc", "con", "none"),
    "triplet_cosine": ("cos", "con", "cos", "none"),
    "circle": ("cos", "lin", "cir", "none"),
    "binomial_deviance": ("cos", "sig", "con", "none"),
    "multi_similarity": ("cos", "sig-ms", "con", "none"),
    "dr_ms": ("cos-orth", "sig-ms", "con", "none"),
    "selectively_contrastive": ("cos", "con", "cos", "sc1"),
    "best": ("cos-orth", "lin-ms", "cir", "none"),
}

_TINY = 1e-12


@dataclass(frozen=True)
class DirectGradientConfig:
    """The resolved components and hyper-parameters (see the module docstring)."""

    direction: str = "cos-orth"
    pair_weight: str = "lin-ms"
    triplet_weight: str = "cir"
    selective: str = "none"
    tau: float = 1.0
    alpha: float = 2.0
    beta: float = 10.0
    lam: float = 0.5
    epsilon: float = 0.1
    miner: str = "ephn"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("direction", self.direction, DIRECTIONS),
            ("pair_weight", self.pair_weight, PAIR_WEIGHTS),
            ("triplet_weight", self.triplet_weight, TRIPLET_WEIGHTS),
            ("selective", self.selective, SELECTIVE),
            ("miner", self.miner, tuple(TRIPLET_MINERS.names())),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        check_positive(tau=self.tau, alpha=self.alpha, beta=self.beta)
        for name in ("lam", "epsilon"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")


class TripletWeights(NamedTuple):
    """Mined triplets and, per triplet, ``P₊`` (after any selective operator), ``P₋`` and ``T``."""

    triplets: Triplets
    pair_pos: torch.Tensor
    pair_neg: torch.Tensor
    triplet: torch.Tensor


class DesignedGradient(NamedTuple):
    """The surrogate value, the designed ∂L/∂f (m×d) and the weights it was built from."""

    value: torch.Tensor
    grad: torch.Tensor
    weights: TripletWeights


def _relative_terms(
    sim: torch.Tensor, labels: torch.Tensor, t: Triplets, cfg: DirectGradientConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``m₊`` and ``m₋`` of Eq. 13 (sigmoid form) or Eq. 14 (linear form), one per triplet."""
    kept = VthmMiner(cfg.epsilon).mine(sim, labels)  # Eq. 12's rule is VTHM's
    rows = sim[t.anchor]  # (T, m): the anchor's similarity to everything
    s_ap, s_an = sim[t.anchor, t.positive].unsqueeze(1), sim[t.anchor, t.negative].unsqueeze(1)
    arange = torch.arange(len(t.anchor), device=sim.device)
    keep_pos = kept.positive[t.anchor].clone()
    keep_pos[arange, t.positive] = False
    keep_neg = kept.negative[t.anchor].clone()
    keep_neg[arange, t.negative] = False
    n_pos, n_neg = keep_pos.sum(dim=1), keep_neg.sum(dim=1)
    if cfg.pair_weight == "sig-ms":
        # torch.where rather than a product: exp of a dropped pair may overflow to inf.
        terms_pos = torch.where(keep_pos, torch.exp(cfg.alpha * (s_ap - rows)), 0.0).sum(dim=1)
        terms_neg = torch.where(keep_neg, torch.exp(-cfg.beta * (s_an - rows)), 0.0).sum(dim=1)
        empty = 1.0
    else:
        terms_pos = torch.where(keep_pos, s_ap - rows, 0.0).sum(dim=1)
        terms_neg = torch.where(keep_neg, s_an - rows, 0.0).sum(dim=1)
        empty = 0.0
    m_pos = torch.where(n_pos > 0, terms_pos / n_pos.clamp_min(1), empty)
    m_neg = torch.where(n_neg > 0, terms_neg / n_neg.clamp_min(1), empty)
    return m_pos, m_neg


@torch.no_grad()
def triplet_weights(
    sim: torch.Tensor, labels: torch.Tensor, cfg: DirectGradientConfig, indices: Triplets | TripletMiner | None = None
) -> TripletWeights:
    """Pair and triplet weights (no gradient) of the triplets ``indices``, or of those a miner
    finds on ``sim`` (``indices`` itself, by default ``cfg.miner``)."""
    sim = sim.detach()
    t = indices if isinstance(indices, Triplets) else (indices or build_triplet_miner(cfg.miner)).mine(sim, labels)
    s_ap, s_an = sim[t.anchor, t.positive], sim[t.anchor, t.negative]
    if cfg.pair_weight == "con":
        p_pos, p_neg = torch.ones_like(s_ap), torch.ones_like(s_an)
    elif cfg.pair_weight == "euc":
        dist = distance_from_similarity(sim)
        p_pos, p_neg = dist[t.anchor, t.positive], dist[t.anchor, t.negative]
    elif cfg.pair_weight == "lin":
        p_pos, p_neg = 1.0 - s_ap, s_an
    elif cfg.pair_weight == "sig":
        p_pos = torch.sigmoid(-cfg.alpha * (s_ap - cfg.lam))
        p_neg = torch.sigmoid(cfg.beta * (s_an - cfg.lam))
    else:
        m_pos, m_neg = _relative_terms(sim, labels, t, cfg)
        if cfg.pair_weight == "sig-ms":
            p_pos = 1.0 / (m_pos + torch.exp(cfg.alpha * (s_ap - cfg.lam)))
            p_neg = 1.0 / (m_neg + torch.exp(-cfg.beta * (s_an - cfg.lam)))
        else:
            p_pos = (1.0 - m_pos) * (1.0 - s_ap)
            p_neg = (1.0 + m_neg) * s_an
    if cfg.triplet_weight == "con":
        tw = torch.full_like(s_ap, 0.5)
    elif cfg.triplet_weight == "cos":
        tw = torch.sigmoid(-cfg.tau * (s_ap - s_an))
    else:
        tw = torch.sigmoid(-cfg.tau * (s_ap * (2.0 - s_ap) - s_an * s_an))
    if cfg.selective == "sc1":
        p_pos = torch.where(s_an > s_ap, 0.0, p_pos)
    elif cfg.selective == "sc2":
        p_pos = torch.where(s_ap * (2.0 - s_ap) - s_an * s_an < 0.5, 0.0, p_pos)
    return TripletWeights(t, p_pos, p_neg, tw)


def _unit(v: torch.Tensor) -> torch.Tensor:
    norm = v.norm(dim=1, keepdim=True)
    return torch.where(norm > _TINY, v / norm.clamp_min(_TINY), 0.0)


def _orthogonal(v: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Unit(v minus its component along the unit ``axis``); ``v`` unchanged where axis is 0."""
    has_axis = axis.norm(dim=1, keepdim=True) > 0
    projected = _unit(v - (v * axis).sum(dim=1, keepdim=True) * axis)
    return torch.where(has_axis, projected, v)


def _surrogate_terms(sim: torch.Tensor, w: TripletWeights) -> torch.Tensor:
    """Per triplet, ``T (P₋ S_an - P₊ S_ap)`` with the weights held constant."""
    t = w.triplets
    return w.triplet * (w.pair_neg * sim[t.anchor, t.negative] - w.pair_pos * sim[t.anchor, t.positive])


@torch.no_grad()
def designed_gradient(
    f: torch.Tensor, labels: torch.Tensor, cfg: DirectGradientConfig, indices: Triplets | TripletMiner | None = None
) -> DesignedGradient:
    """The designed ``∂L/∂f`` for unit-norm features ``f`` (m×d), and the surrogate value
    (``indices`` as in ``triplet_weights``)."""
    f = f.detach()
    sim = cosine_similarity_matrix(f)
    w = triplet_weights(sim, labels, cfg, indices)
    a, p, n = w.triplets
    fa, fp, fn = f[a], f[p], f[n]
    if cfg.direction.startswith("cos"):
        g_pos, g_neg, g_anchor_pos, g_anchor_neg = -fa, fa, -fp, fn
    else:
        e_p, e_n = _unit(fp - fa), _unit(fa - fn)
        g_pos, g_neg, g_anchor_pos, g_anchor_neg = e_p, e_n, -e_p, -e_n
    if cfg.direction.endswith("orth"):
        axis = _unit(fa - fp)
        g_neg, g_anchor_neg = _orthogonal(g_neg, axis), _orthogonal(g_anchor_neg, axis)
    tp = (w.triplet * w.pair_pos).unsqueeze(1)
    tn = (w.triplet * w.pair_neg).unsqueeze(1)
    grad = torch.zeros_like(f)
    grad.index_add_(0, p, tp * g_pos)
    grad.index_add_(0, n, tn * g_neg)
    grad.index_add_(0, a, tp * g_anchor_pos + tn * g_anchor_neg)
    grad /= max(len(a), 1)
    return DesignedGradient(MeanReducer()(_surrogate_terms(sim, w)), grad, w)


class _DirectGradientFunction(torch.autograd.Function):
    """Forward: the surrogate value. Backward: ``grad_output ×`` the designed gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        f: torch.Tensor,
        labels: torch.Tensor,
        cfg: DirectGradientConfig,
        indices: Triplets | TripletMiner | None,
    ) -> torch.Tensor:
        designed = designed_gradient(f, labels, cfg, indices)
        ctx.save_for_backward(designed.grad)
        return designed.value

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None, None, None


def direct_gradient(
    f: torch.Tensor, labels: torch.Tensor, cfg: DirectGradientConfig, indices: Triplets | TripletMiner | None = None
) -> torch.Tensor:
    """Apply the autograd function to unit-norm features ``f`` (``indices`` as in ``triplet_weights``)."""
    return _DirectGradientFunction.apply(f, labels, cfg, indices)


@LOSSES.register("direct_gradient")
class DirectGradientLoss(PairBasedLoss):
    """Train with a directly designed gradient (see the module docstring for every option).

    Args:
        preset: a row of Table 1 or "best" (section 6), giving the components below; explicit
            components override it. Presets: triplet_euclidean, triplet_cosine, circle,
            binomial_deviance, multi_similarity, dr_ms, selectively_contrastive, best.
        direction: "euc", "cos", "euc-orth" or "cos-orth" (section 3.2).
        pair_weight: "con", "euc", "lin", "sig", "sig-ms" or "lin-ms" (section 3.3).
        triplet_weight: "con", "cos" or "cir" (section 3.4).
        selective: "none", "sc1" or "sc2" (Eq. 18-19), masking the positive pair weight.
        tau: τ of ``T^cos``/``T^cir`` (1, Figure 3).
        alpha, beta, lam, epsilon: α, β, λ, ε of the sigmoid and MS weights (appendix 4: 2, 10,
            0.5, 0.1).
        miner: triplet miner name (section 4: "ephn").
    """

    def __init__(
        self,
        preset: str = "best",
        direction: str | None = None,
        pair_weight: str | None = None,
        triplet_weight: str | None = None,
        selective: str | None = None,
        tau: float = 1.0,
        alpha: float = 2.0,
        beta: float = 10.0,
        lam: float = 0.5,
        epsilon: float = 0.1,
        miner: str = "ephn",
    ) -> None:
        super().__init__("mean", miner=build_triplet_miner(miner))
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        d, p, t, s = PRESETS[preset]
        self.preset = preset
        self.config = DirectGradientConfig(
            direction=direction or d,
            pair_weight=pair_weight or p,
            triplet_weight=triplet_weight or t,
            selective=selective or s,
            tau=float(tau),
            alpha=float(alpha),
            beta=float(beta),
            lam=float(lam),
            epsilon=float(epsilon),
            miner=miner,
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"preset": self.preset, **dataclasses.asdict(self.config)}

    def compute_loss(self, sim: torch.Tensor, labels: torch.Tensor, indices: Triplets) -> dict[str, ElementLosses]:
        """The weight-view surrogate per triplet: its gradient is ``T·P`` per pair.

        The direction component is not a function of the similarities, so this is the pair
        view of every direction (and the exact designed gradient only for ``"cos"``).
        """
        return {"loss": ElementLosses(_surrogate_terms(sim, triplet_weights(sim, labels, self.config, indices)))}

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: Triplets | None = None
    ) -> torch.Tensor:
        check_batch(embeddings, labels, type(self).__name__)
        # The loss's miner runs on the similarities designed_gradient computes anyway.
        indices = self.miner if indices_tuple is None else indices_tuple
        return direct_gradient(normalized_embeddings(embeddings), labels, self.config, indices)
