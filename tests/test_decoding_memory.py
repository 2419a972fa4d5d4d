"""A DataLoader process decoding a catalog holds what one batch needs, not what it has decoded:
without the pinned mmap threshold (core/memory.py) glibc carved each batch from a growing heap,
~370 KB an image at 224 px, and SOP's test half took the decoding processes past the machine."""

from __future__ import annotations

import numpy as np
import psutil
import torch
from PIL import Image

from core.memory import pin_mmap_threshold
from training.data import LazyImages, _collate_eval, decoding_worker_init
from training.models import input_contract

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
        # A fresh process, with glibc's defaults: a forked one would inherit this test process's
        # heap settings (a server started earlier in the session pins them for the whole process).
        multiprocessing_context="spawn",
    )
    rss = []
    for _ in loader:
        rss.append(sum(child.memory_info().rss for child in psutil.Process().children()))
    return (max(rss) - rss[2]) / 2**20


def test_decoding_processes_do_not_grow_with_the_images_they_decode(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(IMAGES // 8):  # 128 colour pictures at 224 px, each read 8 times
        pixels = np.zeros((224, 224, 3), np.uint8) + rng.integers(0, 255, 3, dtype=np.uint8)
        pixels[56:112] = rng.integers(0, 255, 3, dtype=np.uint8)
        path = tmp_path / f"{i}.jpg"
        Image.fromarray(pixels).rotate(float(rng.uniform(0, 90))).save(path, quality=90)
        paths.append(path)
    paths = paths * 8
    pin_mmap_threshold()  # as a server test earlier in the session leaves it: must not matter
    pinned = worker_growth_mb(paths, decoding_worker_init)
    dynamic = worker_growth_mb(paths, None)
    assert pinned < 40, f"the decoding process grew {pinned:.0f} MB over {IMAGES} images"
    assert dynamic > pinned + 150, f"without the pinned threshold it grew {dynamic:.0f} MB: the test measures nothing"
