"""Training data: catalogs split by class into train/val/test, and images decoded for torch.

Evaluation images go through the one preprocessing implementation in `core.data.preprocess`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.data.catalog import Catalog, read_catalog
from core.data.preprocess import ImageDecodeError, InputContract, Region, load_image, rows_per_pass
from core.memory import pin_mmap_threshold
from core.progress import Progress
from training.data.glyphs import DEFAULT_DATA_DIR, build_glyph_dataset

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
    dataset: str | None = None,
    data_root: str | Path | None = None,
) -> dict[str, Path]:
    """Write the split catalogs under out_dir/splits and return their paths.

    A benchmark `dataset` keeps its published split (train/test, In-shop train/query/gallery)
    and carves validation classes out of its training classes. Otherwise the classes of
    `catalog` — or of the embedded glyph set when there is none — are split by
    `class_disjoint_split`. `max_classes` and `max_per_class` take a deterministic slice (of
    the whole set before splitting, or of each published split), for tests and quick runs.
    """
    if dataset is not None:
        from training.data.datasets import load_benchmark

        if data_root is None:
            raise ValueError(f"dataset {dataset} needs data_root")
        published = load_benchmark(dataset, data_root)
        train_classes = published["train"].classes
        n_val = max(1, round(len(train_classes) * val_fraction)) if val_fraction > 0 else 0
        val_positions = (
            set(np.linspace(0, len(train_classes) - 1, n_val).round().astype(int).tolist()) if n_val else set()
        )
        catalogs = {
            "train": published["train"].with_classes(c for i, c in enumerate(train_classes) if i not in val_positions),
            "val": published["train"].with_classes(c for i, c in enumerate(train_classes) if i in val_positions),
            **{name: cat for name, cat in published.items() if name != "train"},
        }
        catalogs = {name: slice_catalog(cat, max_classes, max_per_class) for name, cat in catalogs.items()}
    else:
        if catalog is None:
            source = read_catalog(build_glyph_dataset(data_dir))
            shuffle_seed = split_seed
        else:
            source = read_catalog(catalog)
            source.require_labels("training (classes to learn from)")
            shuffle_seed = None
        source = slice_catalog(source, max_classes, max_per_class)
        split = class_disjoint_split(source.classes, test_fraction, val_fraction, shuffle_seed)
        catalogs = {name: source.with_classes(split[name]) for name in SPLITS}
    out = Path(out_dir) / "splits"
    return {name: cat.write(out / f"{name}.csv") for name, cat in catalogs.items() if len(cat)}


def slice_catalog(catalog: Catalog, max_classes: int | None, max_per_class: int | None) -> Catalog:
    """A deterministic slice: classes spread over the class list, the first images of each."""
    if max_classes is not None:
        classes = catalog.classes
        catalog = catalog.with_classes(classes[:: max(1, len(classes) // max_classes)][:max_classes])
    if max_per_class is not None:
        counts: dict[str, int] = {}
        keep = []
        for row, label in enumerate(catalog.labels):
            if counts.get(label, 0) < max_per_class:
                counts[label] = counts.get(label, 0) + 1
                keep.append(row)
        catalog = catalog.subset(keep)
    return catalog


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
    """Decode a whole catalog into memory (a row with a bbox: that crop); unreadable images are
    skipped and counted."""

    def decode(path: Path, region: Region | None) -> np.ndarray | None:
        try:
            return load_image(path, contract, region=region)
        except ImageDecodeError as exc:
            log.warning("skipping %s: %s", path, exc)
            return None

    with ThreadPoolExecutor(max_workers=threads) as pool:
        decoded = list(pool.map(decode, catalog.paths, catalog.regions))
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


# -- training batches ---------------------------------------------------------------------

AUGMENTATIONS = ("none", "flip", "crop", "crop+flip")
DATA_MODES = ("auto", "memory", "lazy")


def build_augmentation(name: str, contract: InputContract) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The papers' training augmentation (random resized crop + horizontal flip), or parts of it.

    It works on one CHW tensor at the contract's size, so the same transform serves images
    held in memory and images decoded lazily.
    """
    from torchvision.transforms import v2

    if name not in AUGMENTATIONS:
        raise ValueError(f"augment must be one of {', '.join(AUGMENTATIONS)}, got {name!r}")
    steps: list[Callable] = []
    if "crop" in name:
        steps.append(v2.RandomResizedCrop((contract.height, contract.width), scale=(0.16, 1.0), antialias=True))
    if "flip" in name:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps) if steps else None


class MemoryImages(torch.utils.data.Dataset):
    """Images already decoded into one array (small sets such as the glyphs)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: Callable | None = None) -> None:
        self.images, self.labels, self.augment = torch.from_numpy(images), torch.from_numpy(labels), augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        return (self.augment(x) if self.augment else x), int(self.labels[i])


class LazyImages(torch.utils.data.Dataset):
    """Images decoded when a batch asks for them (sets too large for memory: CUB, SOP, ...).

    An unreadable image yields None; the collate function drops it and counts it.
    """

    def __init__(
        self,
        paths: Sequence[Path],
        labels: np.ndarray,
        contract: InputContract,
        augment: Callable | None = None,
        regions: Sequence[Region | None] | None = None,
    ) -> None:
        self.paths, self.labels, self.contract, self.augment = list(paths), labels, contract, augment
        self.regions = list(regions) if regions is not None else [None] * len(self.paths)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor | None, int]:
        try:
            x = torch.from_numpy(load_image(self.paths[i], self.contract, region=self.regions[i]))
        except ImageDecodeError as exc:
            log.warning("skipping %s: %s", self.paths[i], exc)
            return None, int(self.labels[i])
        return (self.augment(x) if self.augment else x), int(self.labels[i])


def collate_skipping_unreadable(batch: list[tuple[torch.Tensor | None, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack a batch, leaving out images that could not be decoded; returns (x, y, skipped)."""
    kept = [(x, y) for x, y in batch if x is not None]
    if not kept:
        raise ValueError(f"every image of a batch of {len(batch)} was unreadable")
    return torch.stack([x for x, _ in kept]), torch.tensor([y for _, y in kept]), len(batch) - len(kept)


def fits_in_memory(count: int, contract: InputContract, budget_bytes: int = 1 << 30) -> bool:
    return count * int(np.prod(contract.input_shape)) * 4 <= budget_bytes


def decoding_worker_init(worker_id: int) -> None:
    """A DataLoader process decoding images: its heap must not grow with every batch it makes
    (see core/memory.py — ~370 KB an image at 224 px without this)."""
    pin_mmap_threshold()


def _collate_eval(batch: list[tuple[torch.Tensor | None, int]]) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    kept = [(x, y) for x, y in batch if x is not None]
    x = torch.stack([x for x, _ in kept]) if kept else None
    return x, torch.tensor([y for _, y in kept], dtype=torch.int64), len(batch) - len(kept)


class EvalImages:
    """A split to evaluate on, embedded whole: decoded once into memory when it fits the budget
    (the glyphs, CUB), otherwise decoded batch by batch in `loader_workers` processes while the
    model embeds — memory bounded by the batch, and what is kept is the N×D embeddings (SOP's
    60,502 test images at 224 px would be 36 GB decoded at once)."""

    def __init__(
        self,
        catalog: Catalog,
        contract: InputContract,
        mode: str = "auto",
        loader_workers: int = 2,
        max_bad_fraction: float = 0.01,
        batch_size: int | None = None,  # None: as `rows_per_pass` allows the contract's size
    ) -> None:
        if mode not in DATA_MODES:
            raise ValueError(f"data mode must be one of {', '.join(DATA_MODES)}, got {mode!r}")
        self.catalog, self.contract, self.max_bad_fraction = catalog, contract, max_bad_fraction
        self.loader_workers = loader_workers
        self.batch_size = batch_size or rows_per_pass(contract.height, contract.width)
        self.classes = catalog.classes
        self.memory: LoadedImages | None = None
        if mode == "memory" or (mode == "auto" and fits_in_memory(len(catalog), contract)):
            self.memory = load_images(catalog, contract, max_bad_fraction)
        self.skipped = self.memory.skipped if self.memory is not None else 0

    def __len__(self) -> int:
        return len(self.catalog)

    @torch.no_grad()
    def embed(self, model: torch.nn.Module, device: str | torch.device = "cpu") -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, label codes) of every readable image, in catalog order."""
        from training.models.forward import embed_images, eval_mode, model_input

        if self.memory is not None:
            return embed_images(model, self.memory.images, device=device), self.memory.labels
        codes = np.asarray(self.catalog.label_codes(self.classes), dtype=np.int64)
        loader = torch.utils.data.DataLoader(
            LazyImages(self.catalog.paths, codes, self.contract),
            batch_size=self.batch_size,
            num_workers=self.loader_workers,
            collate_fn=_collate_eval,
            worker_init_fn=decoding_worker_init,
        )
        parts, labels, skipped = [], [], 0
        # A streamed split is a large one (SOP's test half: minutes): a line every ~30 s in a log.
        with eval_mode(model), Progress(len(self), f"embed {Path(str(self.catalog.source)).name}") as shown:
            for x, y, bad in loader:
                skipped += bad
                if x is not None:
                    parts.append(model(model_input(x, device)).float().cpu().numpy())
                    labels.append(y.numpy())
                shown.update(len(y) + bad)
        self.skipped = skipped
        if len(self) and skipped / len(self) > self.max_bad_fraction:
            raise ValueError(
                f"{skipped} of {len(self)} images in {self.catalog.source} are unreadable, over the "
                f"allowed fraction {self.max_bad_fraction}"
            )
        if not parts:
            raise ValueError(f"no image of {self.catalog.source} could be read")
        return np.concatenate(parts), np.concatenate(labels)


def train_dataset(
    catalog: Catalog,
    contract: InputContract,
    augment: Callable | None,
    mode: str = "auto",
    max_bad_fraction: float = 0.01,
) -> tuple[torch.utils.data.Dataset, np.ndarray, int]:
    """The training images as a Dataset, their label codes (0..C-1) and the count skipped so far.

    mode 'memory' decodes everything up front (bad images skipped and counted once), 'lazy'
    decodes per batch (bad images are skipped per batch by `collate_skipping_unreadable`),
    'auto' picks memory when the decoded set fits in 1 GiB.
    """
    if mode not in DATA_MODES:
        raise ValueError(f"data mode must be one of {', '.join(DATA_MODES)}, got {mode!r}")
    if mode == "auto":
        mode = "memory" if fits_in_memory(len(catalog), contract) else "lazy"
    if mode == "memory":
        loaded = load_images(catalog, contract, max_bad_fraction)
        return MemoryImages(loaded.images, loaded.labels, augment), loaded.labels, loaded.skipped
    labels = np.asarray(catalog.label_codes(), dtype=np.int64)
    return LazyImages(catalog.paths, labels, contract, augment, catalog.regions), labels, 0
