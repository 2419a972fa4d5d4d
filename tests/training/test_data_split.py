"""training.data.splits: class-disjoint splits and decoding catalogs into memory."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from core.data.catalog import Catalog, read_catalog
from core.data.preprocess import InputContract, load_image
from training.data.splits import class_disjoint_split, load_images, prepare_splits

CLASSES = [f"k{i:02d}" for i in range(20)]


def check_partition(split: dict[str, list[str]], classes: list[str]) -> None:
    train, val, test = (set(split[name]) for name in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    assert train | val | test == set(classes)
    assert sum(len(split[name]) for name in split) == len(classes)  # no duplicates


def test_first_half_rule_without_shuffle():
    split = class_disjoint_split(CLASSES, test_fraction=0.5, val_fraction=0.1)
    check_partition(split, CLASSES)
    assert split["test"] == CLASSES[10:]
    # Validation is carved from the training half, and both keep the catalog's order.
    assert sorted(split["train"] + split["val"]) == CLASSES[:10]
    assert split["train"] == [c for c in CLASSES[:10] if c not in split["val"]]
    assert len(split["val"]) == 1


def test_validation_classes_are_spread_over_the_training_classes():
    classes = [f"c{i:03d}" for i in range(100)]
    split = class_disjoint_split(classes, test_fraction=0.5, val_fraction=0.1)
    check_partition(split, classes)
    positions = [classes.index(c) for c in split["val"]]
    assert len(positions) == 5 and all(p < 50 for p in positions)
    assert min(positions) < 10 and max(positions) >= 40  # not all from one end


def test_fractions():
    split = class_disjoint_split(CLASSES, test_fraction=0.25, val_fraction=0.0)
    assert split["val"] == [] and split["test"] == CLASSES[15:] and split["train"] == CLASSES[:15]
    split = class_disjoint_split(CLASSES, test_fraction=0.5, val_fraction=0.01)
    assert len(split["val"]) == 1  # any positive fraction gives at least one class
    split = class_disjoint_split(CLASSES[:4], test_fraction=0.1, val_fraction=0.0)
    assert split["test"] == ["k03"]  # at least one test class


def test_shuffled_split_is_deterministic_and_class_disjoint():
    a = class_disjoint_split(CLASSES, shuffle_seed=3)
    assert a == class_disjoint_split(CLASSES, shuffle_seed=3)
    check_partition(a, CLASSES)
    assert a["test"] != CLASSES[10:]
    b = class_disjoint_split(CLASSES, shuffle_seed=4)
    check_partition(b, CLASSES)
    assert a != b
    assert len(a["test"]) == len(b["test"]) == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
    ],
)
def test_bad_fractions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        class_disjoint_split(CLASSES, **kwargs)


def test_too_few_classes():
    with pytest.raises(ValueError, match="at least 4 classes"):
        class_disjoint_split(CLASSES[:3])
    with pytest.raises(ValueError, match="too few training classes"):
        class_disjoint_split(CLASSES[:4], test_fraction=0.5, val_fraction=0.5)


def test_prepare_splits_writes_class_disjoint_catalogs(tmp_path):
    rows = ["id,path,label"] + [f"{c}-{j},img/{c}-{j}.png,{c}" for c in CLASSES for j in range(3)]
    (tmp_path / "cat.csv").write_text("\n".join(rows) + "\n")
    paths = prepare_splits(tmp_path / "cat.csv", tmp_path / "run", val_fraction=0.1)
    assert sorted(paths) == ["test", "train", "val"]
    splits = {name: read_catalog(path) for name, path in paths.items()}
    labels = {name: set(c.labels) for name, c in splits.items()}
    assert labels["test"] == set(CLASSES[10:])  # a user catalog keeps the first-half rule
    assert labels["train"] | labels["val"] == set(CLASSES[:10])
    assert not labels["train"] & labels["val"]
    assert sum(len(c) for c in splits.values()) == 60
    assert splits["train"].paths[0] == tmp_path / "img" / f"{splits['train'].ids[0]}.png"
    limited = prepare_splits(tmp_path / "cat.csv", tmp_path / "small", val_fraction=0.0, max_classes=8, max_per_class=2)
    small = {name: read_catalog(path) for name, path in limited.items()}
    assert sorted(small) == ["test", "train"]
    assert len({lab for c in small.values() for lab in c.labels}) == 8
    assert all(n == 2 for c in small.values() for n in np.unique(c.labels, return_counts=True)[1])


# --- load_images --------------------------------------------------------------------------------


@pytest.fixture
def image_catalog(tmp_path):
    ids, paths, labels = [], [], []
    for i in range(10):
        path = tmp_path / f"{i}.png"
        Image.new("L", (12, 10), 20 * i).save(path)
        ids.append(f"im{i}")
        paths.append(path)
        labels.append("b" if i % 2 else "a")
    return Catalog(ids, paths, labels, source="test-catalog")


CONTRACT = InputContract(height=8, width=8, channels=1)


def test_load_images_decodes_with_the_inference_contract(image_catalog):
    loaded = load_images(image_catalog, CONTRACT, threads=2)
    assert loaded.images.shape == (10, 1, 8, 8) and loaded.images.dtype == np.float32
    assert loaded.skipped == 0
    assert loaded.ids == image_catalog.ids
    assert loaded.classes == ["a", "b"]
    assert loaded.labels.tolist() == [0, 1] * 5 and loaded.labels.dtype == np.int64
    for i in (0, 7):
        np.testing.assert_array_equal(loaded.images[i], load_image(image_catalog.paths[i], CONTRACT))


def test_load_images_skips_and_counts_unreadable_files(image_catalog, caplog):
    image_catalog.paths[3].write_bytes(b"\x89PNG\r\n\x1a\n truncated garbage")
    with caplog.at_level(logging.WARNING, logger="training.data.splits"):
        loaded = load_images(image_catalog, CONTRACT, max_bad_fraction=0.1)
    assert loaded.skipped == 1
    assert loaded.ids == [f"im{i}" for i in range(10) if i != 3]
    assert len(loaded.images) == len(loaded.labels) == 9
    assert loaded.labels.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1]
    np.testing.assert_array_equal(loaded.images[3], load_image(image_catalog.paths[4], CONTRACT))
    assert "3.png" in caplog.text


def test_load_images_raises_above_the_bad_fraction(image_catalog):
    image_catalog.paths[3].write_bytes(b"")
    image_catalog.paths[5].unlink()  # a missing file is unreadable too
    with pytest.raises(ValueError, match="2 of 10 images in test-catalog are unreadable"):
        load_images(image_catalog, CONTRACT, max_bad_fraction=0.1)
    assert load_images(image_catalog, CONTRACT, max_bad_fraction=0.2).skipped == 2
    with pytest.raises(ValueError):
        load_images(image_catalog, CONTRACT)  # default allows 1%


def test_load_images_all_unreadable_allowed_gives_empty_arrays(image_catalog):
    for path in image_catalog.paths:
        path.write_bytes(b"nope")
    loaded = load_images(image_catalog, CONTRACT, max_bad_fraction=1.0)
    assert loaded.images.shape == (0, 1, 8, 8) and loaded.labels.shape == (0,)
    assert loaded.skipped == 10 and loaded.classes == []
