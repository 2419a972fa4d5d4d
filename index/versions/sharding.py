"""Sharded index versions: where a row goes, and the shards built in parallel on Ray.

`index build|rebuild --shards S` (S > 1) publishes one version of S shards
(`versions/<v>/shards/<NNN>/`, each with a whole version's row files, and one manifest listing
them: docs/operations.md, "Sharded versions"). A row's shard is a stable hash of its item —
the item field's value when the version has one, else its id — so every row of an item lives
in one shard and a grouped search stays exact per shard; within a shard rows keep catalog
order. The coarse quantizer and the PQ/SQ code books are trained once, on the build's training
sample, into an empty index that every shard copies before adding its own rows, one Ray task a
shard, each holding only its rows and writing its files through its `ShardWriter`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from core.artifacts.index_manifest import ShardEntry
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.search.filters import FieldSpec, FilterIndex, column_values
from index.versions.version_writer import ShardWriter, VersionWriter

ID_KEY = "id"  # the shard key of a version without an item field


def shard_of(key: str, shards: int) -> int:
    """The shard of a row whose item is `key`: blake2b of its UTF-8 bytes, little-endian, mod
    `shards` — the same on every machine and in every process (Python's hash() is salted)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


def shard_keys(items: ItemTable, item_field: str | None) -> list[str]:
    """Each row's shard key: its item field's value where it has one, else its id."""
    if item_field is None:
        return list(items.ids)
    labels = list(items.labels) if items.labelled else [None] * len(items)
    values = column_values(item_field, labels, items.metadata)
    return [value if value is not None else item_id for value, item_id in zip(values, items.ids, strict=True)]


def partition(keys: Sequence[str], shards: int) -> list[np.ndarray]:
    """The rows of each shard, ascending (catalog order within a shard)."""
    placed = np.fromiter((shard_of(key, shards) for key in keys), dtype=np.int64, count=len(keys))
    return [np.flatnonzero(placed == number) for number in range(shards)]


def check_shard_count(shards: int, rows: int | None = None) -> None:
    """ValueError unless 1 ≤ `shards` ≤ `rows` (when known)."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if rows is not None and shards > rows:
        raise ValueError(f"--shards {shards} is more shards than the {rows} rows to index: at most {rows}")


@dataclass
class ShardRows:
    """What one shard of a new version holds, for `write_shard`."""

    index: faiss.Index
    vectors: np.ndarray
    items: ItemTable
    deleted: np.ndarray


def write_shard(writer: ShardWriter, rows: ShardRows, specs: Sequence[FieldSpec], row_offset: int) -> ShardEntry:
    """Write one shard's files (its filters built from its own items) and account for them."""
    writer.write_index(rows.index)
    writer.write_vectors(rows.vectors)
    writer.write_deleted(rows.deleted)
    writer.write_items(rows.items)
    writer.write_filters(FilterIndex.build(rows.items, specs) if specs else None)
    return writer.entry(len(rows.items), len(rows.deleted), row_offset)


def _build_shard(
    writer: ShardWriter,
    trained: np.ndarray,
    vectors: np.ndarray,
    items: object,
    specs: list[FieldSpec],
    row_offset: int,
) -> ShardEntry:
    """A Ray task: a copy of the trained empty index, this shard's rows added, its files written."""
    index = faiss.deserialize_index(trained)
    index.add(l2_normalized(vectors))
    table = ItemTable.from_arrow(items)
    return write_shard(writer, ShardRows(index, vectors, table, np.zeros(0, np.int64)), specs, row_offset)


def build_shards(
    writer: VersionWriter,
    trained: faiss.Index,
    embeddings: np.ndarray,
    items: ItemTable,
    parts: list[np.ndarray],
    specs: Sequence[FieldSpec],
) -> list[ShardEntry]:
    """Every shard of a new version built and written in parallel, one Ray task a shard (each
    given only its rows); their entries in shard order."""
    import ray

    from core.cli import init_ray

    init_ray(log_to_driver=False)
    task = ray.remote(num_cpus=1)(_build_shard)
    trained_ref = ray.put(faiss.serialize_index(trained))  # once, shared by every task
    table = items.to_arrow()
    offsets = np.concatenate([[0], np.cumsum([len(rows) for rows in parts])[:-1]])
    pending = [
        task.remote(writer.shard(number), trained_ref, embeddings[rows], table.take(rows), list(specs), int(offset))
        for number, (rows, offset) in enumerate(zip(parts, offsets, strict=True))
    ]
    return list(ray.get(pending))


def build_shard_group(
    batch: dict[str, np.ndarray],
    writers: list[ShardWriter],
    trained_ref: object,
    table_ref: object,
    kept_ref: object,
    specs: list[FieldSpec],
) -> dict[str, np.ndarray]:
    """Ray Data's `map_groups` over a rebuild's rows grouped by shard (`index.build.rebuild`): one
    shard's rows (`row`: catalog rows, `embedding`), and only those, built into its copy of the
    trained index and written; its entry back as JSON (row offset 0: the driver sets them once
    every shard's rows are known). `table_ref`: the version's items (Arrow) for the catalog
    rows `kept_ref` lists, ascending."""
    import ray

    number = int(batch["shard"][0])
    order = np.argsort(batch["row"], kind="stable")  # catalog order within a shard
    rows, vectors = batch["row"][order], np.asarray(batch["embedding"], dtype=np.float32)[order]
    table, kept = ray.get(table_ref), ray.get(kept_ref)
    items = table.take(np.searchsorted(kept, rows))
    entry = _build_shard(writers[number], ray.get(trained_ref), vectors, items, specs, 0)
    return {"shard": np.asarray([number]), "entry": np.asarray([json.dumps(entry.to_dict())])}


def empty_shard(
    writer: ShardWriter, trained: faiss.Index, dim: int, items: object, specs: list[FieldSpec]
) -> ShardEntry:
    """A shard no row hashes to: the trained empty index, zero vectors, an empty items table."""
    return _build_shard(writer, faiss.serialize_index(trained), np.zeros((0, dim), np.float32), items, specs, 0)
