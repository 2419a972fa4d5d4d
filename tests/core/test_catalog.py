"""core.data.catalog: CSV/JSONL/Parquet catalogs and folder-per-class trees."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.data.catalog import Catalog, CatalogError, read_catalog, read_class_folders


def write_csv(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from a directory unrelated to the catalog, so cwd-relative resolution would fail."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# --- reading ----------------------------------------------------------------------------------


def test_csv_relative_paths_resolve_against_the_catalog_folder(tmp_path, elsewhere):
    folder = tmp_path / "data"
    catalog_path = write_csv(
        folder / "cat.csv",
        f"id,path,label,colour\na,img/a.png,cat,black\nb,{tmp_path / 'abs' / 'b.png'},dog,\n",
    )
    catalog = read_catalog(catalog_path)
    assert catalog.ids == ["a", "b"]
    assert catalog.labels == ["cat", "dog"]
    assert catalog.paths[0] == folder / "img" / "a.png"
    assert catalog.paths[1] == tmp_path / "abs" / "b.png"  # absolute paths are kept
    assert catalog.metadata == [{"colour": "black"}, {"colour": ""}]
    assert catalog.source == str(catalog_path)
    # Also when the catalog path itself is given relative to the current directory.
    relative = read_catalog(Path(os.path.relpath(catalog_path, elsewhere)))
    assert relative.paths[0].resolve() == (folder / "img" / "a.png").resolve()


def test_csv_with_excel_bom(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes("id,path,label\nx,x.png,1\n".encode("utf-8-sig"))
    assert read_catalog(path).ids == ["x"]


def test_jsonl_catalog(tmp_path, elsewhere):
    lines = [
        {"id": 1, "path": "a.png", "label": 3, "source": "web"},
        {"id": "2", "path": "sub/b.png", "label": "3", "extra": None},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:1]) + "\n\n" + json.dumps(lines[1]) + "\n")
    catalog = read_catalog(path)
    assert catalog.ids == ["1", "2"]  # ids and labels become strings
    assert catalog.labels == ["3", "3"]
    assert catalog.paths == [tmp_path / "a.png", tmp_path / "sub" / "b.png"]
    assert catalog.metadata == [{"source": "web"}, {}]  # None values dropped
    ndjson = tmp_path / "c.ndjson"
    ndjson.write_text(path.read_text())
    assert read_catalog(ndjson).ids == ["1", "2"]


def test_parquet_catalog(tmp_path, elsewhere):
    path = tmp_path / "c.parquet"
    pq.write_table(
        pa.table({"id": ["p", "q"], "path": ["p.png", "q.png"], "label": ["x", "y"], "w": [1, 2]}),
        path,
    )
    catalog = read_catalog(path)
    assert catalog.ids == ["p", "q"]
    assert catalog.paths == [tmp_path / "p.png", tmp_path / "q.png"]
    assert catalog.metadata == [{"w": "1"}, {"w": "2"}]


def test_folder_per_class_tree(tmp_path):
    root = tmp_path / "tree"
    for label, names in {"b": ["2.png", "1.JPG", "3.HEIC", "4.avif"], "a": ["z.jpeg"], "empty": []}.items():
        (root / label).mkdir(parents=True)
        for name in names:
            (root / label / name).write_bytes(b"")
    (root / "b" / "notes.txt").write_text("not an image")
    (root / "b" / "dir.png").mkdir()  # a directory with an image suffix is not an image
    catalog = read_catalog(root)
    assert catalog.ids == ["a/z.jpeg", "b/1.JPG", "b/2.png", "b/3.HEIC", "b/4.avif"]  # phones' formats too
    assert catalog.labels == ["a", "b", "b", "b", "b"]
    assert catalog.paths[:3] == [root / "a" / "z.jpeg", root / "b" / "1.JPG", root / "b" / "2.png"]
    assert read_class_folders(root).ids == catalog.ids


# --- errors -------------------------------------------------------------------------------------


def test_missing_catalog(tmp_path):
    with pytest.raises(CatalogError, match="not found"):
        read_catalog(tmp_path / "nope.csv")


def test_unknown_format(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("id,path,label\n")
    with pytest.raises(CatalogError, match="unknown catalog format '.txt'"):
        read_catalog(path)


def test_missing_columns_are_named(tmp_path):
    path = write_csv(tmp_path / "c.csv", "id,file,class\n1,a.png,x\n")
    with pytest.raises(CatalogError, match=r"missing column\(s\) path; a catalog needs id, path \(and label"):
        read_catalog(path)


def test_labels_are_optional_but_all_or_nothing(tmp_path):
    """Day one: a catalog with no label column (or an empty one) is a catalog; what needs
    labels names the file and what it needed them for."""
    for body in ("id,path\na,a.png\nb,b.png\n", "id,path,label\na,a.png,\nb,b.png,\n"):
        catalog = read_catalog(write_csv(tmp_path / "u.csv", body))
        assert catalog.ids == ["a", "b"] and catalog.labels is None and not catalog.labelled
        assert catalog.subset([1]).labels is None
        with pytest.raises(CatalogError, match=r"u.csv: no label column; training needs labelled images"):
            catalog.require_labels("training")
        with pytest.raises(CatalogError, match="no label column"):
            _ = catalog.classes
        back = read_catalog(catalog.write(tmp_path / "back.csv"))
        assert back.ids == catalog.ids and back.labels is None
        assert (tmp_path / "back.csv").read_text().splitlines()[0] == "id,path"
    (tmp_path / "u.jsonl").write_text('{"id": "a", "path": "a.png"}\n{"id": "b", "path": "b.png", "colour": "red"}\n')
    assert read_catalog(tmp_path / "u.jsonl").metadata == [{}, {"colour": "red"}]
    mixed = write_csv(tmp_path / "m.csv", "id,path,label\na,a.png,x\nb,b.png,\nc,c.png,\nd,d.png,y\n")
    with pytest.raises(
        CatalogError, match=r"m.csv: mixes labelled and unlabelled rows \(2 of 4 have no label: row 2, 3\)"
    ):
        read_catalog(mixed)


def test_a_plain_folder_of_images_is_an_unlabelled_catalog(tmp_path):
    root = tmp_path / "photos"
    root.mkdir()
    for name in ("b.jpg", "a.PNG", "notes.txt"):
        (root / name).write_bytes(b"")
    catalog = read_catalog(root)
    assert catalog.ids == ["a.PNG", "b.jpg"] and catalog.labels is None
    (root / "cats").mkdir()
    (root / "cats" / "c.jpg").write_bytes(b"")
    with pytest.raises(CatalogError, match=r"photos: mixes loose images \(2, e.g. a.PNG\) and class sub-folders"):
        read_catalog(root)


@pytest.mark.parametrize(
    "body, where",
    [
        ("a,a.png,x\nb,,y\n", "row 2: empty path"),
        ("a,a.png,x\n ,b.png,y\n", "row 2: empty id"),
        ("a,a.png,x\nb,b.png,\n", "mixes labelled and unlabelled rows"),
        ("a,a.png,x\nb,b.png\n", "mixes labelled and unlabelled rows"),  # short row
    ],
)
def test_empty_values(tmp_path, body, where):
    path = write_csv(tmp_path / "c.csv", "id,path,label\n" + body)
    with pytest.raises(CatalogError, match=where):
        read_catalog(path)


def test_row_with_surplus_fields(tmp_path):
    path = write_csv(tmp_path / "c.csv", "id,path,label\na,a.png,x\nb,b.png,y,oops\n")
    with pytest.raises(CatalogError, match="row 2: more fields"):
        read_catalog(path)


def test_duplicate_ids(tmp_path):
    path = write_csv(tmp_path / "c.csv", "id,path,label\na,a.png,x\nb,b.png,x\na,c.png,y\n")
    with pytest.raises(CatalogError, match="duplicate id 'a' \\(row 3\\)"):
        read_catalog(path)


def test_empty_files(tmp_path):
    with pytest.raises(CatalogError, match="empty file"):
        read_catalog(write_csv(tmp_path / "e.csv", ""))
    with pytest.raises(CatalogError, match="no rows"):
        read_catalog(write_csv(tmp_path / "h.csv", "id,path,label\n"))
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(CatalogError, match="no rows"):
        read_catalog(tmp_path / "e.jsonl")
    (tmp_path / "tree").mkdir()
    with pytest.raises(CatalogError, match="no images"):
        read_catalog(tmp_path / "tree")


def test_bad_json_line_reports_its_line_number(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "path": "a.png", "label": "x"}\n\n{"id": "b", "path": \n')
    with pytest.raises(CatalogError, match=r"c\.jsonl:3: invalid JSON"):
        read_catalog(path)
    path.write_text('{"id": "a", "path": "a.png", "label": "x"}\n[1, 2]\n')
    with pytest.raises(CatalogError, match=r":2: expected a JSON object"):
        read_catalog(path)


def test_bad_parquet_file(tmp_path):
    path = tmp_path / "c.parquet"
    path.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(CatalogError, match="not a readable Parquet file"):
        read_catalog(path)


def test_mismatched_column_lengths():
    with pytest.raises(CatalogError, match="different lengths"):
        Catalog(["a", "b"], [Path("a")], ["x", "y"])


# --- writing ----------------------------------------------------------------------------------


def test_write_round_trip(tmp_path, elsewhere):
    images = tmp_path / "images"
    outside = tmp_path / "outside" / "o.png"
    catalog = Catalog(
        ids=["1", "2", "3"],
        paths=[images / "a.png", images / "sub" / "b.png", outside],
        labels=["x", "y, with comma", 'q"uote'],
        metadata=[{"colour": "red"}, {"size": "3"}, {}],
        source="test",
    )
    path = catalog.write(tmp_path / "images" / "out.csv")
    assert path == tmp_path / "images" / "out.csv"
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["id", "path", "label", "colour", "size"]
    # Relative inside the catalog's folder, absolute outside it.
    assert [r[1] for r in rows[1:]] == ["a.png", "sub/b.png", outside.resolve().as_posix()]
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []

    back = read_catalog(path)
    assert back.ids == catalog.ids
    assert back.labels == catalog.labels
    assert [p.resolve() for p in back.paths] == [p.resolve() for p in catalog.paths]
    assert back.metadata == [
        {"colour": "red", "size": ""},
        {"colour": "", "size": "3"},
        {"colour": "", "size": ""},
    ]


def test_written_catalog_moves_with_its_images(tmp_path):
    root = tmp_path / "v1"
    catalog = Catalog(["a"], [root / "img" / "a.png"], ["x"])
    catalog.write(root / "cat.csv")
    root.rename(tmp_path / "v2")
    assert read_catalog(tmp_path / "v2" / "cat.csv").paths == [tmp_path / "v2" / "img" / "a.png"]


# --- labels and subsets -----------------------------------------------------------------------


def test_classes_sort_numeric_labels_numerically():
    catalog = Catalog([str(i) for i in range(5)], [Path("p")] * 5, ["10", "2", "b", "1", "a"])
    assert catalog.classes == ["1", "2", "10", "a", "b"]
    assert catalog.label_codes() == [2, 1, 4, 0, 3]
    assert catalog.label_codes(["b", "a", "10", "2", "1"]) == [2, 3, 0, 4, 1]
    with pytest.raises(CatalogError, match="label 'a' not in the class list"):
        catalog.label_codes(["1", "2", "10", "b"])


def test_class_order_does_not_depend_on_the_hash_seed():
    # Label codes must agree between processes (e.g. Ray workers), whose string hashes differ.
    code = (
        "from pathlib import Path; from core.data.catalog import Catalog; "
        "labels = ['nan', '3', '1', '01', 'b', 'a', '10', '2', '1.0', 'inf', 'NaN']; "
        "print(Catalog([str(i) for i in range(len(labels))], [Path('p')] * len(labels), labels)"
        ".classes)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3, 4, 5)
    }
    assert len(outputs) == 1, outputs


def test_subset_and_with_classes():
    catalog = Catalog(
        ["a", "b", "c", "d"],
        [Path(x) for x in "abcd"],
        ["x", "y", "x", "z"],
        [{"m": str(i)} for i in range(4)],
        source="s",
    )
    sub = catalog.subset([3, 0])
    assert sub.ids == ["d", "a"] and sub.labels == ["z", "x"]
    assert sub.paths == [Path("d"), Path("a")] and sub.metadata == [{"m": "3"}, {"m": "0"}]
    assert sub.source == "s"
    only = catalog.with_classes(["x", "z", "unknown"])
    assert only.ids == ["a", "c", "d"] and only.classes == ["x", "z"]
    assert len(catalog.with_classes([])) == 0
    # Subsets of a catalog with a new class list keep codes consistent with the full list.
    assert only.label_codes(catalog.classes) == [0, 0, 2]


def test_check_files(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    catalog = Catalog(["a", "b"], [tmp_path / "a.png", tmp_path / "b.png"], ["x", "x"])
    assert catalog.check_files() == [1]


def test_a_columns_rows_read_from_its_buffers_are_arrows_take():
    """`StringColumn.at_rows` (a search's hits described) gives what Arrow's take gives: sliced
    arrays, non-ASCII text, empty strings, an all-null column, nulls among values, chunks."""
    import numpy as np

    from core.data.items import ItemTable, StringColumn

    table = ItemTable(["a", "béta", "γγ", "", "x" * 100], None, ["p"] * 5, [{"k": "ü"}, {}, {}, {"a": "b"}, {}])
    rows = np.array([4, 1, 2, 0, 3, 1])
    for column in (table.ids, table.labels, table.metadata.text):
        assert column.at_rows(rows) == column.array.take(pa.array(rows)).to_pylist()
    assert table.labels.at_rows(rows) == [None] * 6
    sliced = StringColumn(pa.array(["a", "bb", "ccc", "dddd"], pa.large_string()).slice(1, 3))
    assert sliced.at_rows(np.array([2, 0])) == ["dddd", "bb"]
    chunked = StringColumn(pa.chunked_array([pa.array(["a"], pa.large_string()), pa.array(["b"], pa.large_string())]))
    assert chunked.at_rows(np.array([1, 0])) == ["b", "a"]
    assert StringColumn(pa.array(["a", None, "c"], pa.large_string())).at_rows(np.array([1, 2])) == [None, "c"]
