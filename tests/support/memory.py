"""Decoding workers' memory, measured in a child process of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
import torch
from PIL import Image

from training.data.splits import LazyImages, _collate_eval
from training.models.models import input_contract

IMAGES = 1024


def worker_growth_mb(paths, worker_init_fn) -> float:
    contract = input_contract("mobilenet_v2", 224)
    dataset = LazyImages(paths, np.zeros(len(paths), np.int64), contract)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=32,
        num_workers=1,
        collate_fn=_collate_eval,
        worker_init_fn=worker_init_fn,
    )
    rss = []
    for _ in loader:
        rss.append(sum(child.memory_info().rss for child in psutil.Process().children()))
    return (max(rss) - rss[2]) / 2**20


def write_pictures(directory: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(IMAGES // 8):  # 128 colour pictures at 224 px, each read 8 times
        pixels = np.zeros((224, 224, 3), np.uint8) + rng.integers(0, 255, 3, dtype=np.uint8)
        pixels[56:112] = rng.integers(0, 255, 3, dtype=np.uint8)
        path = directory / f"{i}.jpg"
        Image.fromarray(pixels).rotate(float(rng.uniform(0, 90))).save(path, quality=90)
        paths.append(path)
    return paths * 8
