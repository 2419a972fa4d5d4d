"""The items table of an index version: row → id, label, path, metadata (Parquet).

A server holds the table of every version it serves, reloaded each time the catalog changes, so
the table is a few Arrow buffers and two NumPy arrays rather than a Python object per row: at a
million items a list of strings and a dict from id to row cost ~200 MB of small objects, and
small objects allocated between requests are what keeps a reloaded server's heap from shrinking
(freed pairs leave pages pinned by the survivors). Rows are read one at a time (`ids[row]`),
and an id is found through a sorted array of 64-bit hashes of the ids.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

COLUMNS = ("id", "label", "path", "metadata")
_HASH_BASE = np.uint64(0x100000001B3)  # the FNV prime: odd, so powers never collapse to 0 mod 2**64


class StringColumn(Sequence[str]):
    """A read-only sequence of str over an Arrow string array (one buffer, not N objects);
    a null reads as None (the labels of an unlabelled catalog)."""

    def __init__(self, array: pa.Array | pa.ChunkedArray) -> None:
        # Chunks are kept, not joined: a segmented version's table is its segments' tables side
        # by side, so a server holding two versions that share segments holds their strings once.
        if isinstance(array, pa.ChunkedArray) and array.num_chunks == 1:
            array = array.chunk(0)
        self.array = array.cast(pa.large_string()) if array.type != pa.large_string() else array

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, row: int) -> str: ...
    @overload
    def __getitem__(self, row: slice) -> list[str]: ...
    def __getitem__(self, row):
        if isinstance(row, slice):
            return self.array[row].to_pylist()
        return self.array[int(row)].as_py()

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self.array), 65536):
            yield from self.array[start : start + 65536].to_pylist()

    def at_rows(self, rows: np.ndarray) -> list[str | None]:
        """The strings of `rows`, in their order: a search's few hits read straight from the
        array's offsets and bytes (an Arrow take and its list cost ~10 µs a column, this ~1 µs
        for ten rows); a column with nulls or in chunks goes through Arrow's take."""
        views = self._views
        if views is None:
            return self.array.take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()
        offsets, data = views
        if data is None:  # every row null (an unlabelled catalog's labels)
            return [None] * len(rows)
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = offsets[rows].tolist(), offsets[rows + 1].tolist()
        return [str(data[a:b], "utf-8") for a, b in zip(starts, ends, strict=True)]

    @functools.cached_property
    def _views(self) -> tuple[np.ndarray, memoryview | None] | None:
        """(offsets, bytes) of a single-chunk array without nulls (no bytes: all null), zero-copy
        over its buffers (memory-mapped ones stay on disk until read); None otherwise."""
        array = self.array
        if isinstance(array, pa.ChunkedArray):
            return None
        if array.null_count == len(array):
            return np.zeros(len(array) + 1, dtype=np.int64), None
        if array.null_count:
            return None
        _, offsets, data = array.buffers()
        return np.frombuffer(offsets, dtype=np.int64)[array.offset : array.offset + len(array) + 1], memoryview(data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringColumn):
            return _chunked(self.array).equals(_chunked(other.array))
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:  # a column is compared by value and never used as a key
        raise TypeError("unhashable type: 'StringColumn'")

    def __repr__(self) -> str:
        return f"StringColumn({len(self)} rows)"


class MetadataColumn(Sequence[dict[str, str]]):
    """Row metadata kept as its JSON text; a row's dict is parsed when it is read."""

    def __init__(self, text: StringColumn) -> None:
        self.text = text

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [json.loads(t) for t in self.text[row]]
        return json.loads(self.text[row])

    def __iter__(self) -> Iterator[dict[str, str]]:
        return (json.loads(t) for t in self.text)


def _chunked(array: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    return array if isinstance(array, pa.ChunkedArray) else pa.chunked_array([array])


def string_hashes(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit polynomial hash of every string in an Arrow (large_)string array, computed over
    its data buffer without making Python strings (collisions are possible; callers compare)."""
    if isinstance(array, pa.ChunkedArray):
        parts = [string_hashes(chunk) for chunk in array.chunks]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
    array = array.cast(pa.large_string())
    n = len(array)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    if array.null_count:
        raise ValueError("string_hashes: the array has nulls")
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[array.offset : array.offset + n + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0] : offsets[-1]] if data_buf else np.empty(0, np.uint8)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    hashes = lengths.astype(np.uint64)
    if len(data):
        position = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        powers = np.cumprod(np.full(int(lengths.max()) + 1, _HASH_BASE, dtype=np.uint64))
        with np.errstate(over="ignore"):
            terms = (data.astype(np.uint64) + np.uint64(1)) * powers[position]
        nonempty = lengths > 0
        hashes[nonempty] += np.add.reduceat(terms, offsets[:-1][nonempty])
    return hashes


def id_lookup(ids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """id → rows: the rows in the order of their ids' hashes (a stable sort: equal hashes in row
    order), and those hashes sorted — 16 bytes a row."""
    hashes = string_hashes(ids)
    order = np.argsort(hashes, kind="stable")
    return order, hashes[order]


def read_lookup(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A lookup `ItemTable.write_lookup` wrote, memory-mapped: (order, sorted hashes)."""
    stored = np.load(path, mmap_mode="r")
    if stored.ndim != 2 or stored.shape[0] != 2 or stored.dtype != np.uint64:
        raise ValueError(f"an id lookup is a 2 × rows uint64 array, not {stored.dtype} of shape {stored.shape}")
    return stored[1], stored[0]


def labelled_items(path: str | Path) -> bool:
    """Whether the rows of the items table written at `path` have labels, reading its labels alone."""
    return pq.read_table(str(path), columns=["label"]).column("label").null_count == 0


def id_array(ids: Sequence[str] | pa.Array) -> pa.Array:
    """Ids as the Arrow (large_)string array the batched lookups take."""
    return ids if isinstance(ids, pa.Array) else pa.array(list(ids), type=pa.large_string())


NO_MATCHES = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))  # read-only: shared by every miss
NO_MATCHES[0].flags.writeable = NO_MATCHES[1].flags.writeable = False


def joined_matches(parts: Iterable[tuple[tuple[np.ndarray, np.ndarray], int]]) -> tuple[np.ndarray, np.ndarray]:
    """The matches of a whole made of parts, from each part's matches and its first row: the
    parts in row order keep each id's rows in row order."""
    found = [(which, rows + offset) for (which, rows), offset in parts if len(rows)]
    if not found:
        return NO_MATCHES
    return np.concatenate([which for which, _ in found]), np.concatenate([rows for _, rows in found])


def hashed_matches(
    order: np.ndarray, hashes: np.ndarray, keys: np.ndarray, ids: pa.Array, ids_at: Callable[[np.ndarray], pa.Array]
) -> tuple[np.ndarray, np.ndarray]:
    """Every (position in `ids`, row) where the row's id is that id, through a lookup (`id_lookup`):
    `keys` are the ids' `string_hashes`, and `ids_at(rows)` reads the ids of the rows whose hash
    matched — only those, and only when any did (a collision's row is dropped there). An id's
    rows come in row order. One numpy pass for a whole batch: a catalog re-sent whole looked up
    its ids one Python call an id a part."""
    lo, hi = hashes.searchsorted(keys, side="left"), hashes.searchsorted(keys, side="right")
    counts = hi - lo
    total = int(counts.sum())
    if not total:
        return NO_MATCHES
    which = np.repeat(np.arange(len(keys), dtype=np.int64), counts)
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    rows = np.asarray(order[starts + np.arange(total)], dtype=np.int64)
    same = np.asarray(pc.equal(ids_at(rows), ids.take(pa.array(which))), dtype=bool)
    return which[same], rows[same]


class ItemTable:
    """Row → id, label, path, metadata of one index version, and id → row. The label column
    is all nulls when the catalog had no labels (`labelled` is False)."""

    def __init__(
        self,
        ids: Iterable[str],
        labels: Iterable[str] | None,
        paths: Iterable[str],
        metadata: Iterable[dict[str, str]],
    ) -> None:
        ids = list(ids)
        self._set(
            pa.table(
                {
                    "id": pa.array(ids, type=pa.large_string()),
                    "label": pa.array(list(labels) if labels is not None else [None] * len(ids), pa.large_string()),
                    "path": pa.array(list(paths), type=pa.large_string()),
                    "metadata": pa.array(
                        [json.dumps(m, ensure_ascii=False, sort_keys=True) for m in metadata], type=pa.large_string()
                    ),
                }
            )
        )

    def _set(self, table: pa.Table, parts: Sequence[tuple[ItemTable, int]] = ()) -> None:
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"items table has no {', '.join(missing)} column")
        self.ids = StringColumn(table.column("id"))
        self.labels = StringColumn(table.column("label"))
        self.paths = StringColumn(table.column("path"))
        self.metadata = MetadataColumn(StringColumn(table.column("metadata")))
        if self.ids.array.null_count:
            raise ValueError("items table has rows without an id")
        self.labelled = self.labels.array.null_count == 0
        self._parts = list(parts)

    @functools.cached_property
    def lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """id → rows (`id_lookup`), made on the first lookup: a table that is only read row by
        row never pays for it."""
        return id_lookup(self.ids.array)

    @classmethod
    def joined(cls, parts: Sequence[ItemTable]) -> ItemTable:
        """The rows of `parts`, one after another, sharing their strings and their id lookups: a
        segmented version's items, whose reload builds nothing for the segments it keeps."""
        items = cls.__new__(cls)
        offsets = np.cumsum([0] + [len(part) for part in parts[:-1]]).tolist()
        items._set(pa.concat_tables([part.to_arrow() for part in parts]), list(zip(parts, offsets, strict=True)))
        return items

    @classmethod
    def from_arrow(cls, table: pa.Table) -> ItemTable:
        items = cls.__new__(cls)
        items._set(table)
        return items

    def __len__(self) -> int:
        return len(self.ids)

    def row_of(self, item_id: str) -> int | None:
        """The first row holding `item_id` (`matches`), or None."""
        _, rows = self.matches(id_array([item_id]))
        return int(rows.min()) if len(rows) else None

    def matches(self, ids: pa.Array, keys: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every (position in `ids`, row) where the row holds that id (`hashed_matches`): one row
        an id, except in a version whose removed rows are still in its index (deleted.npy) when
        the id came back. `keys`: the ids' hashes, where the caller has them."""
        keys = string_hashes(ids) if keys is None else keys
        if self._parts:
            return joined_matches((part.matches(ids, keys), offset) for part, offset in self._parts)
        return hashed_matches(*self.lookup, keys, ids, self.ids.array.take)

    def take(self, rows: np.ndarray) -> ItemTable:
        """These rows, in this order."""
        return ItemTable.from_arrow(self.to_arrow().take(pa.array(np.asarray(rows, dtype=np.int64))))

    def to_arrow(self) -> pa.Table:
        return pa.table(
            {
                "id": self.ids.array,
                "label": self.labels.array,
                "path": self.paths.array,
                "metadata": self.metadata.text.array,
            }
        )

    def concat(self, other: ItemTable) -> ItemTable:
        """This table's rows, then `other`'s."""
        return ItemTable.from_arrow(pa.concat_tables([self.to_arrow(), other.to_arrow()]).combine_chunks())

    def write(self, path: str | Path) -> None:
        pq.write_table(self.to_arrow(), str(path))

    def write_lookup(self, path: str | Path) -> None:
        """Its id lookup as one .npy (`read_lookup`): what finds an id in a written table without
        reading the table — an add at 1M rows read every segment's ids and hashed them to learn
        that its new ids were not there (~0.5 s of each `index add`)."""
        order, hashes = self.lookup
        np.save(path, np.stack([hashes, order.astype(np.uint64)]))

    @classmethod
    def read(cls, path: str | Path) -> ItemTable:
        return cls.from_arrow(pq.read_table(str(path), columns=list(COLUMNS)).combine_chunks())
