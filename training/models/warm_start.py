"""Where fine-tuning starts: the head and the proxies fitted to the pretrained network's features.

A randomly initialised linear head throws away the pretrained network's geometry at epoch 0, and
random proxies in a wide space pull every embedding towards an arbitrary direction in the first
steps — with proxies learning 100× faster than the backbone, those steps do the damage before
the backbone can follow. Fitting both to the features of the training images first makes epoch 0
the pretrained network itself (up to the projection) and the loss's first gradients meaningful.
Measured on the icon set in `benchmarks/bench_finetune.py`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.models.models import EmbeddingNet

log = logging.getLogger(__name__)

HEAD_INITS = ("random", "pca")
PROXY_INITS = ("random", "class_means")
# The start's features come from at most 8 training images per class and 20,000 in all (one
# embedding pass before training: all of SOP's 60k training images would cost more than a short
# epoch); a few per class place the class means, a few thousand the principal directions.
WARM_START_PER_CLASS = 8
WARM_START_IMAGES = 20_000


def warm_start_per_class(num_classes: int) -> int:
    """Images per class to take the start's features from."""
    return max(1, min(WARM_START_PER_CLASS, WARM_START_IMAGES // max(1, num_classes)))


def fit_pca_head(head: nn.Linear, features: np.ndarray) -> float:
    """Set `head` to project centred features onto their top principal directions; return the
    fraction of the variance those directions keep. Directions beyond the sample's rank stay 0."""
    mean = features.mean(axis=0)
    _, singular, directions = np.linalg.svd(features - mean, full_matrices=False)
    width = min(head.out_features, len(directions))
    weight = np.zeros((head.out_features, head.in_features), np.float32)
    weight[:width] = directions[:width]
    bias = -weight @ mean.astype(np.float32)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(weight))
        head.bias.copy_(torch.from_numpy(bias))
    variance = singular**2
    return float(variance[:width].sum() / max(variance.sum(), 1e-12))


def class_mean_proxies(embeddings: np.ndarray, codes: np.ndarray, num_classes: int) -> torch.Tensor:
    """One unit vector per class: the normalised mean of its embeddings (a class with no image
    keeps a random direction)."""
    sums = np.zeros((num_classes, embeddings.shape[1]), np.float64)
    np.add.at(sums, codes, embeddings)
    counts = np.bincount(codes, minlength=num_classes)
    empty = counts == 0
    sums[empty] = np.random.default_rng(0).standard_normal((int(empty.sum()), embeddings.shape[1]))
    return F.normalize(torch.from_numpy(sums).float(), dim=1)


def initialise_from_features(
    net: EmbeddingNet,
    loss_fn: nn.Module,
    features: np.ndarray,
    codes: np.ndarray,
    num_classes: int,
    head_init: str,
    proxy_init: str,
) -> None:
    """Apply `head_init` and `proxy_init` given the pooled trunk `features` of the training
    images and their class `codes` (0..num_classes-1)."""
    if head_init == "pca" and isinstance(net.head, nn.Linear):
        kept = fit_pca_head(net.head, features)
        log.info(
            "head initialised by PCA: %d of %d dimensions keep %.1f%% of the variance",
            net.head.out_features,
            net.head.in_features,
            100 * kept,
        )
    proxies = getattr(loss_fn, "proxies", None)
    if proxy_init == "class_means" and isinstance(proxies, nn.Parameter):
        if proxies.shape[0] != num_classes:  # several proxies per class (SoftTriple): keep them spread
            log.warning("proxy_init class_means needs one proxy per class; %s keeps its own", type(loss_fn).__name__)
            return
        with torch.no_grad():
            device = next(net.parameters()).device
            embeddings = F.normalize(net.head(torch.from_numpy(features).to(device)), dim=1).cpu().numpy()
            proxies.copy_(class_mean_proxies(embeddings, codes, num_classes).to(proxies.device))
