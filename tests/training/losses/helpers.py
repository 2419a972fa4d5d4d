"""Shared helpers and batches of the loss tests.

Library comparisons run in float64 and compare values and gradients (embeddings and, for proxy
losses, proxies) to 1e-5 relative, with the library configured to the same parameters. Where
the papers and the library disagree, brute-force references written from the papers' formulas
(plain loops over pairs/triplets) pin the papers' behaviour; each such test says which rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from training.losses import cosine_similarity_matrix

F64 = torch.float64
RTOL = 1e-5
ATOL = 1e-10  # gradients of pairs/rows that are exactly 0 in one implementation
EXACT = {"rtol": 1e-10, "atol": 1e-12}  # brute-force loops: same math, different summation order


def value_and_grads(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    extra: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    params = [x, *(extra or [])]
    value = fn(x)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return value.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def clustered(
    labels: list[int] | torch.Tensor, seed: int, d: int = 8, spread: float = 0.7, norm_spread: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings around per-class centres, with norms over orders of magnitude (the losses
    normalise internally), so mining keeps some pairs and drops others."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.as_tensor(labels, dtype=torch.long)
    _, idx = torch.unique(labels, return_inverse=True)
    centres = F.normalize(torch.randn(int(idx.max()) + 1, d, generator=g, dtype=F64), dim=1)
    x = centres[idx] + spread / math.sqrt(d) * torch.randn(len(labels), d, generator=g, dtype=F64)
    return x * torch.exp(norm_spread * torch.randn(len(labels), 1, generator=g, dtype=F64)), labels


def shuffled(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm], y[perm]


def on_circle(cosines: list[float], signs: list[int], d: int, seed: int, scaled: bool = True) -> torch.Tensor:
    """Row 0 is the anchor; row j has cosine ``cosines[j-1]`` to it (exact up to rounding), on a
    random 2-D plane of R^d; ``scaled`` gives the rows norms from 0.5 to 3."""
    g = torch.Generator().manual_seed(seed)
    angles = [0.0] + [sgn * math.acos(c) for c, sgn in zip(cosines, signs, strict=True)]
    pts = torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=F64)
    q, _ = torch.linalg.qr(torch.randn(d, 2, generator=g, dtype=F64))
    x = pts @ q.t()
    return x * torch.linspace(0.5, 3.0, len(angles), dtype=F64).unsqueeze(1) if scaled else x


def pair_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    cases["pk_4x4"] = clustered([c for c in range(4) for _ in range(4)], seed=1)
    sizes = {1000: 1, -3: 2, 7: 3, 42: 5, 5: 4, 9: 1}  # singletons, unsorted, non-contiguous
    cases["uneven_unsorted"] = shuffled(*clustered([c for c, n in sizes.items() for _ in range(n)], seed=2), seed=3)
    cases["random_labels"] = clustered(torch.randint(0, 5, (18,), generator=torch.Generator().manual_seed(4)), 5)
    cases["wide_spread"] = clustered([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], seed=6, spread=3.0)
    # Exact duplicates: within a class (s = 1 positive) and across classes (s = 1 negative).
    x, y = clustered([0, 0, 0, 1, 1, 2, 2, 2], seed=7)
    cases["duplicates"] = shuffled(
        torch.cat([x, x[1:2] * 3.0, x[3:4] * 0.5, x[5:6]]), torch.cat([y, torch.tensor([0, 2, 1])]), seed=8
    )
    # Ties: equally similar positives and negatives (copies of three directions).
    base, _ = clustered([0, 1, 2], seed=9, norm_spread=0.0)
    x = torch.stack([base[0], base[1], base[1], base[1], base[2], base[2], base[2], base[0]])
    cases["ties"] = (x * torch.linspace(0.5, 4.0, 8, dtype=F64).unsqueeze(1), torch.tensor([0, 0, 0, 1, 1, 2, 2, 0]))
    # Anchor 0's similarities within 1e-9 of the contrastive/lifted margin (0.5), of the triplet
    # margin (S_ap - S_an = 0.1) and of S_an = S_ap (semi-hard boundary, sc1).
    cos = [0.5 + 1e-9, 0.5 - 1e-9, 0.7, 0.6 + 1e-9, 0.6 - 1e-9, 0.7 - 1e-9, 0.5, -0.3]
    cases["near_thresholds"] = (
        on_circle(cos, signs=[1, -1, 1, -1, 1, -1, 1, -1], d=6, seed=15),
        torch.tensor([0, 1, 2, 0, 1, 2, 1, 0, 2]),
    )
    cases["two_same"] = clustered([3, 3], seed=10)
    cases["two_different"] = clustered([3, 4], seed=11)
    cases["one_class"] = clustered([5] * 5, seed=12)
    cases["all_distinct"] = clustered(list(range(6)), seed=13)
    cases["single_sample"] = clustered([0], seed=14)
    return cases


PAIR_CASES = pair_cases()


TIE_FREE = ["pk_4x4", "uneven_unsorted", "random_labels", "wide_spread"]


def counts(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor: number of positives and of negatives."""
    same = y.unsqueeze(0) == y.unsqueeze(1)
    return same.sum(dim=1) - 1, (~same).sum(dim=1)


def every_anchor_has_both(y: torch.Tensor) -> bool:
    n_pos, n_neg = counts(y)
    return bool((n_pos > 0).all() and (n_neg > 0).all())


def sim_list(x: torch.Tensor) -> list[list[float]]:
    return cosine_similarity_matrix(x).tolist()


def positives(y: list[int], a: int) -> list[int]:
    return [j for j in range(len(y)) if j != a and y[j] == y[a]]


def negatives(y: list[int], a: int) -> list[int]:
    return [j for j in range(len(y)) if y[j] != y[a]]


def triplet_set(t: tuple[torch.Tensor, ...]) -> list[tuple[int, int, int]]:
    return sorted(zip(*(v.tolist() for v in t), strict=True))


def semihard_reference(s: list[list[float]], y: list[int]) -> list[tuple[int, int, int]]:
    """Eq. 2.20: per (a, p), argmax_{n: S_ap > S_an} S_an (lowest index among ties)."""
    out = []
    for a in range(len(y)):
        for p in positives(y, a):
            cands = [n for n in negatives(y, a) if s[a][n] < s[a][p]]
            if cands:
                best = max(s[a][n] for n in cands)
                out.append((a, p, min(n for n in cands if s[a][n] == best)))
    return sorted(out)


def per_anchor_reference(s: list[list[float]], y: list[int], easiest_positive: bool) -> list[tuple[int, int, int]]:
    """Eq. 2.18-2.19 (hardest positive) or easy positive; hardest negative; lowest index on ties."""
    out = []
    for a in range(len(y)):
        ps, ns = positives(y, a), negatives(y, a)
        if ps and ns:
            target = max(s[a][p] for p in ps) if easiest_positive else min(s[a][p] for p in ps)
            p = min(p for p in ps if s[a][p] == target)
            hardest = max(s[a][n] for n in ns)
            out.append((a, p, min(n for n in ns if s[a][n] == hardest)))
    return out


def proxy_cases() -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    cases: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    x, y = clustered([c for c in range(4) for _ in range(3)], seed=30)
    cases["pk_4x3_of_6"] = (6, x, y)
    x, y = clustered([7, 0, 3, 3, 7, 7, 1, 3, 0, 5], seed=31)
    cases["uneven_unsorted"] = (8, x, y)
    x, y = clustered([2] * 4, seed=32)
    cases["one_class"] = (3, x, y)
    x, y = clustered([1], seed=33)
    cases["single_sample"] = (3, x, y)
    x, y = clustered([0, 1, 1, 2], seed=34)
    cases["duplicates"] = (3, torch.cat([x, x[:2] * 7.0]), torch.cat([y, torch.tensor([0, 2])]))
    return cases


PROXY_CASES = proxy_cases()


def seeded(cls: type, num_classes: int, dim: int, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(num_classes, dim, **kw).double()


PAPER_DEFAULTS: dict[str, dict[str, object]] = {
    "contrastive": {"margin": 0.5, "reduction": "mean"},
    "triplet": {"margin": 0.1, "miner": "semihard", "reduction": "mean"},
    "lifted_structure": {"margin": 0.5, "reduction": "sum"},
    "npair": {"reduction": "mean", "l2_reg": 0.0},
    "margin": {"margin": 0.5, "beta": 1.2, "learn_beta": False, "reduction": "mean"},
    "raw_vthm": {
        "alpha": 2.0,
        "beta": 50.0,
        "gamma": 0.5,
        "margin": 0.1,
        "mining": True,
        "reduction": "mean",
    },
    "binomial_deviance": {"alpha": 2.0, "beta": 50.0, "gamma": 0.5, "reduction": "sum"},
    "histogram": {"step": 0.01, "bins": 201},
    "direct_gradient": {
        "preset": "best",
        "direction": "cos-orth",
        "pair_weight": "lin-ms",
        "triplet_weight": "cir",
        "selective": "none",
        "tau": 1.0,
        "alpha": 2.0,
        "beta": 10.0,
        "lam": 0.5,
        "epsilon": 0.1,
        "miner": "ephn",
    },
    "normalized_softmax": {"temperature": 0.05, "reduction": "mean"},
    "proxy_nca": {"scale": 1.0, "exclude_positive": True, "reduction": "sum"},
    "arcface": {"margin": 28.6, "scale": 64.0, "reduction": "sum"},
    "soft_triple": {
        "centers_per_class": 10,
        "scale": 20.0,
        "gamma": 10.0,
        "margin": 0.1,
        "tau": 0.2,
        "reduction": "sum",
    },
}
