"""Histogram loss (Ustinova & Lempitsky) against pytorch-metric-learning and Eq. 1-5."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

# pytorch-metric-learning is a dev dependency (setup installs it): a missing library fails, never skips.
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity

from tests.training.losses.helpers import EXACT, F64, PAIR_CASES, assert_close, sim_list, value_and_grads
from training.losses.histogram import HistogramLoss, histogram_overlap, similarity_histogram


def histogram_reference(values: list[float], nodes: int) -> list[float]:
    """Eq. 3 with half-open intervals [t_r, t_{r+1}) (the last one closed)."""
    step = 2.0 / (nodes - 1)
    t = [-1.0 + r * step for r in range(nodes)]
    h = [0.0] * nodes
    for v in values:
        for r in range(nodes - 1):
            if t[r] <= v < t[r + 1] or (r == nodes - 2 and v >= t[r + 1]):
                h[r] += (t[r + 1] - v) / step
                h[r + 1] += (v - t[r]) / step
                break
    return [hr / len(values) for hr in h]


def histogram_loss_reference(s: list[list[float]], y: list[int], nodes: int) -> float:
    pos = [s[i][j] for i in range(len(y)) for j in range(i + 1, len(y)) if y[i] == y[j]]
    neg = [s[i][j] for i in range(len(y)) for j in range(i + 1, len(y)) if y[i] != y[j]]
    if not pos or not neg:
        return 0.0
    h_pos, h_neg = histogram_reference(pos, nodes), histogram_reference(neg, nodes)
    return sum(h_neg[r] * sum(h_pos[: r + 1]) for r in range(nodes))  # Eq. 2


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
@pytest.mark.parametrize("bins", [201, 21])
def test_histogram_matches_eq_1_5(name: str, bins: int) -> None:
    x, y = PAIR_CASES[name]
    expected = histogram_loss_reference(sim_list(x), y.tolist(), bins)
    assert HistogramLoss(bins=bins)(x, y).item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


PML_INDEXING_WARNING = "ignore:Using a non-tuple sequence for multidimensional indexing"


@pytest.mark.filterwarnings(PML_INDEXING_WARNING)
@pytest.mark.parametrize("name", ["pk_4x4", "wide_spread", "random_labels"])
@pytest.mark.parametrize("step", [0.01, 0.1])
def test_histogram_matches_pml(name: str, step: float) -> None:
    x, y = PAIR_CASES[name]
    if name == "random_labels":  # pml builds pairs from triplets: drop singleton classes
        keep = torch.isin(y, torch.unique(y)[torch.bincount(y)[torch.unique(y)] > 1])
        x, y = x[keep], y[keep]
    ours = HistogramLoss(step=step)
    ref = pml_losses.HistogramLoss(n_bins=round(2 / step), distance=CosineSimilarity())
    v, (g,) = value_and_grads(lambda e: ours(e, y), x)
    with float64_default():
        v_ref, (g_ref,) = value_and_grads(lambda e: ref(e, y), x)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    """pml computes its histogram nodes as ``long_tensor * delta``, which lands in the default
    dtype: float32 unless changed, i.e. ~1e-7 relative error on float64 inputs."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.filterwarnings(PML_INDEXING_WARNING)
def test_histogram_keeps_negative_pairs_between_singletons_unlike_pml() -> None:
    x, y = PAIR_CASES["uneven_unsorted"]  # classes 1000 and 9 are singletons
    ours = HistogramLoss(step=0.1)(x, y).item()
    assert ours == pytest.approx(histogram_loss_reference(sim_list(x), y.tolist(), 21), rel=1e-9)
    with float64_default():
        ref = pml_losses.HistogramLoss(n_bins=20, distance=CosineSimilarity())(x, y).item()
    assert ours != pytest.approx(ref, rel=1e-6)


def test_histogram_gradient_is_eq_4_5() -> None:
    """∂L/∂h⁻_r = Σ_{q≤r} h⁺_q and ∂L/∂h⁺_r = Σ_{q≥r} h⁻_q (Eq. 4 with its superscripts in
    the order Eq. 2 implies), and Eq. 5: ∂h_r/∂s = ±1/(Δ|S|) inside the two adjacent bins."""
    g = torch.Generator().manual_seed(0)
    pos = (torch.rand(9, generator=g, dtype=F64) * 2 - 1).requires_grad_(True)
    neg = (torch.rand(13, generator=g, dtype=F64) * 2 - 1).requires_grad_(True)
    nodes = 11
    h_pos = similarity_histogram(pos, nodes)
    h_neg = similarity_histogram(neg, nodes)
    hp, hn = h_pos.detach().requires_grad_(True), h_neg.detach().requires_grad_(True)
    d_hp, d_hn = torch.autograd.grad(histogram_overlap(hp, hn), (hp, hn))
    torch.testing.assert_close(d_hn, torch.cumsum(h_pos.detach(), 0), **EXACT)
    torch.testing.assert_close(d_hp, torch.flip(torch.cumsum(torch.flip(h_neg.detach(), [0]), 0), [0]), **EXACT)
    # Eq. 5 composed with Eq. 4: a positive s in [t_r, t_{r+1}) gets (∂L/∂h_{r+1} - ∂L/∂h_r)/(Δ|S+|).
    (g_pos,) = torch.autograd.grad(histogram_overlap(h_pos, h_neg), pos)
    step = 2.0 / (nodes - 1)
    r = torch.floor((pos.detach() + 1) / step).long()
    expected = (d_hp[r + 1] - d_hp[r]) / (step * len(pos))
    torch.testing.assert_close(g_pos, expected, **EXACT)


def test_histogram_options_and_edges() -> None:
    assert HistogramLoss().nodes == 201 and HistogramLoss(bins=21).step == pytest.approx(0.1)
    assert HistogramLoss(step=0.1).nodes == 21
    with pytest.raises(ValueError, match="whole number"):
        HistogramLoss(step=0.3)
    with pytest.raises(ValueError, match="bins"):
        HistogramLoss(bins=1)
    # s exactly on a node counts once, fully in that node; s = ±1 sits on the end nodes.
    h = similarity_histogram(torch.tensor([-1.0, 0.0, 1.0], dtype=F64), 5)
    torch.testing.assert_close(h, torch.tensor([1, 0, 1, 0, 1], dtype=F64) / 3)
