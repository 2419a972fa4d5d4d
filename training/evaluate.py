"""Evaluation of an embedding model: embed with torch, score with the shared index metrics."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from index.evaluation import map_at_r, recall_at_k


@torch.no_grad()
def embed_images(
    model: nn.Module, images: np.ndarray, batch_size: int = 512, device: str | torch.device = "cpu"
) -> np.ndarray:
    """L2-normalised embeddings of preprocessed NCHW images, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        parts = [
            model(torch.from_numpy(images[i : i + batch_size]).to(device)).float().cpu().numpy()
            for i in range(0, len(images), batch_size)
        ]
    finally:
        model.train(was_training)
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)


def retrieval_metrics(embeddings: np.ndarray, labels: Sequence[int], ks: Sequence[int]) -> dict:
    """Recall@K (leave-one-out, exact inner product) and MAP@R, as JSON-ready numbers."""
    recall = recall_at_k(embeddings, labels, ks)
    return {
        "recall_at_k": {str(k): v for k, v in recall.items()},
        "map_at_r": map_at_r(embeddings, labels),
    }
