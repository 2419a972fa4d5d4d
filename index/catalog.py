"""Image catalogs: the table (`id, path, label`, optional metadata) every stage reads.

CSV, JSONL and Parquet files, and folder-per-class trees, all become one `Catalog`. Relative
paths are resolved against the catalog file's folder so a catalog and its images move together.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_COLUMNS = ("id", "path", "label")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".avif", ".heic", ".heif"}


class CatalogError(ValueError):
    """A catalog that cannot be used, with the reason and where."""


@dataclass
class Catalog:
    ids: list[str]
    paths: list[Path]
    labels: list[str]
    metadata: list[dict[str, str]] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.ids)
        if not self.metadata:
            self.metadata = [{} for _ in range(n)]
        if not (len(self.paths) == len(self.labels) == len(self.metadata) == n):
            raise CatalogError(f"{self.source}: columns have different lengths")
        seen: set[str] = set()
        for row, item_id in enumerate(self.ids):
            if item_id in seen:
                raise CatalogError(f"{self.source}: duplicate id {item_id!r} (row {row + 1})")
            seen.add(item_id)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def classes(self) -> list[str]:
        """Distinct labels in a stable order (numeric labels sort numerically)."""
        return sorted(set(self.labels), key=_label_sort_key)

    def label_codes(self, classes: Sequence[str] | None = None) -> list[int]:
        """Labels as integers 0..C-1 in the order of `classes` (default: `self.classes`)."""
        lookup = {c: i for i, c in enumerate(classes if classes is not None else self.classes)}
        try:
            return [lookup[label] for label in self.labels]
        except KeyError as exc:
            raise CatalogError(f"{self.source}: label {exc.args[0]!r} not in the class list") from exc

    def subset(self, rows: Iterable[int]) -> Catalog:
        rows = list(rows)
        return Catalog(
            ids=[self.ids[r] for r in rows],
            paths=[self.paths[r] for r in rows],
            labels=[self.labels[r] for r in rows],
            metadata=[self.metadata[r] for r in rows],
            source=self.source,
        )

    def with_classes(self, classes: Iterable[str]) -> Catalog:
        keep = set(classes)
        return self.subset(i for i, label in enumerate(self.labels) if label in keep)

    def check_files(self) -> list[int]:
        """Rows whose image file does not exist."""
        return [i for i, p in enumerate(self.paths) if not p.is_file()]

    def write(self, path: str | Path) -> Path:
        """Write as CSV (paths relative to the file's folder where possible), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = sorted({k for m in self.metadata for k in m} - set(REQUIRED_COLUMNS))
        tmp = path.with_name(f".{path.name}.tmp")
        base = path.parent.resolve()
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow([*REQUIRED_COLUMNS, *extra])
            for item_id, p, label, meta in zip(self.ids, self.paths, self.labels, self.metadata, strict=True):
                try:
                    shown = p.resolve().relative_to(base)
                except ValueError:
                    shown = p.resolve()
                writer.writerow([item_id, shown.as_posix(), label, *(meta.get(k, "") for k in extra)])
        tmp.replace(path)
        return path


def _label_sort_key(label: str) -> tuple[int, float, str]:
    # The label itself breaks ties ("1" vs "01") and NaN sorts as text, so the order never
    # depends on set iteration order (which changes from process to process).
    try:
        number = float(label)
    except ValueError:
        return (1, 0.0, label)
    if math.isnan(number):
        return (1, 0.0, label)
    return (0, number, label)


def read_catalog(path: str | Path) -> Catalog:
    """Read a catalog file (.csv, .jsonl/.ndjson, .parquet) or a folder-per-class tree."""
    path = Path(path)
    if not path.exists():
        raise CatalogError(f"catalog not found: {path}")
    if path.is_dir():
        return read_class_folders(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _read_csv(path)
    elif suffix in (".jsonl", ".ndjson"):
        rows = _read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(path)
    else:
        raise CatalogError(f"{path}: unknown catalog format {suffix!r} (use .csv, .jsonl, .parquet or a folder)")
    return _catalog_from_rows(rows, path)


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: tolerate an Excel BOM
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise CatalogError(f"{path}: empty file, expected a header with {REQUIRED_COLUMNS}")
        rows = list(reader)
    for number, row in enumerate(rows, 1):
        if None in row:  # DictReader files surplus fields under the key None
            raise CatalogError(f"{path}: row {number}: more fields than the header has columns")
    return rows


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CatalogError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise CatalogError(f"{path}:{lineno}: expected a JSON object per line")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow comes with ray[data]
        raise CatalogError("reading Parquet catalogs needs pyarrow") from exc
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise CatalogError(f"{path}: not a readable Parquet file: {exc}") from exc


def _catalog_from_rows(rows: list[dict], path: Path) -> Catalog:
    if not rows:
        raise CatalogError(f"{path}: catalog has no rows")
    missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
    if missing:
        raise CatalogError(
            f"{path}: missing column(s) {', '.join(missing)}; a catalog needs {', '.join(REQUIRED_COLUMNS)}"
        )
    base = path.parent
    ids, paths, labels, metadata = [], [], [], []
    for lineno, row in enumerate(rows, 2):
        values = {c: row.get(c) for c in REQUIRED_COLUMNS}
        empty = [c for c, v in values.items() if v is None or str(v).strip() == ""]
        if empty:
            raise CatalogError(f"{path}: row {lineno - 1}: empty {', '.join(empty)}")
        p = Path(str(values["path"]))
        ids.append(str(values["id"]))
        paths.append(p if p.is_absolute() else base / p)
        labels.append(str(values["label"]))
        metadata.append({k: str(v) for k, v in row.items() if k not in REQUIRED_COLUMNS and v is not None})
    return Catalog(ids, paths, labels, metadata, source=str(path))


def read_class_folders(root: str | Path) -> Catalog:
    """A folder-per-class tree: root/<label>/<image>; id = '<label>/<file name>'."""
    root = Path(root)
    ids, paths, labels = [], [], []
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for image in sorted(class_dir.iterdir()):
            if image.suffix.lower() in IMAGE_SUFFIXES and image.is_file():
                ids.append(f"{class_dir.name}/{image.name}")
                paths.append(image)
                labels.append(class_dir.name)
    if not ids:
        raise CatalogError(f"{root}: no images found in class sub-folders")
    return Catalog(ids, paths, labels, source=str(root))
