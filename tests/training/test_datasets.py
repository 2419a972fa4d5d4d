"""Benchmark readers (training/data/datasets.py) on miniature replicas in the published layouts.

The replicas are written by `write_replica` with real annotation files (Cars196: a real MATLAB
file), so each test exercises the same parsing as the real data would. Malformed inputs are
made by editing one line of a replica and must fail with a CatalogError naming the file.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from core.data.catalog import Catalog, CatalogError, read_catalog
from tests.support.datasets import write_replica
from training.data.datasets import (
    BenchmarkDataset,
    available_datasets,
    get_dataset,
    load_benchmark,
    register_dataset,
)

NAMES = ["cars196", "cub", "inshop", "sop"]
SPLITS = {
    "cub": ["train", "test"],
    "cars196": ["train", "test"],
    "sop": ["train", "test"],
    "inshop": ["train", "query", "gallery"],
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict[str, dict[str, Catalog]]:
    """Each benchmark's default replica, loaded once for the read-only checks."""
    base = tmp_path_factory.mktemp("replicas")
    return {name: load_benchmark(name, write_replica(name, base / name)) for name in NAMES}


def _small(name: str, root: Path) -> Path:
    """A fast replica to corrupt (4 classes/items)."""
    return write_replica(name, root / name, classes=4, images_per_class=2, seed=1)


def _edit_line(path: Path, lineno: int, text: str | None) -> None:
    """Replace line `lineno` (1-based) of `path` with `text`, or delete it when `text` is None."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if text is None:
        del lines[lineno - 1]
    else:
        lines[lineno - 1] = text
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


# --- registry -------------------------------------------------------------------------------


def test_registry_lists_the_four_benchmarks():
    assert available_datasets() == NAMES
    for name in NAMES:
        assert issubclass(get_dataset(name), BenchmarkDataset)
        assert get_dataset(name).name == name


def test_unknown_name_raises_listing_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'.*cars196, cub, inshop, sop"):
        load_benchmark("imagenet", tmp_path)
    with pytest.raises(ValueError, match="cars196, cub, inshop, sop"):
        write_replica("imagenet", tmp_path)


def test_register_dataset_rejects_non_readers_and_name_clashes():
    with pytest.raises(TypeError, match="BenchmarkDataset subclass"):
        register_dataset("not_a_reader")(dict)

    class Impostor(BenchmarkDataset):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_dataset("cub")(Impostor)
    assert "not_a_reader" not in available_datasets()
    assert get_dataset("cub") is not Impostor


# --- the standard splits --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_replica_loads_into_class_disjoint_catalogs(replicas, name):
    splits = replicas[name]
    assert list(splits) == SPLITS[name]
    for split, catalog in splits.items():
        assert isinstance(catalog, Catalog) and len(catalog) > 0, split
        assert catalog.check_files() == [], f"{split}: image files missing"
        assert all(isinstance(label, str) for label in catalog.labels)
        assert all(isinstance(v, str) for meta in catalog.metadata for v in meta.values())
    all_ids = [i for catalog in splits.values() for i in catalog.ids]
    assert len(all_ids) == len(set(all_ids)), "ids must be unique across splits"
    train = set(splits["train"].labels)
    for split in SPLITS[name][1:]:
        assert train.isdisjoint(splits[split].labels), f"train and {split} share classes"


def test_cub_uses_classes_1_to_100_for_training(replicas):
    splits = replicas["cub"]
    assert set(splits["train"].labels) == {str(c) for c in range(1, 101)}
    assert set(splits["test"].labels) == {str(c) for c in range(101, 201)}
    assert (len(splits["train"]), len(splits["test"])) == (200, 200)
    first = splits["train"]
    assert first.ids[0] == "001.Species_001/Species_001_0001_1.jpg"
    assert first.paths[0].parts[-4:-2] == ("CUB_200_2011", "images")
    assert first.metadata[0]["class_name"] == "001.Species_001"
    assert len(first.metadata[0]["box_xywh"].split()) == 4


def test_cars196_uses_classes_1_to_98_for_training_ignoring_the_test_flag(replicas):
    splits = replicas["cars196"]
    assert set(splits["train"].labels) == {str(c) for c in range(1, 99)}
    assert set(splits["test"].labels) == {str(c) for c in range(99, 197)}
    assert (len(splits["train"]), len(splits["test"])) == (196, 196)
    # The replica sets the classification `test` flag at random: both values land on both sides.
    for catalog in splits.values():
        assert {m["test_flag"] for m in catalog.metadata} == {"0", "1"}
    assert all(i.startswith("car_ims/") and i.endswith(".jpg") for i in splits["test"].ids)
    assert all(m["class_name"] and len(m["box_x1y1x2y2"].split()) == 4 for m in splits["test"].metadata)


def test_sop_splits_follow_the_ebay_files(replicas):
    splits = replicas["sop"]
    assert set(splits["train"].labels) == {str(c) for c in range(1, 13)}
    assert set(splits["test"].labels) == {str(c) for c in range(13, 25)}
    assert (len(splits["train"]), len(splits["test"])) == (24, 24)
    meta = splits["test"].metadata
    assert {m["super_class_id"] for m in meta} == {str(s) for s in range(1, 13)}
    assert {m["super_class_name"] for m in meta} >= {"bicycle", "coffee_maker", "toaster"}
    assert all(i.split("/")[0].endswith("_final") and i.endswith(".JPG") for i in splits["test"].ids)


def test_inshop_query_and_gallery_share_items_disjoint_from_train(replicas):
    splits = replicas["inshop"]
    query, gallery, train = (set(splits[s].labels) for s in ("query", "gallery", "train"))
    assert query == gallery and len(query) == 10
    assert len(train) == 10 and train.isdisjoint(query)
    assert (len(splits["train"]), len(splits["query"]), len(splits["gallery"])) == (40, 20, 20)
    assert all(label.startswith("id_") and len(label) == 11 for label in train)
    assert all(i.startswith("img/") for i in splits["query"].ids)
    assert splits["query"].metadata[0]["category"].split("/")[0] in ("MEN", "WOMEN")


def test_inshop_flat_layout_is_accepted(tmp_path):
    root = _small("inshop", tmp_path)
    published = load_benchmark("inshop", root)
    # Many DML code bases keep list_eval_partition.txt beside img/.
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.move(root / "Eval" / "list_eval_partition.txt", flat / "list_eval_partition.txt")
    shutil.move(root / "Img" / "img", flat / "img")
    splits = load_benchmark("inshop", flat)
    for split, catalog in splits.items():
        assert catalog.ids == published[split].ids
        assert catalog.check_files() == []


@pytest.mark.parametrize(("name", "inner"), [("cub", "CUB_200_2011"), ("sop", "Stanford_Online_Products")])
def test_root_may_be_the_dataset_folder_itself(tmp_path, name, inner):
    root = _small(name, tmp_path)
    outer = load_benchmark(name, root)
    inside = load_benchmark(name, root / inner)
    assert {s: c.ids for s, c in outer.items()} == {s: c.ids for s, c in inside.items()}


def test_missing_images_are_not_an_error(tmp_path):
    root = _small("cub", tmp_path)
    before = load_benchmark("cub", root)
    before["test"].paths[0].unlink()
    after = load_benchmark("cub", root)
    assert after["test"].ids == before["test"].ids
    assert after["test"].check_files() == [0]


@pytest.mark.parametrize("name", NAMES)
def test_catalog_written_to_csv_reads_back(replicas, tmp_path, name):
    for split, catalog in replicas[name].items():
        back = read_catalog(catalog.write(tmp_path / f"{split}.csv"))
        assert back.ids == catalog.ids
        assert back.labels == catalog.labels
        assert [p.resolve() for p in back.paths] == [p.resolve() for p in catalog.paths]
        assert back.metadata == catalog.metadata
        assert back.check_files() == []


# --- replicas -------------------------------------------------------------------------------


def test_replica_is_deterministic_and_never_overwrites(tmp_path):
    a = write_replica("sop", tmp_path / "a", classes=6, seed=3)
    b = write_replica("sop", tmp_path / "b", classes=6, seed=3)
    for name in ("Ebay_train.txt", "Ebay_test.txt", "Ebay_info.txt"):
        text = (a / "Stanford_Online_Products" / name).read_text()
        assert text == (b / "Stanford_Online_Products" / name).read_text()
    with pytest.raises(FileExistsError, match="Stanford_Online_Products"):
        write_replica("sop", a)


def test_replica_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="at least 2 classes"):
        write_replica("cub", tmp_path / "cub", classes=1)
    with pytest.raises(ValueError, match="at least 2 images per class"):
        write_replica("inshop", tmp_path / "inshop", images_per_class=1)


def test_replica_class_counts_are_configurable(tmp_path):
    splits = load_benchmark("cub", write_replica("cub", tmp_path / "cub", classes=10, images_per_class=3))
    assert set(splits["train"].labels) == {str(c) for c in range(1, 6)}
    assert len(splits["test"]) == 15


# --- malformed input ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_missing_root(tmp_path, name):
    with pytest.raises(CatalogError, match="dataset root not found"):
        load_benchmark(name, tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("name", "relative"),
    [
        ("cub", "CUB_200_2011/images.txt"),
        ("cub", "CUB_200_2011/image_class_labels.txt"),
        ("cub", "CUB_200_2011/classes.txt"),
        ("cars196", "cars_annos.mat"),
        ("sop", "Stanford_Online_Products/Ebay_train.txt"),
        ("sop", "Stanford_Online_Products/Ebay_test.txt"),
        ("inshop", "Eval/list_eval_partition.txt"),
    ],
)
def test_missing_annotation_file_is_named(tmp_path, name, relative):
    root = _small(name, tmp_path)
    missing = root / relative
    missing.unlink()
    with pytest.raises(CatalogError) as info:
        load_benchmark(name, root)
    message = str(info.value)
    assert missing.name in message
    # Where it looked: the dataset folder if the other files are there, else the root.
    assert str(missing.parent) in message or str(root) in message


def test_empty_folder_says_where_it_looked(tmp_path):
    with pytest.raises(CatalogError, match="images.txt.*looked in .*CUB_200_2011"):
        load_benchmark("cub", tmp_path)


CUB = "CUB_200_2011"
SOP = "Stanford_Online_Products"
INSHOP = "Eval/list_eval_partition.txt"


@pytest.mark.parametrize(
    ("name", "relative", "lineno", "text", "expected"),
    [
        # wrong field count, non-integer ids, unknown and inconsistent labels
        ("cub", f"{CUB}/images.txt", 3, "3", r"images.txt:3: expected 2 fields"),
        ("cub", f"{CUB}/image_class_labels.txt", 2, "2 two", r"image_class_labels.txt:2: class_id 'two'"),
        ("cub", f"{CUB}/image_class_labels.txt", 2, "2 999", r"image_class_labels.txt:2: class_id 999 is not in"),
        ("cub", f"{CUB}/image_class_labels.txt", 1, "1 2", r"images.txt:1: .* is not in class folder"),
        ("cub", f"{CUB}/image_class_labels.txt", 8, None, r"image_id\(s\) 8 of images.txt have no class in"),
        ("cub", f"{CUB}/images.txt", 2, "1 001.Species_001/x.jpg", r"images.txt:2: image_id 1 already on line 1"),
        ("cub", f"{CUB}/classes.txt", 1, "1 001.Species_001 extra", r"classes.txt:1: expected 2 fields"),
        ("cub", f"{CUB}/bounding_boxes.txt", 5, "5 1.0 2.0", r"bounding_boxes.txt:5: expected 5 fields"),
        ("sop", f"{SOP}/Ebay_train.txt", 1, "id class super path", r"Ebay_train.txt:1: expected the header line"),
        ("sop", f"{SOP}/Ebay_test.txt", 3, "6 x 2 cabinet_final/1_0.JPG", r"Ebay_test.txt:3: class_id 'x'"),
        ("sop", f"{SOP}/Ebay_test.txt", 2, "5 3 1", r"Ebay_test.txt:2: expected 4 fields"),
        ("sop", f"{SOP}/Ebay_test.txt", 2, "5 1 1 bicycle_final/9_0.JPG", r"class_id\(s\) 1 appear in both.*Ebay_test"),
        ("sop", f"{SOP}/Ebay_train.txt", 3, "2 1 7 bicycle_final/9_1.JPG", r"Ebay_train.txt:3: class_id 1 has super"),
        ("inshop", INSHOP, 1, "9", r"list_eval_partition.txt:1: the file says 9 images but lists 8"),
        ("inshop", INSHOP, 1, "many", r"list_eval_partition.txt:1: image count 'many'"),
        ("inshop", INSHOP, 2, "image_name item_id", r"list_eval_partition.txt:2: expected the header line"),
        ("inshop", INSHOP, 4, "img/MEN/Denim/id_1/01_1_front.jpg id_1 val", r"list_eval_partition.txt:4: evaluation_"),
        ("inshop", INSHOP, 5, "img/MEN/Denim/id_1/01_1_front.jpg id_1", r"list_eval_partition.txt:5: expected 3"),
    ],
)
def test_malformed_line_is_reported_with_file_and_line(tmp_path, name, relative, lineno, text, expected):
    root = _small(name, tmp_path)
    _edit_line(root / relative, lineno, text)
    with pytest.raises(CatalogError, match=expected):
        load_benchmark(name, root)


def test_inshop_item_in_train_and_query_is_rejected(tmp_path):
    root = _small("inshop", tmp_path)
    path = root / INSHOP
    rows = [line.split() for line in path.read_text().splitlines()[2:]]
    train_item = next(item for _, item, status in rows if status == "train")
    lineno, (image, _, _) = next((n + 3, r) for n, r in enumerate(rows) if r[2] == "query")
    _edit_line(path, lineno, f"{image} {train_item} query")
    with pytest.raises(CatalogError, match=rf"list_eval_partition.txt: item_id\(s\) {train_item} are in train"):
        load_benchmark("inshop", root)


def test_inshop_split_with_no_images_is_rejected(tmp_path):
    root = _small("inshop", tmp_path)
    path = root / INSHOP
    lines = path.read_text().splitlines()
    kept = [line for line in lines[2:] if not line.endswith(" gallery")]
    path.write_text("\n".join([str(len(kept)), lines[1], *kept]) + "\n")
    with pytest.raises(CatalogError, match="list_eval_partition.txt gives no images to split\\(s\\) gallery"):
        load_benchmark("inshop", root)


# --- Cars196's MATLAB file ------------------------------------------------------------------


def _rewrite_mat(path: Path, edit) -> None:
    from scipy.io import loadmat, savemat

    mat = {k: v for k, v in loadmat(str(path)).items() if not k.startswith("__")}
    edit(mat)
    savemat(str(path), mat)


def test_cars196_reads_the_struct_array_written_like_the_published_file(tmp_path):
    from scipy.io import loadmat

    root = _small("cars196", tmp_path)
    mat = loadmat(str(root / "cars_annos.mat"))
    annotations = mat["annotations"]
    assert annotations.shape == (1, 8)
    assert annotations.dtype.names == (
        "relative_im_path",
        "bbox_x1",
        "bbox_y1",
        "bbox_x2",
        "bbox_y2",
        "class",
        "test",
    )
    assert mat["class_names"].shape == (1, 4)
    splits = load_benchmark("cars196", root)
    assert set(splits["train"].labels) == {"1", "2"} and set(splits["test"].labels) == {"3", "4"}


def test_cars196_class_beyond_class_names_is_rejected(tmp_path):
    root = _small("cars196", tmp_path)

    def edit(mat):
        mat["annotations"][0, 2]["class"] = np.array([[9]], dtype=np.uint8)

    _rewrite_mat(root / "cars_annos.mat", edit)
    with pytest.raises(CatalogError, match=r"cars_annos.mat: annotations\(3\) .* class 9 but class_names lists only 4"):
        load_benchmark("cars196", root)


def test_cars196_bad_record_is_reported_with_its_number(tmp_path):
    root = _small("cars196", tmp_path)

    def edit(mat):
        mat["annotations"][0, 4]["relative_im_path"] = np.array([[1.0]])

    _rewrite_mat(root / "cars_annos.mat", edit)
    with pytest.raises(CatalogError, match=r"cars_annos.mat: annotations\(5\).relative_im_path"):
        load_benchmark("cars196", root)


def test_cars196_missing_variable_or_field_is_named(tmp_path):
    root = _small("cars196", tmp_path)
    mat_file = root / "cars_annos.mat"

    def drop_class_field(mat):
        old = mat["annotations"]
        keep = [n for n in old.dtype.names if n != "class"]
        new = np.zeros(old.shape, dtype=[(n, object) for n in keep])
        for n in keep:
            new[n] = old[n]
        mat["annotations"] = new

    _rewrite_mat(mat_file, drop_class_field)
    with pytest.raises(CatalogError, match="cars_annos.mat: 'annotations' lacks field\\(s\\) class"):
        load_benchmark("cars196", root)
    _rewrite_mat(mat_file, lambda mat: mat.pop("annotations"))
    with pytest.raises(CatalogError, match="cars_annos.mat: no struct array 'annotations'.*class_names"):
        load_benchmark("cars196", root)


def test_cars196_unreadable_mat_file(tmp_path):
    root = _small("cars196", tmp_path)
    (root / "cars_annos.mat").write_bytes(b"not a MATLAB file")
    with pytest.raises(CatalogError, match="cars_annos.mat: not a readable MATLAB file"):
        load_benchmark("cars196", root)


def test_cars196_without_scipy_names_the_package(tmp_path, monkeypatch):
    root = _small("cars196", tmp_path)
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # makes `from scipy.io import ...` fail
    with pytest.raises(ImportError, match="needs scipy"):
        load_benchmark("cars196", root)
