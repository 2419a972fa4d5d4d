"""Image catalogs: the table (`id, path`, optional `label`, optional metadata) every stage reads.

CSV, JSONL and Parquet files, folder-per-class trees and plain folders of images all become one
`Catalog`. Relative paths are resolved against the catalog file's folder so a catalog and its
images move together. Labels are all or nothing: a catalog without them can be indexed and
searched (day one, a folder of photos), and what needs them — training, probe Recall@K — says so.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_COLUMNS = ("id", "path")
LABEL = "label"
COLUMNS = (*REQUIRED_COLUMNS, LABEL)
ITEM_COLUMN = "item"  # the item a row's image shows (a product's photos): answers can group by it
# A row's region of interest, "x,y,width,height" in pixels of the upright image (a product
# detector's box): the row is embedded from that crop (core.data.preprocess.Region).
BBOX_COLUMN = "bbox"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".avif", ".heic", ".heif"}


class CatalogError(ValueError):
    """A catalog that cannot be used, with the reason and where."""


@dataclass
class Catalog:
    ids: list[str]
    paths: list[Path]
    labels: list[str] | None  # None: an unlabelled catalog
    metadata: list[dict[str, str]] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.ids)
        if not self.metadata:
            self.metadata = [{} for _ in range(n)]
        if not (len(self.paths) == len(self.metadata) == n) or (self.labels is not None and len(self.labels) != n):
            raise CatalogError(f"{self.source}: columns have different lengths")
        seen: set[str] = set()
        for row, item_id in enumerate(self.ids):
            if item_id in seen:
                raise CatalogError(f"{self.source}: duplicate id {item_id!r} (row {row + 1})")
            seen.add(item_id)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def labelled(self) -> bool:
        return self.labels is not None

    def require_labels(self, purpose: str) -> list[str]:
        """The labels, or a CatalogError naming the file and what needed them."""
        if self.labels is None:
            raise CatalogError(f"{self.source}: no {LABEL} column; {purpose} needs labelled images")
        return self.labels

    @property
    def classes(self) -> list[str]:
        """Distinct labels in a stable order (numeric labels sort numerically)."""
        return sorted(set(self.require_labels("a class list")), key=_label_sort_key)

    def label_codes(self, classes: Sequence[str] | None = None) -> list[int]:
        """Labels as integers 0..C-1 in the order of `classes` (default: `self.classes`)."""
        lookup = {c: i for i, c in enumerate(classes if classes is not None else self.classes)}
        try:
            return [lookup[label] for label in self.require_labels("class codes")]
        except KeyError as exc:
            raise CatalogError(f"{self.source}: label {exc.args[0]!r} not in the class list") from exc

    def subset(self, rows: Iterable[int]) -> Catalog:
        rows = list(rows)
        return Catalog(
            ids=[self.ids[r] for r in rows],
            paths=[self.paths[r] for r in rows],
            labels=None if self.labels is None else [self.labels[r] for r in rows],
            metadata=[self.metadata[r] for r in rows],
            source=self.source,
        )

    def with_classes(self, classes: Iterable[str]) -> Catalog:
        keep = set(classes)
        return self.subset(i for i, label in enumerate(self.require_labels("a class subset")) if label in keep)

    @property
    def regions(self) -> list[tuple[float, float, float, float] | None]:
        """Each row's bbox (pixels of the upright image), None where it has none: embed that crop."""
        return [parse_bbox(m[BBOX_COLUMN]) if m.get(BBOX_COLUMN) else None for m in self.metadata]

    def check_files(self) -> list[int]:
        """Rows whose image file does not exist."""
        return [i for i, p in enumerate(self.paths) if not p.is_file()]

    def write(self, path: str | Path) -> Path:
        """Write as CSV (paths relative to the file's folder where possible), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = sorted({k for m in self.metadata for k in m} - set(COLUMNS))
        header = [*REQUIRED_COLUMNS, *([LABEL] if self.labels is not None else [])]
        tmp = path.with_name(f".{path.name}.tmp")
        base = path.parent.resolve()
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow([*header, *extra])
            labels = self.labels if self.labels is not None else [None] * len(self)
            for item_id, p, label, meta in zip(self.ids, self.paths, labels, self.metadata, strict=True):
                try:
                    shown = p.resolve().relative_to(base)
                except ValueError:
                    shown = p.resolve()
                fields = [item_id, shown.as_posix(), *([label] if label is not None else [])]
                writer.writerow([*fields, *(meta.get(k, "") for k in extra)])
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
            raise CatalogError(f"{path}: empty file, expected a header with {', '.join(REQUIRED_COLUMNS)}[, {LABEL}]")
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


def _blank(value: object) -> bool:
    return value is None or str(value).strip() == ""


def _catalog_from_rows(rows: list[dict], path: Path) -> Catalog:
    if not rows:
        raise CatalogError(f"{path}: catalog has no rows")
    missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
    if missing:
        raise CatalogError(
            f"{path}: missing column(s) {', '.join(missing)}; a catalog needs "
            f"{', '.join(REQUIRED_COLUMNS)} (and {LABEL} where classes are known)"
        )
    unlabelled = [number for number, row in enumerate(rows, 1) if _blank(row.get(LABEL))]
    labelled = len(unlabelled) < len(rows)
    if labelled and unlabelled:
        shown = ", ".join(map(str, unlabelled[:5])) + (" ..." if len(unlabelled) > 5 else "")
        raise CatalogError(
            f"{path}: mixes labelled and unlabelled rows ({len(unlabelled)} of {len(rows)} have no "
            f"{LABEL}: row {shown}); label every row or leave the {LABEL} column out"
        )
    _check_bboxes(rows, path)
    base = path.parent
    ids, paths, labels, metadata = [], [], [], []
    for number, row in enumerate(rows, 1):
        empty = [c for c in REQUIRED_COLUMNS if _blank(row.get(c))]
        if empty:
            raise CatalogError(f"{path}: row {number}: empty {', '.join(empty)}")
        p = Path(str(row["path"]))
        ids.append(str(row["id"]))
        paths.append(p if p.is_absolute() else base / p)
        if labelled:
            labels.append(str(row[LABEL]))
        metadata.append({k: str(v) for k, v in row.items() if k not in COLUMNS and v is not None})
    return Catalog(ids, paths, labels if labelled else None, metadata, source=str(path))


def parse_bbox(text: str) -> tuple[float, float, float, float]:
    """ "x,y,width,height" (commas or spaces; a JSON list too) → four numbers: ValueError unless
    they are four finite numbers, x and y at least 0, width and height above 0."""
    parts = str(text).strip().strip("[]").replace(",", " ").split()
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{text!r} is not four numbers x,y,width,height") from None
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{text!r} is not four numbers x,y,width,height")
    if values[0] < 0 or values[1] < 0 or values[2] <= 0 or values[3] <= 0:
        raise ValueError(f"{text!r}: x and y must be at least 0, width and height above 0")
    return values  # type: ignore[return-value]


def _check_bboxes(rows: list[dict], path: Path) -> None:
    """A bbox column's values all parse (rows without one use the whole image); else the rows
    that do not are named, as mixed labels are."""
    bad = []
    for number, row in enumerate(rows, 1):
        if not _blank(row.get(BBOX_COLUMN)):
            try:
                parse_bbox(str(row[BBOX_COLUMN]))
            except ValueError as exc:
                bad.append((number, str(exc)))
    if bad:
        shown = "; ".join(f"row {n}: {why}" for n, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise CatalogError(f"{path}: {len(bad)} row(s) with a bad {BBOX_COLUMN} ({shown})")


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def read_class_folders(root: str | Path) -> Catalog:
    """A folder-per-class tree, root/<label>/<image> (id '<label>/<file name>'), or a plain
    folder of images, root/<image> (id '<file name>', no labels)."""
    root = Path(root)
    loose = _images_in(root)
    ids, paths, labels = [], [], []
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for image in _images_in(class_dir):
            ids.append(f"{class_dir.name}/{image.name}")
            paths.append(image)
            labels.append(class_dir.name)
    if loose and ids:
        raise CatalogError(
            f"{root}: mixes loose images ({len(loose)}, e.g. {loose[0].name}) and class sub-folders "
            f"({len(ids)} images): move the loose ones into a class folder, or the class folders' out"
        )
    if loose:
        return Catalog([p.name for p in loose], loose, None, source=str(root))
    if not ids:
        raise CatalogError(f"{root}: no images found, neither in the folder nor in class sub-folders")
    return Catalog(ids, paths, labels, source=str(root))


def read_probe_catalog(path: str | Path) -> Catalog:
    """A `--probe-catalog`: held-out labelled images whose Recall@K the build and the server
    measure (CatalogError when it has no labels)."""
    probe = read_catalog(path)
    probe.require_labels("--probe-catalog (Recall@K of its images)")
    return probe
