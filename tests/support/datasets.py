"""Miniature copies of the four benchmarks in their published layouts, for the readers' tests.

`write_replica` writes one under a folder (tiny solid-colour images, real annotation files; Cars196:
a real MATLAB struct written with scipy), so `training.data.datasets` can be tried and tested without the
real data. Only tests use it, so it lives here rather than in the training package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from training.data.datasets import _CARS_BBOX, _INSHOP_HEADER, _SOP_HEADER, get_dataset

__all__ = ["REPLICAS", "write_replica"]

_CARS_FIELDS = ("relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test")
_SOP_SUPER_CLASSES = (
    "bicycle",
    "cabinet",
    "chair",
    "coffee_maker",
    "fan",
    "kettle",
    "lamp",
    "mug",
    "sofa",
    "stapler",
    "table",
    "toaster",
)
_INSHOP_CATEGORIES = (
    "MEN/Denim",
    "MEN/Jackets_Vests",
    "MEN/Shirts_Polos",
    "MEN/Tees_Tanks",
    "WOMEN/Blouses_Shirts",
    "WOMEN/Dresses",
    "WOMEN/Skirts",
    "WOMEN/Tees_Tanks",
)
_INSHOP_VIEWS = ("1_front", "2_side", "3_back", "4_full", "7_additional")


@dataclass(frozen=True)
class Replica:
    """How to fake one benchmark: where a copy shows, its default size, its writer."""

    marker: Callable[[Path], Path]  # the path whose existence means a copy of the dataset is already in a root
    write: Callable[[Path, int, int, np.random.Generator, int], None]
    classes: int
    images_per_class: int
    min_images_per_class: int = 1


def write_replica(
    name: str,
    root: str | Path,
    classes: int | None = None,
    images_per_class: int | None = None,
    seed: int = 0,
    image_size: int = 8,
) -> Path:
    """Write a miniature copy of benchmark `name` in its published layout under `root`.

    Annotation files are real (same names, format and, for Cars196, the same MATLAB struct
    layout), images are `image_size`-pixel solid random colours. `classes` defaults to the real
    class count for CUB (200) and Cars196 (196) so the standard class ranges hold, and to a
    small number for SOP and In-shop (items). Returns `root`, the folder to pass to
    `load_benchmark`. Refuses (FileExistsError) to write over a dataset already in `root`.
    """
    dataset = get_dataset(name)()
    replica = REPLICAS[dataset.name]
    classes = replica.classes if classes is None else classes
    images_per_class = replica.images_per_class if images_per_class is None else images_per_class
    if classes < 2:
        raise ValueError(f"a {dataset.title} replica needs at least 2 classes (one per side of the split)")
    if images_per_class < replica.min_images_per_class:
        raise ValueError(f"a {dataset.title} replica needs at least {replica.min_images_per_class} images per class")
    if image_size < 1:
        raise ValueError("image_size must be at least 1")
    root = Path(root)
    marker = replica.marker(root)
    if marker.exists():
        # The root may hold the real dataset; a replica must never overwrite it.
        raise FileExistsError(f"{marker} already exists; write the {dataset.title} replica to an empty folder")
    root.mkdir(parents=True, exist_ok=True)
    replica.write(root, classes, images_per_class, np.random.default_rng(seed), image_size)
    return root


def _save_image(path: Path, rng: np.random.Generator, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
    fmt = "PNG" if path.suffix.lower() == ".png" else "JPEG"
    Image.new("RGB", (size, size), colour).save(path, format=fmt)


def _write_text(path: Path, lines: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def _write_cub(root: Path, classes: int, images_per_class: int, rng: np.random.Generator, image_size: int) -> None:
    folder = root / "CUB_200_2011"
    class_lines, image_lines, label_lines, split_lines, box_lines = [], [], [], [], []
    image_id = 0
    for class_id in range(1, classes + 1):
        species = f"Species_{class_id:03d}"
        class_name = f"{class_id:03d}.{species}"
        class_lines.append(f"{class_id} {class_name}")
        for k in range(images_per_class):
            image_id += 1
            relative = f"{class_name}/{species}_{k + 1:04d}_{image_id}.jpg"
            _save_image(folder / "images" / relative, rng, image_size)
            image_lines.append(f"{image_id} {relative}")
            label_lines.append(f"{image_id} {class_id}")
            split_lines.append(f"{image_id} {1 - k % 2}")
            x, y = rng.integers(0, image_size, size=2)
            box_lines.append(f"{image_id} {float(x)} {float(y)} {float(image_size - x)} {float(image_size - y)}")
    _write_text(folder / "classes.txt", class_lines)
    _write_text(folder / "images.txt", image_lines)
    _write_text(folder / "image_class_labels.txt", label_lines)
    _write_text(folder / "train_test_split.txt", split_lines)
    _write_text(folder / "bounding_boxes.txt", box_lines)


def _write_cars196(root: Path, classes: int, images_per_class: int, rng: np.random.Generator, image_size: int) -> None:
    try:
        from scipy.io import savemat
    except ImportError as exc:
        raise ImportError("writing a Cars196 replica (cars_annos.mat) needs scipy (pip install scipy)") from exc
    # The published file numbers images in one sequence across classes; assigning classes
    # in random order makes sure the reader relies on the `class` field, not on order.
    class_of = rng.permutation(np.repeat(np.arange(1, classes + 1), images_per_class))
    class_dtype = np.uint8 if classes <= np.iinfo(np.uint8).max else np.uint16
    records = np.zeros((1, len(class_of)), dtype=[(f, object) for f in _CARS_FIELDS])
    for index, class_id in enumerate(class_of):
        relative = f"car_ims/{index + 1:06d}.jpg"
        _save_image(root / relative, rng, image_size)
        x1, y1 = (int(v) for v in rng.integers(0, image_size, size=2))
        record = records[0, index]
        record["relative_im_path"] = np.array([relative])
        for field, v in zip(_CARS_BBOX, (x1, y1, image_size - 1, image_size - 1), strict=True):
            record[field] = np.array([[v]], dtype=np.uint16)
        record["class"] = np.array([[class_id]], dtype=class_dtype)
        record["test"] = np.array([[rng.integers(0, 2)]], dtype=np.uint8)
    class_names = np.empty((1, classes), dtype=object)
    for c in range(classes):
        class_names[0, c] = f"Make{c + 1} Model{c + 1} {2000 + c % 13}"
    savemat(str(root / "cars_annos.mat"), {"annotations": records, "class_names": class_names})


def _write_sop(root: Path, classes: int, images_per_class: int, rng: np.random.Generator, image_size: int) -> None:
    folder = root / "Stanford_Online_Products"
    n_train = classes - classes // 2
    listings = 100_000_000_000 + rng.choice(300_000_000_000, size=classes, replace=False)
    header = " ".join(_SOP_HEADER)
    files: dict[str, list[str]] = {"Ebay_train.txt": [header], "Ebay_test.txt": [header]}
    info = [header]
    image_id = 0
    for index in range(classes):
        train = index < n_train
        position, size = (index, n_train) if train else (index - n_train, classes - n_train)
        # Within a split the published files run through the super classes in blocks.
        super_index = position * len(_SOP_SUPER_CLASSES) // size
        category = f"{_SOP_SUPER_CLASSES[super_index]}_final"
        for k in range(images_per_class):
            image_id += 1
            relative = f"{category}/{listings[index]}_{k}.JPG"
            _save_image(folder / relative, rng, image_size)
            line = f"{image_id} {index + 1} {super_index + 1} {relative}"
            files["Ebay_train.txt" if train else "Ebay_test.txt"].append(line)
            info.append(line)
    for name, lines in files.items():
        _write_text(folder / name, lines)
    _write_text(folder / "Ebay_info.txt", info)


def _write_inshop(root: Path, classes: int, images_per_class: int, rng: np.random.Generator, image_size: int) -> None:
    # Published item ids are sparse 8-digit numbers, and train and test items interleave.
    numbers = np.sort(1 + rng.choice(10 * classes, size=classes, replace=False))
    test_items = set(rng.permutation(classes)[: classes // 2].tolist())
    entries = []
    for index, number in enumerate(numbers):
        item_id = f"id_{number:08d}"
        category = _INSHOP_CATEGORIES[int(rng.integers(len(_INSHOP_CATEGORIES)))]
        for k in range(images_per_class):
            clothes, view = divmod(k, len(_INSHOP_VIEWS))
            relative = f"img/{category}/{item_id}/{clothes + 1:02d}_{_INSHOP_VIEWS[view]}.jpg"
            _save_image(root / "Img" / relative, rng, image_size)
            if index in test_items:
                status = "query" if k % 2 == 0 else "gallery"
            else:
                status = "train"
            entries.append((relative, item_id, status))
    width = max(len(r) for r, _, _ in entries) + 8
    # Column-aligned with runs of spaces, as the published file is.
    lines = [str(len(entries)), " ".join(_INSHOP_HEADER)]
    lines += [f"{relative.ljust(width)}{item_id} {status}" for relative, item_id, status in entries]
    _write_text(root / "Eval" / "list_eval_partition.txt", lines)


REPLICAS: dict[str, Replica] = {
    "cub": Replica(lambda root: root / "CUB_200_2011", _write_cub, classes=200, images_per_class=2),
    "cars196": Replica(lambda root: root / "cars_annos.mat", _write_cars196, classes=196, images_per_class=2),
    "sop": Replica(lambda root: root / "Stanford_Online_Products", _write_sop, classes=24, images_per_class=2),
    "inshop": Replica(
        lambda root: root / "Eval" / "list_eval_partition.txt",
        _write_inshop,
        classes=20,
        images_per_class=4,
        min_images_per_class=2,  # a test item needs a query and a gallery image
    ),
}
