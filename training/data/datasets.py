"""Readers for the four deep-metric-learning benchmarks, in their layouts exactly as published.

Nothing is downloaded: point a reader at a local copy and it returns the dataset's standard
class-disjoint split as project catalogs (`core.data.catalog.Catalog`), one per split::

    from training.data.datasets import load_benchmark

    splits = load_benchmark("cub", "/data")  # {"train": Catalog, "test": Catalog}

Every reader accepts either the folder the archive was unpacked into or the dataset's own folder.
Labels are the dataset's class id as a string (``"1"`` .. ``"200"``; In-shop: the item id,
``"id_00000002"``). Ids are the image path exactly as the annotation file writes it, so they are
unique across all splits of a dataset and catalogs of different splits can be concatenated.
Image files are not checked here (``Catalog.check_files`` lists missing ones; training counts
unreadable images), only the annotations.

``cub`` - CUB-200-2011 (``CUB_200_2011.tgz``)::

    CUB_200_2011/images.txt              <image_id> <path under images/>
    CUB_200_2011/image_class_labels.txt  <image_id> <class_id>
    CUB_200_2011/classes.txt             <class_id> <class name>, e.g. "1 001.Black_footed_Albatross"
    CUB_200_2011/bounding_boxes.txt      <image_id> <x> <y> <width> <height>   (optional; metadata)
    CUB_200_2011/images/<class name>/<file>.jpg

  Splits: ``train`` = classes 1-100 (5,864 images), ``test`` = classes 101-200 (5,924).
  ``train_test_split.txt`` is the per-image classification split and is not used.

``cars196`` - Stanford Cars, as distributed with ``car_ims.tgz`` and ``cars_annos.mat``::

    cars_annos.mat   MATLAB struct array ``annotations`` (relative_im_path, bbox_x1, bbox_y1,
                     bbox_x2, bbox_y2, class, test) and cell array ``class_names``
    car_ims/000001.jpg .. car_ims/016185.jpg

  Splits: ``train`` = classes 1-98 (8,054 images), ``test`` = classes 99-196 (8,131). The
  ``test`` flag is the classification split and is ignored (kept as metadata). Needs scipy.

``sop`` - Stanford Online Products (``Stanford_Online_Products.zip``)::

    Stanford_Online_Products/Ebay_train.txt   header "image_id class_id super_class_id path",
    Stanford_Online_Products/Ebay_test.txt    rows like "1 1 1 bicycle_final/111085122871_0.JPG"
    Stanford_Online_Products/<super class>_final/<listing id>_<n>.JPG

  Splits: ``train`` = Ebay_train.txt (59,551 images, classes 1-11,318), ``test`` = Ebay_test.txt
  (60,502 images, classes 11,319-22,634).

``inshop`` - DeepFashion In-shop Clothes Retrieval Benchmark::

    Eval/list_eval_partition.txt   "52712", then "image_name item_id evaluation_status", then rows
                                   like "img/WOMEN/Dresses/id_00000002/02_1_front.jpg id_00000002 train"
    Img/img/<MEN|WOMEN>/<category>/<item id>/<file>.jpg    (Img/img.zip unpacked in place)

  The flat layout many DML code bases use (``list_eval_partition.txt`` beside ``img/``) is
  accepted too. Splits: ``train`` (25,882 images of 3,997 items), ``query`` (14,218) and
  ``gallery`` (12,612), both over the other 3,985 items.

For CUB and Cars the split point is the first half of the class list (``classes.txt``,
``class_names``): exactly classes 1-100 and 1-98 on the published data, and the same rule on a
smaller copy. The tests write a miniature copy of any of the four in its published layout (tiny
solid-colour images, real annotation files: ``tests/support/datasets.py``, ``write_replica``), so
the readers are tested without the real data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from core.data.catalog import Catalog, CatalogError
from core.registry import Registry
from training.data.annotation_files import (
    Row,
    annotation_rows,
    keyed_rows,
    load_mat,
    locate_annotations,
    mat_int,
    mat_text,
    parse_int,
    preview,
    read_lines,
    split_catalogs,
)
from training.models.weight_files import key_mismatch

log = logging.getLogger(__name__)

__all__ = [
    "DATASETS",
    "BenchmarkDataset",
    "available_datasets",
    "get_dataset",
    "load_benchmark",
    "register_dataset",
]


class BenchmarkDataset:
    """A benchmark reader: where its annotation files live and how to read them.

    Subclasses set the class attributes and implement `load`; they are stateless, so the registry
    holds classes and instantiates one per call.
    """

    name: ClassVar[str] = ""  # set by @register_dataset
    title: ClassVar[str] = ""
    splits: ClassVar[tuple[str, ...]] = ()
    # Folders under the root, in order, where the annotation files may be ("" = the root itself).
    subdirs: ClassVar[tuple[str, ...]] = ("",)
    annotation_files: ClassVar[tuple[str, ...]] = ()
    # The Ks the literature reports Recall@K at on this dataset (docs/architecture.md, evaluation protocol).
    recall_ks: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32)

    def load(self, root: Path) -> dict[str, Catalog]:
        raise NotImplementedError

    def locate(self, root: Path) -> Path:
        """The folder under `root` holding every annotation file, or a CatalogError saying which is missing."""
        return locate_annotations(self.title, root, self.subdirs, self.annotation_files)


_DatasetT = TypeVar("_DatasetT", bound=type[BenchmarkDataset])

DATASETS: Registry[type[BenchmarkDataset]] = Registry("dataset", base=BenchmarkDataset)


def register_dataset(name: str) -> Callable[[_DatasetT], _DatasetT]:
    """Class decorator adding a `BenchmarkDataset` subclass to the registry under `name`."""
    add = DATASETS.register(name)

    def decorator(cls: _DatasetT) -> _DatasetT:
        add(cls)
        cls.name = name
        return cls

    return decorator


def available_datasets() -> list[str]:
    """Sorted names of every registered benchmark reader."""
    return DATASETS.names()


def get_dataset(name: str) -> type[BenchmarkDataset]:
    """The reader class registered under `name`; ValueError listing the known names otherwise."""
    return DATASETS.get(name)


def load_benchmark(name: str, root: str | Path) -> dict[str, Catalog]:
    """Read the benchmark `name` from the local folder `root`: split name -> Catalog.

    Raises ValueError for an unknown name and CatalogError (a ValueError) for a missing root,
    a missing annotation file, a malformed line or inconsistent annotations.
    """
    return get_dataset(name)().load(Path(root))


# ---------------------------------------------------------------------------------------------
# CUB-200-2011


@register_dataset("cub")
class CUB200(BenchmarkDataset):
    title = "CUB-200-2011"
    splits = ("train", "test")
    subdirs = ("", "CUB_200_2011")
    annotation_files = ("images.txt", "image_class_labels.txt", "classes.txt")

    def load(self, root: Path) -> dict[str, Catalog]:
        folder = self.locate(root)
        images_file, labels_file, classes_file = (folder / f for f in self.annotation_files)
        class_names = {
            key: fields[0] for key, (_, fields) in keyed_rows(classes_file, ("class_id", "class_name")).items()
        }
        images = keyed_rows(images_file, ("image_id", "path"))
        labels = keyed_rows(labels_file, ("image_id", "class_id"))

        unlabelled = sorted(images.keys() - labels.keys())
        orphans = sorted(labels.keys() - images.keys())
        parts = key_mismatch(
            unlabelled,
            orphans,
            lambda ids: f"image_id(s) {preview(ids)} of {images_file.name} have no class in {labels_file}",
            lambda ids: f"image_id(s) {preview(ids)} of {labels_file.name} are not in {images_file}",
        )
        if parts:
            raise CatalogError(f"{self.title}: " + "; ".join(parts))

        boxes: dict[int, tuple[int, list[str]]] = {}
        boxes_file = folder / "bounding_boxes.txt"
        if boxes_file.is_file():
            boxes = keyed_rows(boxes_file, ("image_id", "x", "y", "width", "height"))

        # First half of the class list trains: classes 1-100 of the published 200.
        ordered = sorted(class_names)
        train_classes = set(ordered[: len(ordered) // 2])
        rows: list[Row] = []
        for image_id, (lineno, (relative,)) in images.items():
            label_line, (class_text,) = labels[image_id]
            class_id = parse_int(labels_file, label_line, "class_id", class_text)
            if class_id not in class_names:
                raise CatalogError(f"{labels_file}:{label_line}: class_id {class_id} is not in {classes_file}")
            # The class folder is a second statement of the label; disagreement means the
            # annotation files do not belong together.
            folder_name = Path(relative).parts[0]
            if folder_name != class_names[class_id]:
                raise CatalogError(
                    f"{images_file}:{lineno}: {relative!r} is not in class folder {class_names[class_id]!r} "
                    f"although {labels_file.name}:{label_line} gives it class {class_id}"
                )
            meta = {"image_id": str(image_id), "class_name": class_names[class_id]}
            if image_id in boxes:
                # Kept as annotation, not as a catalog `bbox` (a crop): the published protocol
                # trains and tests on whole images.
                meta["box_xywh"] = " ".join(boxes[image_id][1])
            split = "train" if class_id in train_classes else "test"
            rows.append((split, relative, folder / "images" / relative, str(class_id), meta))
        return split_catalogs(self.title, self.splits, rows, images_file)


# ---------------------------------------------------------------------------------------------
# Cars196
_CARS_BBOX = ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2")


@register_dataset("cars196")
class Cars196(BenchmarkDataset):
    title = "Cars196"
    splits = ("train", "test")
    subdirs = ("",)
    annotation_files = ("cars_annos.mat",)

    def load(self, root: Path) -> dict[str, Catalog]:
        folder = self.locate(root)
        mat_file = folder / "cars_annos.mat"
        mat = load_mat(mat_file)
        annotations = mat.get("annotations")
        if not isinstance(annotations, np.ndarray) or annotations.dtype.names is None:
            found = ", ".join(k for k in mat if not k.startswith("__")) or "none"
            raise CatalogError(f"{mat_file}: no struct array 'annotations' (variables found: {found})")
        missing = [f for f in ("relative_im_path", "class") if f not in annotations.dtype.names]
        if missing:
            raise CatalogError(
                f"{mat_file}: 'annotations' lacks field(s) {', '.join(missing)} "
                f"(has {', '.join(annotations.dtype.names)})"
            )
        class_names = self._class_names(mat_file, mat.get("class_names"))
        records = annotations.ravel()

        parsed: list[tuple[int, str, int, dict[str, str]]] = []
        for number, record in enumerate(records, 1):
            relative = mat_text(record["relative_im_path"])
            if not relative:
                raise CatalogError(f"{mat_file}: annotations({number}).relative_im_path is not a non-empty string")
            class_id = mat_int(record["class"])
            if class_id is None or class_id < 1:
                raise CatalogError(f"{mat_file}: annotations({number}).class is not a positive integer")
            meta = {}
            if all(f in annotations.dtype.names for f in _CARS_BBOX):
                box = [mat_int(record[f]) for f in _CARS_BBOX]
                if any(v is None for v in box):
                    raise CatalogError(f"{mat_file}: annotations({number}) has a non-integer bbox field")
                meta["box_x1y1x2y2"] = " ".join(str(v) for v in box)  # annotation, not a crop (see CUB)
            if "test" in annotations.dtype.names:
                flag = mat_int(record["test"])
                if flag is not None:
                    meta["test_flag"] = str(flag)
            parsed.append((number, relative, class_id, meta))

        if class_names is not None:
            n_classes = len(class_names)
            for number, relative, class_id, meta in parsed:
                if class_id > n_classes:
                    raise CatalogError(
                        f"{mat_file}: annotations({number}) ({relative}) has class {class_id} "
                        f"but class_names lists only {n_classes} classes"
                    )
                meta["class_name"] = class_names[class_id - 1]
        else:
            n_classes = max((c for _, _, c, _ in parsed), default=0)
        # First half of the classes trains: 1-98 of the published 196 (the `test` flag is the
        # classification split and is deliberately not used).
        n_train = n_classes // 2
        rows: list[Row] = []
        for _, relative, class_id, meta in parsed:
            split = "train" if class_id <= n_train else "test"
            rows.append((split, relative, folder / relative, str(class_id), meta))
        return split_catalogs(self.title, self.splits, rows, mat_file)

    @staticmethod
    def _class_names(mat_file: Path, value: Any) -> list[str] | None:
        if value is None:
            return None
        names = []
        for number, cell in enumerate(np.asarray(value, dtype=object).ravel(), 1):
            text = mat_text(cell)
            if text is None:
                raise CatalogError(f"{mat_file}: class_names{{{number}}} is not a string")
            names.append(text)
        return names


# ---------------------------------------------------------------------------------------------
# Stanford Online Products

_SOP_HEADER = ("image_id", "class_id", "super_class_id", "path")


@register_dataset("sop")
class StanfordOnlineProducts(BenchmarkDataset):
    title = "Stanford Online Products"
    recall_ks = (1, 10, 100, 1000)
    splits = ("train", "test")
    subdirs = ("", "Stanford_Online_Products")
    annotation_files = ("Ebay_train.txt", "Ebay_test.txt")

    def load(self, root: Path) -> dict[str, Catalog]:
        folder = self.locate(root)
        files = {split: folder / name for split, name in zip(self.splits, self.annotation_files, strict=True)}
        rows: list[Row] = []
        class_lines: dict[str, dict[int, int]] = {split: {} for split in self.splits}
        for split, path in files.items():
            rows.extend(self._read_split(path, split, folder, class_lines[split]))
        shared = sorted(class_lines["train"].keys() & class_lines["test"].keys())
        if shared:
            c = shared[0]
            raise CatalogError(
                f"{self.title}: class_id(s) {preview(shared)} appear in both splits, e.g. {c} on "
                f"{files['train']}:{class_lines['train'][c]} and {files['test']}:{class_lines['test'][c]}; "
                "the splits must be class-disjoint"
            )
        return split_catalogs(self.title, self.splits, rows, files)

    @staticmethod
    def _read_split(path: Path, split: str, folder: Path, first_line_of_class: dict[int, int]) -> list[Row]:
        lines = read_lines(path)
        header_index = next((i for i, line in enumerate(lines) if line.strip()), None)
        if header_index is None or tuple(lines[header_index].split()) != _SOP_HEADER:
            raise CatalogError(f"{path}:{(header_index or 0) + 1}: expected the header line {' '.join(_SOP_HEADER)!r}")
        super_of_class: dict[int, int] = {}
        seen: dict[str, int] = {}
        rows: list[Row] = []
        for lineno, (image_text, class_text, super_text, relative) in annotation_rows(
            path, _SOP_HEADER, lines, header_index + 1
        ):
            image_id = parse_int(path, lineno, "image_id", image_text)
            class_id = parse_int(path, lineno, "class_id", class_text)
            super_id = parse_int(path, lineno, "super_class_id", super_text)
            if relative in seen:
                raise CatalogError(f"{path}:{lineno}: path {relative!r} already on line {seen[relative]}")
            seen[relative] = lineno
            # A product belongs to one category; two means the line's ids are shifted or wrong.
            if super_of_class.setdefault(class_id, super_id) != super_id:
                raise CatalogError(
                    f"{path}:{lineno}: class_id {class_id} has super_class_id {super_id} here but "
                    f"{super_of_class[class_id]} on line {first_line_of_class[class_id]}"
                )
            first_line_of_class.setdefault(class_id, lineno)
            category = Path(relative).parts[0]
            meta = {
                "image_id": str(image_id),
                "super_class_id": str(super_id),
                "super_class_name": category.removesuffix("_final"),
            }
            rows.append((split, relative, folder / relative, str(class_id), meta))
        return rows


# ---------------------------------------------------------------------------------------------
# In-shop Clothes Retrieval

_INSHOP_HEADER = ("image_name", "item_id", "evaluation_status")
_INSHOP_BUNDLE = "In-shop Clothes Retrieval Benchmark"


@register_dataset("inshop")
class InShop(BenchmarkDataset):
    title = "In-shop Clothes Retrieval"
    recall_ks = (1, 10, 20, 30, 40, 50)
    splits = ("train", "query", "gallery")
    subdirs = ("Eval", "", f"{_INSHOP_BUNDLE}/Eval", _INSHOP_BUNDLE)
    annotation_files = ("list_eval_partition.txt",)

    def load(self, root: Path) -> dict[str, Catalog]:
        eval_folder = self.locate(root)
        path = eval_folder / "list_eval_partition.txt"
        dataset_folder = eval_folder.parent if eval_folder.name == "Eval" else eval_folder
        # Paths in the file start with img/; the published download keeps img/ inside Img/.
        image_base = next(
            (b for b in (dataset_folder / "Img", dataset_folder) if (b / "img").is_dir()),
            dataset_folder / "Img" if eval_folder.name == "Eval" else dataset_folder,
        )

        lines = read_lines(path)
        content = [(i, line) for i, line in enumerate(lines) if line.strip()]
        if len(content) < 2:
            raise CatalogError(f"{path}: expected an image count line and a header line, the file is too short")
        (count_index, count_line), (header_index, header_line) = content[0], content[1]
        declared = parse_int(path, count_index + 1, "image count", count_line.strip())
        if tuple(header_line.split()) != _INSHOP_HEADER:
            raise CatalogError(f"{path}:{header_index + 1}: expected the header line {' '.join(_INSHOP_HEADER)!r}")

        rows: list[Row] = []
        seen: dict[str, int] = {}
        item_lines: dict[str, dict[str, int]] = {"train": {}, "test": {}}
        for lineno, (relative, item_id, status) in annotation_rows(path, _INSHOP_HEADER, lines, header_index + 1):
            if status not in self.splits:
                raise CatalogError(
                    f"{path}:{lineno}: evaluation_status {status!r} is not one of {', '.join(self.splits)}"
                )
            if relative in seen:
                raise CatalogError(f"{path}:{lineno}: image {relative!r} already on line {seen[relative]}")
            seen[relative] = lineno
            item_lines["train" if status == "train" else "test"].setdefault(item_id, lineno)
            parts = Path(relative).parts
            meta = {"category": "/".join(parts[1:3])} if len(parts) >= 5 and parts[0] == "img" else {}
            rows.append((status, relative, image_base / relative, item_id, meta))
        if len(rows) != declared:
            raise CatalogError(f"{path}:{count_index + 1}: the file says {declared} images but lists {len(rows)}")

        shared = sorted(item_lines["train"].keys() & item_lines["test"].keys())
        if shared:
            item = shared[0]
            raise CatalogError(
                f"{path}: item_id(s) {preview(shared)} are in train and in query/gallery, e.g. {item} on lines "
                f"{item_lines['train'][item]} and {item_lines['test'][item]}; the split must be item-disjoint"
            )
        catalogs = split_catalogs(self.title, self.splits, rows, path)
        # Not an error: the evaluation simply has no right answer for such a query.
        lonely = set(catalogs["query"].labels) - set(catalogs["gallery"].labels)
        if lonely:
            log.warning("%s: %d query item(s) have no gallery image, e.g. %s", path, len(lonely), min(lonely))
        return catalogs
