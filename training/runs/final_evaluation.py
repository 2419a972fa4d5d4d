"""A training run's evaluation on its held-out classes: the published network and where it started
(the pretrained trunk with --pretrained, the untrained network otherwise), Recall@K, MAP@R and
NMI on the test classes (In-shop: its queries searched in its gallery), with the pair
similarities the histogram plot draws; and a split's images read for evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.data.catalog import ITEM_COLUMN, read_catalog
from training.data.splits import EvalImages
from training.models.models import EmbeddingNet
from training.runs.config import TrainConfig
from training.runs.evaluate import (
    histogram_overlap,
    item_recall,
    pair_similarities,
    query_gallery_metrics,
    retrieval_metrics,
)
from training.runs.trainable import build_model


def split_images(splits: dict[str, str], name: str, cfg: TrainConfig, contract) -> EvalImages | None:
    if name not in splits:
        return None
    return EvalImages(read_catalog(splits[name]), contract, cfg.data_mode, cfg.loader_workers, cfg.max_bad_fraction)


def evaluate_test_classes(
    cfg: TrainConfig, splits: dict[str, Path], contract, model: torch.nn.Module
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Recall@K, MAP@R and NMI on the test classes, for the trained network and where it started,
    and each one's positive and negative pair similarities (for the histogram plot).

    Where it started: with --pretrained, the pretrained network as it is (pooled trunk features,
    no head — what `export --pretrained` publishes, the figure fine-tuning has to beat);
    otherwise the untrained network. In-shop has no single test set: its queries are searched
    in its gallery.
    """
    if cfg.pretrained is not None:
        untrained_model = EmbeddingNet(cfg.backbone, None, cfg.pooling, cfg.pretrained, image_size=cfg.image_size)
    else:
        untrained_model = build_model(cfg)
    if "query" in splits:
        query = split_images(splits, "query", cfg, contract)
        gallery = split_images(splits, "gallery", cfg, contract)

        def score(net):
            (q, q_codes), (g, g_codes) = query.embed(net), gallery.embed(net)
            qlabels = np.asarray(query.classes, dtype=object)[q_codes]
            glabels = np.asarray(gallery.classes, dtype=object)[g_codes]
            return query_gallery_metrics(q, qlabels, g, glabels, cfg.ks), g, g_codes

        test_images, test_classes = len(query) + len(gallery), len(gallery.classes)
    else:
        test = split_images(splits, "test", cfg, contract)

        items = [m.get(ITEM_COLUMN) for m in test.catalog.metadata]

        def score(net):
            embeddings, codes = test.embed(net)
            metrics = retrieval_metrics(embeddings, codes, cfg.ks, with_nmi=True)
            # A catalog of items (several images each) is scored by item too, where every row
            # names its item and every image was read (so rows and embeddings line up).
            if all(items) and len(items) == len(embeddings):
                metrics["item_recall_at_k"] = item_recall(embeddings, items, cfg.ks)
            return metrics, embeddings, codes

        test_images, test_classes = len(test), len(test.classes)
    untrained, untrained_embeddings, labels = score(untrained_model)
    trained, trained_embeddings, _ = score(model)
    skipped = query.skipped + gallery.skipped if "query" in splits else test.skipped
    similarities = {
        "untrained": pair_similarities(untrained_embeddings, labels),
        "trained": pair_similarities(trained_embeddings, labels),
    }
    overlap = {name: histogram_overlap(*pairs) for name, pairs in similarities.items()}
    return {
        "untrained": {**untrained, "histogram_overlap": overlap["untrained"]},
        "trained": {**trained, "histogram_overlap": overlap["trained"]},
        "test_images": test_images,
        "test_classes": test_classes,
        "skipped_test_images": skipped,
    }, similarities
