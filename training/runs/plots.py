"""PNG plots of a training run: validation Recall@K per epoch, and pair-similarity histograms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from training.runs.evaluate import similarity_bins


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def plot_recall_per_epoch(history: Sequence[Mapping], path: str | Path) -> Path:
    """Validation Recall@K of every epoch (one line per K), the best epoch marked."""
    plt = _pyplot()
    keys = sorted(
        {k for row in history for k in row if k.startswith("val_recall_at_")},
        key=lambda k: int(k.removeprefix("val_recall_at_")),
    )
    if not keys:
        raise ValueError("the history has no validation Recall@K to plot")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    epochs = [row["epoch"] + 1 for row in history]
    for key in keys:
        ax.plot(epochs, [100 * row.get(key, np.nan) for row in history], marker="o", label=f"R@{key[14:]}")
    best = history[-1].get("best_epoch")
    if best is not None and best >= 0:
        ax.axvline(best + 1, color="grey", linestyle=":", label="best (val R@1)")
    ax.set(xlabel="epoch", ylabel="validation Recall@K (%)", title="Validation classes, per epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_similarity_histograms(
    panels: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str | Path, overlaps: Mapping[str, float]
) -> Path:
    """Positive vs negative pair similarities, one panel per model (e.g. untrained, trained)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), dpi=100, squeeze=False)
    for ax, (name, (positive, negative)) in zip(axes[0], panels.items(), strict=True):
        bins = similarity_bins(positive, negative)
        ax.hist(negative, bins=bins, density=True, alpha=0.55, label=f"negative ({len(negative)})")
        ax.hist(positive, bins=bins, density=True, alpha=0.55, label=f"positive ({len(positive)})")
        ax.set(xlabel="cosine similarity", title=f"{name}: overlap {overlaps[name]:.3f}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("density")
    fig.suptitle("Test classes: pair similarities")
    return _save(fig, path)


def plot_loss_and_recall(history: Sequence[Mapping], path: str | Path) -> Path:
    """A text tower's run: its loss per epoch, and text → image Recall@K per epoch of each
    gallery (seen classes solid, unseen dashed), the row before training at epoch 0."""
    plt = _pyplot()
    fig, (loss_ax, recall_ax) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    trained = [row for row in history if "loss" in row]
    loss_ax.plot([row["epoch"] + 1 for row in trained], [row["loss"] for row in trained], marker="o")
    loss_ax.set(xlabel="epoch", ylabel="InfoNCE loss", title="Training loss")
    keys = sorted(
        {k for row in history for k in row if "_recall_at_" in k},
        key=lambda k: (k.split("_")[0] != "seen", int(k.rsplit("_", 1)[1])),
    )
    for key in keys:
        name, k = key.split("_recall_at_")
        ax_style = "-" if name == "seen" else "--"
        recall_ax.plot(
            [row["epoch"] + 1 for row in history], [100 * row.get(key, np.nan) for row in history],
            ax_style, marker="o", label=f"{name} R@{k}",
        )  # fmt: skip
    recall_ax.set(xlabel="epoch", ylabel="text → image Recall@K (%)", title="Captions → held-out images")
    for ax in (loss_ax, recall_ax):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    recall_ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def plot_bars(
    names: list[str],
    series: dict[str, list[tuple[float, float]]],
    path: str | Path,
    title: str,
    reference: tuple[str, float] | None = None,
) -> Path:
    """Grouped bars (mean with ± std error bars) per name, one group member per series, in %."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4), dpi=100)
    width = 0.8 / max(1, len(series))
    positions = np.arange(len(names))
    for i, (label, values) in enumerate(series.items()):
        means = [100 * m for m, _ in values]
        stds = [100 * s for _, s in values]
        ax.bar(positions + i * width, means, width, yerr=stds, capsize=3, label=label)
    if reference is not None:
        ax.axhline(100 * reference[1], color="grey", linestyle=":", label=reference[0])
    ax.set_xticks(positions + width * (len(series) - 1) / 2, names, rotation=30, ha="right")
    ax.set(ylabel="%", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
