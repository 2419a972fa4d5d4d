"""Data sets rendered from installed packages (the glyph set, the icon set), cached on disk.

A set is rendered once into a staging directory published atomically, with a fingerprint of
what it was rendered from; it is reused while the fingerprint holds and every file is there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from core.artifacts.layout import staging_directory
from core.data.catalog import Catalog, read_catalog

CATALOG_NAME = "catalog.csv"
FINGERPRINT_NAME = "fingerprint"


def rendered_catalog(data_dir: str | Path, fingerprint: str, render: Callable[[Path], Catalog]) -> Path:
    """The catalog under `data_dir` if it was rendered with `fingerprint` and is whole; otherwise
    `render(staging)` writes the images into a staging directory and returns their catalog, and
    the directory replaces `data_dir`. Returns the catalog path."""
    data_dir = Path(data_dir)
    catalog_path = data_dir / CATALOG_NAME
    stamp = data_dir / FINGERPRINT_NAME
    if catalog_path.is_file() and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        if not read_catalog(catalog_path).check_files():
            return catalog_path
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(data_dir) as staging:
        render(staging).write(staging / CATALOG_NAME)
        (staging / FINGERPRINT_NAME).write_text(fingerprint + "\n")
    return catalog_path
