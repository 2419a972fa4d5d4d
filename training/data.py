"""Training data: catalogs split by class into train/val/test, and images decoded for torch.

Evaluation images go through the one preprocessing implementation in `index.preprocess`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.catalog import Catalog, read_catalog
from index.preprocess import ImageDecodeError, InputContract, load_image
from training.glyphs import DEFAULT_DATA_DIR, build_glyph_dataset

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def class_disjoint_split(
    classes: Sequence[str],
    test_fraction: float = 0.5,
    val_fraction: float = 0.1,
    shuffle_seed: int | None = None,
) -> dict[str, list[str]]:
    """Split classes (never images) into train/val/test; val is carved from the train classes.

    With no shuffle seed the first classes (in the catalog's class order) train and the last
    test, as in the literature; the glyph set shuffles with a fixed seed so that every script
    lands on both sides.
    """
    if not 0 < test_fraction < 1 or not 0 <= val_fraction < 1:
        raise ValueError("test_fraction must be in (0, 1) and val_fraction in [0, 1)")
    ordered = list(classes)
    if len(ordered) < 4:
        raise ValueError(f"need at least 4 classes for a class-disjoint split, got {len(ordered)}")
    if shuffle_seed is not None:
        ordered = [ordered[i] for i in np.random.default_rng(shuffle_seed).permutation(len(ordered))]
    n_test = max(1, round(len(ordered) * test_fraction))
    train_all, test = ordered[: len(ordered) - n_test], ordered[len(ordered) - n_test :]
    n_val = round(len(train_all) * val_fraction)
    if val_fraction > 0:
        n_val = max(1, n_val)
    # Validation classes are spread over the training classes, not taken from one end.
    val_positions = set(np.linspace(0, len(train_all) - 1, n_val).round().astype(int).tolist()) if n_val else set()
    val = [c for i, c in enumerate(train_all) if i in val_positions]
    train = [c for i, c in enumerate(train_all) if i not in val_positions]
    if len(train) < 2:
        raise ValueError("too few training classes left after carving out validation classes")
    return {"train": train, "val": val, "test": test}


def prepare_splits(
    catalog: str | Path | None,
    out_dir: str | Path,
    data_dir: str | Path = DEFAULT_DATA_DIR,
    test_fraction: float = 0.5,
    val_fraction: float = 0.1,
    split_seed: int | None = 0,
    max_classes: int | None = None,
    max_per_class: int | None = None,
) -> dict[str, Path]:
    """Write train/val/test catalogs under out_dir/splits and return their paths.

    No catalog means the embedded glyph set (rendered on first use). `max_classes` and
    `max_per_class` take a deterministic slice, for tests and quick runs.
    """
    if catalog is None:
        source = read_catalog(build_glyph_dataset(data_dir))
        shuffle_seed = split_seed
    else:
        source = read_catalog(catalog)
        shuffle_seed = None
    classes = source.classes
    if max_classes is not None:
        classes = classes[:: max(1, len(classes) // max_classes)][:max_classes]
        source = source.with_classes(classes)
    if max_per_class is not None:
        counts: dict[str, int] = {}
        keep = []
        for row, label in enumerate(source.labels):
            if counts.get(label, 0) < max_per_class:
                counts[label] = counts.get(label, 0) + 1
                keep.append(row)
        source = source.subset(keep)
    split = class_disjoint_split(classes, test_fraction, val_fraction, shuffle_seed)
    out = Path(out_dir) / "splits"
    paths = {}
    for name in SPLITS:
        if split[name]:
            paths[name] = source.with_classes(split[name]).write(out / f"{name}.csv")
    return paths


@dataclass
class LoadedImages:
    images: np.ndarray  # N×C×H×W float32, preprocessed by the inference contract
    labels: np.ndarray  # int64 codes 0..C-1
    classes: list[str]
    ids: list[str]
    skipped: int


def load_images(
    catalog: Catalog,
    contract: InputContract,
    max_bad_fraction: float = 0.01,
    threads: int = 4,
) -> LoadedImages:
    """Decode a whole catalog into memory; unreadable images are skipped and counted."""

    def decode(path: Path) -> np.ndarray | None:
        try:
            return load_image(path, contract)
        except ImageDecodeError as exc:
            log.warning("skipping %s: %s", path, exc)
            return None

    with ThreadPoolExecutor(max_workers=threads) as pool:
        decoded = list(pool.map(decode, catalog.paths))
    keep = [i for i, array in enumerate(decoded) if array is not None]
    skipped = len(decoded) - len(keep)
    if len(catalog) and skipped / len(catalog) > max_bad_fraction:
        raise ValueError(
            f"{skipped} of {len(catalog)} images in {catalog.source} are unreadable, over the "
            f"allowed fraction {max_bad_fraction}"
        )
    kept = catalog.subset(keep)
    classes = kept.classes
    images = np.stack([decoded[i] for i in keep]) if keep else np.zeros((0, *contract.input_shape), np.float32)
    return LoadedImages(
        images=images,
        labels=np.asarray(kept.label_codes(classes), dtype=np.int64),
        classes=classes,
        ids=kept.ids,
        skipped=skipped,
    )
