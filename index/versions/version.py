"""An index version opened: its manifest, faiss index, items table and exact vectors.

`<root>/versions/<version>/` holds `manifest.json`, `index.faiss`, `items.parquet` (and `ids.npy`,
its id lookup: an id is found without reading the table), `embeddings.npy` (the exact vectors
indexed, row for row), `filters.npz` when fields were declared filterable (their value → rows
structure, `index/search/filters.py`), and `deleted.npy` when rows were removed from an index
that cannot drop them (HNSW: its rows stay in the graph, masked at search
time until a rebuild compacts them). `index add` extends one, the quality
gate compares against one, and a server serves one; each opens it through `IndexVersion`.
The files are read when first used, so reading the manifest alone costs only the manifest.

A segmented version (schema 3, `index/versions/segments.py`) holds its rows in immutable segments,
`segments/<NNNNNN>/` each with its own index, vectors, items and filters, shared by hard link
with the versions that keep them, and one `deleted.npy` of its rows that no longer answer;
opened whole it is the same merged view as a sharded version's, one level down (a sharded
version's shards may each be segmented). Segments are shared between the versions open in one
process (`segment`): a server loading a version that keeps its live version's segments opens
only the new ones.

A sharded version (`index build --shards S`) holds those row files once per shard, in
`shards/<NNN>/`, and one manifest listing the shards (their rows, first global row and each
file's sha256). `shard(i)` opens one shard as a version of its own (what a shard server loads);
the version opened whole is the merged view — one faiss index over the shards' (faiss's own
merge of their top k) and their items, vectors, filters and tombstones concatenated in shard
order — so everything that searches one index searches a sharded version unchanged. Its shards
and segments are opened, and their folders checked, by its base `index.versions.parts.VersionParts`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import faiss
import numpy as np
import pyarrow as pa

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.artifacts.layout import ArtifactError
from core.data.items import (
    ItemTable,
    hashed_matches,
    id_array,
    joined_matches,
    labelled_items,
    read_lookup,
    string_hashes,
)
from core.retrieval.metrics import stable_key, stable_order
from core.retrieval.vectors import RowBlocks
from index.search.faiss_index import apply_search_params, load_index
from index.search.faiss_search import ExactRerank, searchable
from index.search.filters import FilterIndex
from index.search.grouping import Groups
from index.search.merge import MergedIndex
from index.versions.parts import VersionParts

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: it holds an array
class ItemLocation:
    """An indexed item as a query names it: its row, its stored vector, its value of the field
    asked (None: not asked, or the row has none) and its image's path."""

    row: int
    vector: np.ndarray
    value: str | None = None
    path: str = ""


@dataclasses.dataclass(frozen=True)
class SampledItem:
    """A row of a probe sample (`sampled_items`): its place in the ids' stable order, its row,
    id, label and path, whether it is live, and its item field's value (an item round's)."""

    key: tuple[bytes, str]
    row: int
    id: str
    label: str | None
    path: str
    live: bool
    value: str | None = None


def sampled_items(
    items: ItemTable, live: np.ndarray | None, size: int, groups: Groups | None = None, order: np.ndarray | None = None
) -> list[SampledItem]:
    """The first `size` rows in the ids' stable order (`core.retrieval.metrics.stable_order`; `order`, when
    already ranked): the same items whatever the rows' order. With `groups` (the item field's),
    the first `size` live rows whose item has another row, with their item. Rows of one catalog
    sampled in parts (shards) merge by `key` into the sample of the whole."""
    order = stable_order(items.ids) if order is None else order
    if groups is not None:
        codes = groups.codes
        eligible = (codes >= 0) & (np.diff(groups.offsets)[codes] > 1)
        if live is not None:
            eligible &= live
        order = order[eligible[order]]
    rows = order[:size].tolist()
    values = groups.values_of(rows) if groups is not None else [None] * len(rows)
    picked = []
    for row, value in zip(rows, values, strict=True):
        item_id = items.ids[row]
        live_row = live is None or bool(live[row])
        label, path = items.labels[row], items.paths[row]
        picked.append(SampledItem(stable_key(item_id), row, item_id, label, path, live_row, value))
    return picked


class IndexVersion(VersionParts):
    """One published index version. `index`, `items` and `vectors` are read on first use, each
    a missing or damaged file reported as an `ArtifactError` naming it; `load()` reads all three
    and checks they agree."""

    def __init__(
        self,
        directory: str | Path,
        manifest: IndexManifest | None = None,
        checksums: dict[str, str] | None = None,
        shard_label: str | None = None,
    ) -> None:
        """`checksums` and `shard_label`: a shard's (`shard(i)`), its files' sha256 as its
        version's manifest lists them, checked as each is first read, and how errors name it."""
        self.directory = Path(directory)
        self.manifest = manifest if manifest is not None else IndexManifest.read(self.directory)
        self._groups: dict[str, Groups] = {}
        self._groups_lock = threading.Lock()  # inference threads group queries at once
        self._checksums = checksums
        self._label = shard_label
        self._verified: set[str] = set()
        self._shards: dict[int, IndexVersion] = {}
        self._segments: dict[int, IndexVersion] = {}
        self._shards_lock = threading.Lock()

    def _path(self, name: str) -> Path:
        """The file `name` of this version; a shard's checked against its checksum when first
        asked for (ArtifactError naming the shard when it is missing or differs)."""
        path = self.directory / name
        if self._checksums is None or name in self._verified or name not in self._checksums:
            return path
        if not path.is_file():
            raise ArtifactError(f"{self._label}: {path} is missing")
        if artifacts.file_sha256(path) != self._checksums[name]:
            raise ArtifactError(f"{self._label}: {path} is damaged: its sha256 differs from the manifest's")
        self._verified.add(name)
        return path

    def _read(self, read: Callable[[Path], T], name: str, what: str) -> T:
        try:
            return _read_artifact(read, self._path(name), what)
        except ArtifactError as exc:
            raise self._named(exc) from exc

    def _named(self, exc: ArtifactError) -> ArtifactError:
        """`exc`, its message led by the shard's name (a shard's own error names it already)."""
        if self._label is None or str(exc).startswith(self._label):
            return exc
        return ArtifactError(f"{self._label}: {exc}")

    def _opened(self, directory: Path, manifest: IndexManifest, checksums: dict[str, str], label: str) -> IndexVersion:
        return IndexVersion(directory, manifest, checksums=checksums, shard_label=label)

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

    def read_index(self, mapped: bool = True) -> faiss.Index:
        """The faiss index, its search parameters applied: its codes memory-mapped from the file
        (`load_index`; read-only — versions are never extended, an add makes a segment), or with
        `mapped=False` a copy of its own that may be changed (emptied of its rows, to copy its
        training); a sharded version's: the shards' merged (`MergedIndex`); a segmented one's:
        its segments' merged, over their shared indexes."""
        if self.manifest.shards:
            return MergedIndex([shard.read_index(mapped) for shard in self._shard_versions()], self.shard_offsets)
        parts = self._parts()
        if parts is not None:
            segments, offsets = parts
            indexes = [segment.index if mapped else segment.read_index(mapped=False) for segment in segments]
            return indexes[0] if len(indexes) == 1 else MergedIndex(indexes, offsets)
        index = self._read(functools.partial(load_index, mapped=mapped), artifacts.INDEX_FILE, "a faiss index")
        if self.manifest.search_params:
            # A segment holds its version's factory, or Flat rows waiting for compaction (HNSW):
            # those take only the parameters that apply to them.
            apply_search_params(index, self.manifest.search_params, strict=not self._is_segment)
        return index

    @property
    def _is_segment(self) -> bool:
        return self.directory.parent.name == artifacts.SEGMENTS

    @functools.cached_property
    def index(self) -> faiss.Index:
        return self.read_index()

    @functools.cached_property
    def items(self) -> ItemTable:
        parts = self._parts()
        if parts is not None:
            # Chunked, not copied: the segments' strings and id lookups are shared with every version keeping them.
            return ItemTable.joined([part.items for part in parts[0]])
        return self._read(ItemTable.read, artifacts.ITEMS_FILE, "an items table")

    @functools.cached_property
    def vectors(self) -> np.ndarray:
        """The exact vectors, memory-mapped: what an index may only approximate (a sharded or
        segmented version's: its shards' or segments' maps read as one array, `RowBlocks`)."""
        parts = self._parts()
        if parts is not None:
            blocks = [part.vectors for part in parts[0]]
            flat = [b for block in blocks for b in (block.blocks if isinstance(block, RowBlocks) else [block])]
            return RowBlocks(flat)  # type: ignore[return-value]
        return self._read(_map_vectors, artifacts.EMBEDDINGS_FILE, "a float32 vector array")

    @functools.cached_property
    def filters(self) -> FilterIndex | None:
        """The filterable fields' value → rows structure; None when the version declares none."""
        if not self.manifest.filterable:
            return None
        parts = self._parts()
        if parts is not None:
            return FilterIndex.concat([part.filters for part in parts[0]], parts[1], len(self.items))  # type: ignore[misc]
        return self._read(FilterIndex.load, artifacts.FILTERS_FILE, "a filter structure")

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
        if self.manifest.shards:
            shards = self._shard_versions()
            parts = [shard.deleted + offset for shard, offset in zip(shards, self.shard_offsets, strict=True)]
            return np.concatenate(parts).astype(np.int64)
        path = self._path(artifacts.DELETED_FILE)
        if not path.is_file():
            return np.zeros(0, dtype=np.int64)
        return self._read(_read_rows, artifacts.DELETED_FILE, "a sorted array of row numbers")

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
        row = int(self.live_rows([item_id])[0])
        return None if row < 0 else row

    def live_rows(self, ids: Sequence[str] | pa.Array) -> np.ndarray:
        """Each id's live row, -1 where this version does not hold it (or it was deleted): one
        batched lookup (`core.data.items.hashed_matches`) through each part's written id lookup,
        whose items are read only for the rows whose id hashes alike — an add checking that its
        ids are new reads no items. A version written before the lookups were builds its lookup
        from its items."""
        ids = id_array(ids)
        found = np.full(len(ids), -1, dtype=np.int64)
        which, rows = self._matches(ids, string_hashes(ids))
        if not len(rows):
            return found
        if len(self.deleted):
            at = np.minimum(np.searchsorted(self.deleted, rows), len(self.deleted) - 1)
            alive = self.deleted[at] != rows
            which, rows = which[alive], rows[alive]
        first = np.lexsort((rows, which))  # each id's rows in row order; its first is live
        which, rows = which[first], rows[first]
        heads = np.unique(which, return_index=True)[1]
        found[which[heads]] = rows[heads]
        return found

    def _matches(self, ids: pa.Array, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every (position in `ids`, row) where the row — deleted or not — holds that id."""
        parts = self._parts()
        if parts is not None:
            return joined_matches((part._matches(ids, keys), int(offset)) for part, offset in zip(*parts, strict=True))
        if self._written_lookup is None:
            return self.items.matches(ids, keys)
        return hashed_matches(*self._written_lookup, keys, ids, lambda rows: self.items.ids.array.take(rows))

    @functools.cached_property
    def _written_lookup(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Its items' id lookup as written beside them (memory-mapped); None where there is none."""
        if not (self.directory / artifacts.ID_LOOKUP_FILE).is_file():
            return None
        order, hashes = self._read(read_lookup, artifacts.ID_LOOKUP_FILE, "an id lookup")
        if len(order) != self.manifest.size:
            path = self.directory / artifacts.ID_LOOKUP_FILE
            counted = f"{path} looks up {len(order)} rows; the manifest counts {self.manifest.size}"
            raise self._named(ArtifactError(counted))
        return order, hashes

    def locate(self, item_id: str, field: str | None = None) -> ItemLocation | None:
        """Where `item_id` lives: its row, its stored vector and its value of `field` (asked for an
        item query grouped by it); None when this version does not hold it."""
        row = self.row_of(item_id)
        if row is None:
            return None
        value = self.groups(field).values_of([row])[0] if field else None
        return ItemLocation(row, self.vector(row), value, self.items.paths[row])

    @property
    def labelled(self) -> bool:
        """Whether its rows have labels (all do or none: `core.data.items.ItemTable.labelled`); a
        sharded or segmented version's, from its first part with rows (the others' items unread),
        and an unread table's from its labels alone."""
        if "items" in self.__dict__:
            return self.items.labelled
        sharded = bool(self.manifest.shards)
        entries = self.manifest.shards if sharded else self.manifest.segments
        part = self.shard if sharded else self.segment
        if entries:  # a part's rows are labelled alike with the others'
            number = next((n for n, entry in enumerate(entries) if entry.rows), None)
            return True if number is None else part(number).labelled
        return self._read(labelled_items, artifacts.ITEMS_FILE, "an items table")

    def probe_sample(self, size: int, item_field: str | None = None) -> list[SampledItem]:
        """Its probe sample (`sampled_items`): the first `size` rows by id, or — with `item_field`
        — the first `size` live rows whose item has another row."""
        groups = self.groups(item_field) if item_field else None
        return sampled_items(self.items, self.live_mask, size, groups, self._stable_order)

    @functools.cached_property
    def _stable_order(self) -> np.ndarray:
        return stable_order(self.items.ids)

    def load(self, dim: int | None = None) -> IndexVersion:
        """Read index, items and vectors (in that order: the cheap checks first) and check that
        they hold the same rows, of the dimension `dim` when given (the model's). A sharded
        version's shards are checked first, each against the manifest (ArtifactError naming the
        shard); a shard's files against their checksums; a segmented version's segments, each
        as a shard is (ArtifactError naming the segment)."""
        try:
            if self.manifest.shards:
                self._check_shards(dim)
            elif self._checksums is not None:
                self._check_shard_files()
            if self.manifest.segments:
                self._check_segments(dim)
            return self._load(dim)
        except ArtifactError as exc:
            raise self._named(exc) from exc

    def _load(self, dim: int | None) -> IndexVersion:
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
