"""An index version opened: its manifest, faiss index, items table and exact vectors.

`<root>/versions/<version>/` holds `manifest.json`, `index.faiss`, `items.parquet` and
`embeddings.npy` (the exact vectors indexed, row for row), `filters.npz` when fields were
declared filterable (their value → rows structure, `index/filters.py`), and `deleted.npy` when rows were
removed from an index that cannot drop them (HNSW: its rows stay in the graph, masked at search
time until a rebuild compacts them). `index add` extends one, the quality
gate compares against one, and a server serves one; each opens it through `IndexVersion`.
The files are read when first used, so reading the manifest alone costs only the manifest.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import faiss
import numpy as np

from core import artifacts
from core.artifacts import ArtifactError
from core.items import ItemTable
from core.manifests import IndexManifest
from index.faiss_index import ExactRerank, apply_search_params, load_index, searchable
from index.filters import FilterIndex
from index.grouping import Groups

T = TypeVar("T")


class IndexVersion:
    """One published index version. `index`, `items` and `vectors` are read on first use, each
    a missing or damaged file reported as an `ArtifactError` naming it; `load()` reads all three
    and checks they agree."""

    def __init__(self, directory: str | Path, manifest: IndexManifest | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = manifest if manifest is not None else IndexManifest.read(self.directory)
        self._groups: dict[str, Groups] = {}
        self._groups_lock = threading.Lock()  # inference threads group queries at once

    @classmethod
    def open(cls, root: str | Path, version: str | None = None) -> IndexVersion:
        """`version` of the index root, or its live version when None."""
        return cls(artifacts.version_dir(root, version))

    @classmethod
    def live(cls, root: str | Path) -> IndexVersion | None:
        """The live version of `root`, or None when nothing has been published there."""
        return cls.open(root) if artifacts.current_version(root) else None

    @property
    def name(self) -> str:
        return self.directory.name

    def read_index(self) -> faiss.Index:
        """A fresh copy of the faiss index, its search parameters applied (`index add` extends it)."""
        index = _read_artifact(load_index, self.directory / artifacts.INDEX_FILE, "a faiss index")
        if self.manifest.search_params:
            apply_search_params(index, self.manifest.search_params)
        return index

    @functools.cached_property
    def index(self) -> faiss.Index:
        return self.read_index()

    @functools.cached_property
    def items(self) -> ItemTable:
        return _read_artifact(ItemTable.read, self.directory / artifacts.ITEMS_FILE, "an items table")

    @functools.cached_property
    def vectors(self) -> np.ndarray:
        """The exact vectors, memory-mapped: what an index may only approximate."""
        return _read_artifact(_map_vectors, self.directory / artifacts.EMBEDDINGS_FILE, "a float32 vector array")

    @functools.cached_property
    def filters(self) -> FilterIndex | None:
        """The filterable fields' value → rows structure; None when the version declares none."""
        if not self.manifest.filterable:
            return None
        return _read_artifact(FilterIndex.load, self.directory / artifacts.FILTERS_FILE, "a filter structure")

    def groups(self, name: str) -> Groups:
        """Rows grouped by the filterable field `name` (built once per version and field, from
        its value → rows structure). KeyError when the version does not declare it."""
        with self._groups_lock:
            found = self._groups.get(name)
            if found is None:
                field_rows = self.filters.fields[name] if self.filters is not None else None
                if field_rows is None:
                    raise KeyError(name)
                found = self._groups[name] = Groups.of(name, field_rows, len(self.items))
            return found

    @property
    def group_fields(self) -> list[str]:
        """What queries may group by: the declared fields (the item field among them)."""
        return list(self.manifest.filterable)

    @functools.cached_property
    def deleted(self) -> np.ndarray:
        """Rows removed but still in the index (sorted; empty for most versions): never answers."""
        path = self.directory / artifacts.DELETED_FILE
        if not path.is_file():
            return np.zeros(0, dtype=np.int64)
        return _read_artifact(_read_rows, path, "a sorted array of row numbers")

    @functools.cached_property
    def live_mask(self) -> np.ndarray | None:
        """A bool per row, False for deleted rows; None when no row is deleted."""
        if not len(self.deleted):
            return None
        mask = np.ones(len(self.items), dtype=bool)
        mask[self.deleted] = False
        return mask

    @property
    def size(self) -> int:
        """Items that answer: the manifest's `live_size` (`load` checks the files agree with it)."""
        return self.manifest.live_size

    def row_of(self, item_id: str) -> int | None:
        """The row of `item_id`, or None when it is not in this version (or was deleted)."""
        mask = self.live_mask
        return next((row for row in self.items.rows_of(item_id) if mask is None or mask[row]), None)

    def load(self, dim: int | None = None) -> IndexVersion:
        """Read index, items and vectors (in that order: the cheap checks first) and check that
        they hold the same rows, of the dimension `dim` when given (the model's)."""
        index, items, vectors, deleted, filters = self.index, self.items, self.vectors, self.deleted, self.filters
        if filters is not None and (filters.size != len(items) or set(filters.fields) != set(self.manifest.filterable)):
            raise ArtifactError(
                f"{self.directory / artifacts.FILTERS_FILE} holds fields {sorted(filters.fields)} over {filters.size} "
                f"rows; the manifest declares {sorted(self.manifest.filterable)} over {len(items)}"
            )
        if len(deleted) and (deleted[0] < 0 or deleted[-1] >= len(items)):
            raise ArtifactError(f"{self.directory / artifacts.DELETED_FILE} names rows outside 0..{len(items) - 1}")
        if (self.manifest.size, self.manifest.deleted_rows) != (len(items), len(deleted)):
            raise ArtifactError(
                f"{self.directory}: the manifest counts {self.manifest.size} rows, {self.manifest.deleted_rows} of "
                f"them deleted; the files hold {len(items)} rows, {len(deleted)} deleted"
            )
        dims = {index.d, vectors.shape[1]} | ({dim} if dim is not None else set())
        if not (len(items) == index.ntotal == len(vectors)) or len(dims) != 1:
            raise ArtifactError(
                f"{self.directory}: index has {index.ntotal} vectors of dim {index.d}, items table "
                f"{len(items)} rows, {artifacts.EMBEDDINGS_FILE} {len(vectors)}×{vectors.shape[1]}"
                + (f", model dim {dim}" if dim is not None else "")
            )
        return self

    def searchable(self) -> faiss.Index | ExactRerank:
        """The index as searched: re-ranked against the exact vectors when the manifest asks."""
        return searchable(self.index, self.manifest.search_params, self.vectors)

    def vector(self, row: int) -> np.ndarray:
        """Row `row`'s exact vector, a copy (not a view into the memory map)."""
        return np.array(self.vectors[row])

    def exact_scores(self, query: np.ndarray) -> np.ndarray:
        """Inner product of `query` with every row's exact vector: exact search, unranked
        (deleted rows score -inf: they never answer)."""
        scores = np.asarray(self.vectors @ query, dtype=np.float32)
        scores[self.deleted] = -np.inf
        return scores


def _map_vectors(path: Path) -> np.ndarray:
    vectors = np.load(path, mmap_mode="r")
    if vectors.dtype != np.float32 or vectors.ndim != 2:
        raise ValueError(f"holds {vectors.dtype} of shape {vectors.shape}, not float32 rows")
    return vectors


def _read_rows(path: Path) -> np.ndarray:
    rows = np.load(path)
    if rows.dtype != np.int64 or rows.ndim != 1 or (len(rows) > 1 and (np.diff(rows) <= 0).any()):
        raise ValueError(f"holds {rows.dtype} of shape {rows.shape}, not increasing int64 rows")
    return rows


def _read_artifact(read: Callable[[Path], T], path: Path, what: str) -> T:
    """`read(path)`, with a file that is missing, cut short or not what it should be reported
    as an `ArtifactError` naming it (faiss and Arrow raise their own types, worded for C++)."""
    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    try:
        return read(path)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the file is damaged
        detail = str(exc).rsplit("Error: ", 1)[-1].strip()
        raise ArtifactError(f"{path} is damaged: cannot be read as {what} ({detail})") from exc
