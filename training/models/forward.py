"""A model run over images as evaluation runs it: in eval mode, its input laid out for the
device, a batch of embeddings at a time — what evaluation, a split's embedding and the
fine-tuning start share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from core.data.preprocess import rows_per_pass


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode for the block, back in the mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def model_input(x: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A batch of NCHW images as evaluation feeds the network: channels-last, where PyTorch's CPU
    convolutions (depthwise ones above all) run ~2.4× faster for mobilenet_v2 at 224 px than on
    NCHW; the values are the same, only the layout in memory differs."""
    return x.to(device).contiguous(memory_format=torch.channels_last)


@torch.no_grad()
def embed_images(
    model: nn.Module, images: np.ndarray, batch_size: int | None = None, device: str | torch.device = "cpu"
) -> np.ndarray:
    """L2-normalised embeddings of preprocessed NCHW images, in eval mode (None: as many images
    per pass as `rows_per_pass` allows their size)."""
    if batch_size is None:
        batch_size = rows_per_pass(*images.shape[2:4]) if torch.device(device).type == "cpu" else 512
    with eval_mode(model):
        parts = [
            model(model_input(torch.from_numpy(images[i : i + batch_size]), device)).float().cpu().numpy()
            for i in range(0, len(images), batch_size)
        ]
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
