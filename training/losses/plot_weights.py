"""Draw how each pair-based loss weights positive and negative pairs against their similarity.

The picture is the unified view's Figure 1 for every registered pair-based loss: in a fixed
context batch, one positive pair (and, separately, one negative pair) of anchor 0 is swept over
``s ∈ [-1, 1]`` while every other similarity stays put, and ``pair_weights`` gives the weight
the loss assigns to the swept pair. Losses with relative weighting or mining (lifted
structure, multi-similarity, triplet, ...) depend on that context, which is why it is fixed:
3 classes of 4 samples, within-class similarities in [0.4, 0.7], across-class in [0.0, 0.4].

    python -m training.losses.plot_weights weights.png [--losses contrastive,triplet]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from .registry import build_loss
from .weights import pair_based_losses, pair_weights

__all__ = ["context_batch", "plot_pair_weights", "weight_curve"]

_POSITIVE, _NEGATIVE = 1, 4  # anchor 0's swept partners: same class, other class


def context_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed (similarity matrix, labels) every curve is drawn in (float64, symmetric)."""
    labels = torch.arange(3).repeat_interleave(4)
    g = torch.Generator().manual_seed(0)
    jitter = torch.rand(12, 12, generator=g, dtype=torch.float64)
    jitter = (jitter + jitter.t()) / 2
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    sim = torch.where(same, 0.4 + 0.3 * jitter, 0.4 * jitter)
    sim.fill_diagonal_(1.0)
    return sim, labels


def weight_curve(name: str, grid: torch.Tensor, positive: bool, **options: object) -> torch.Tensor:
    """Weight of anchor 0's swept positive (or negative) pair at each similarity in ``grid``."""
    loss = build_loss(name, **options)
    sim, labels = context_batch()
    j = _POSITIVE if positive else _NEGATIVE
    out = torch.empty(len(grid), dtype=torch.float64)
    for k, s in enumerate(grid.tolist()):
        swept = sim.clone()
        swept[0, j] = swept[j, 0] = s
        view = pair_weights(loss, swept, labels)
        out[k] = (view.positive if positive else view.negative)[0, j]
    return out


def plot_pair_weights(path: str | Path, names: Sequence[str] | None = None, points: int = 201) -> Path:
    """Write a PNG with one panel per loss (default: every pair-based loss) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(names) if names is not None else pair_based_losses()
    if not names:
        raise ValueError("no losses to plot")
    grid = torch.linspace(-1.0, 1.0, points, dtype=torch.float64)
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        ax.plot(grid, weight_curve(name, grid, positive=True), "g-", label="positive")
        ax.plot(grid, weight_curve(name, grid, positive=False), "b--", label="negative")
        ax.set_title(name)
        ax.set_xlabel("cosine similarity")
        ax.set_ylabel("weight")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(loc="best", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="PNG path")
    parser.add_argument("--losses", help="comma-separated loss names (default: every pair-based loss)")
    args = parser.parse_args(argv)
    names = args.losses.split(",") if args.losses else None
    print(plot_pair_weights(args.out, names))


if __name__ == "__main__":
    main()
