"""A benchmark's annotation files found and read, every line checked: the folder holding them,
lines split into exactly their columns, integer fields, rows keyed by id, MATLAB files (Cars196's
`cars_annos.mat`), and the rows grouped into one catalog per split. Each failure is a
`CatalogError` naming the file and line. The readers of the four benchmarks are
`training.data.datasets`'s."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.data.catalog import Catalog, CatalogError

# (split, id, image path, label, metadata): one image as every reader produces it.
Row = tuple[str, str, Path, str, dict[str, str]]


def check_root(title: str, root: Path) -> Path:
    if not root.exists():
        raise CatalogError(f"{title}: dataset root not found: {root}")
    if not root.is_dir():
        raise CatalogError(f"{title}: dataset root is not a folder: {root}")
    return root


def locate_annotations(title: str, root: Path, subdirs: Sequence[str], required: Sequence[str]) -> Path:
    check_root(title, root)
    candidates = [root / sub if sub else root for sub in subdirs]
    best: Path | None = None
    best_found = 0
    for folder in candidates:
        found = sum((folder / f).is_file() for f in required)
        if found == len(required):
            return folder
        if found > best_found:
            best, best_found = folder, found
    if best is not None:
        # Some of the files are there: name exactly the ones that are not.
        missing = [f for f in required if not (best / f).is_file()]
        raise CatalogError(
            f"{title}: annotation file(s) {', '.join(missing)} not found in {best} "
            f"(which has the dataset's other annotation files)"
        )
    looked = ", ".join(str(c) for c in candidates)
    raise CatalogError(f"{title}: annotation file(s) {', '.join(required)} not found; looked in {looked}")


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def annotation_rows(
    path: Path, columns: Sequence[str], lines: list[str] | None = None, start: int = 0
) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of every non-blank line from `start`, each with exactly len(columns) fields.

    The published files never have spaces inside a field, so a line with more fields is
    malformed rather than a name with a space in it.
    """
    lines = read_lines(path) if lines is None else lines
    for index in range(start, len(lines)):
        fields = lines[index].split()
        if not fields:
            continue
        if len(fields) != len(columns):
            raise CatalogError(
                f"{path}:{index + 1}: expected {len(columns)} fields ({' '.join(columns)}), "
                f"got {len(fields)}: {lines[index].strip()!r}"
            )
        yield index + 1, fields


def parse_int(path: Path, lineno: int, column: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CatalogError(f"{path}:{lineno}: {column} {value!r} is not an integer") from None


def keyed_rows(path: Path, columns: Sequence[str]) -> dict[int, tuple[int, list[str]]]:
    """Rows keyed by their integer first column: key -> (line number, other fields)."""
    table: dict[int, tuple[int, list[str]]] = {}
    for lineno, fields in annotation_rows(path, columns):
        key = parse_int(path, lineno, columns[0], fields[0])
        if key in table:
            raise CatalogError(f"{path}:{lineno}: {columns[0]} {key} already on line {table[key][0]}")
        table[key] = (lineno, fields[1:])
    return table


def split_catalogs(
    title: str,
    splits: Sequence[str],
    rows: list[Row],
    source: Path | dict[str, Path],
) -> dict[str, Catalog]:
    """Group (split, id, path, label, metadata) rows into one Catalog per split.

    `source` is the annotation file the rows came from, or one per split.
    """
    sources = source if isinstance(source, dict) else dict.fromkeys(splits, source)
    columns: dict[str, tuple[list, list, list, list]] = {s: ([], [], [], []) for s in splits}
    for split, item_id, path, label, meta in rows:
        ids, paths, labels, metadata = columns[split]
        ids.append(item_id)
        paths.append(path)
        labels.append(label)
        metadata.append(meta)
    empty = [s for s in splits if not columns[s][0]]
    if empty:
        # An empty split makes every later stage fail obscurely; say here which one and why.
        files = ", ".join(sorted({str(sources[s]) for s in empty}))
        raise CatalogError(f"{title}: {files} gives no images to split(s) {', '.join(empty)}")
    return {s: Catalog(*columns[s], source=f"{sources[s]} [{s}]") for s in splits}


def preview(values: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f" (+{len(values) - limit} more)" if len(values) > limit else "")


def load_mat(path: Path) -> dict[str, Any]:
    try:
        from scipy.io import loadmat
    except ImportError as exc:
        raise ImportError(
            f"reading Cars196's {path.name} needs scipy (pip install scipy); it is not installed"
        ) from exc
    try:
        return loadmat(str(path))
    except NotImplementedError as exc:  # MATLAB v7.3 (HDF5) files
        raise CatalogError(f"{path}: unsupported MATLAB file version ({exc}); expected the published v5 file") from exc
    except Exception as exc:  # noqa: BLE001 - scipy raises several types for a damaged file
        raise CatalogError(f"{path}: not a readable MATLAB file: {exc}") from exc


def mat_text(value: Any) -> str | None:
    array = np.asarray(value)
    if array.dtype.kind not in "US":
        return None
    return "".join(str(v) for v in array.ravel())


def mat_int(value: Any) -> int | None:
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "iuf":
        return None
    number = array.item()
    if isinstance(number, float) and not number.is_integer():  # also rejects NaN and inf
        return None
    return int(number)
