"""The items table of an index version: row → id, label, path, metadata (Parquet)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass
class ItemTable:
    ids: list[str]
    labels: list[str]
    paths: list[str]
    metadata: list[dict[str, str]]

    def __post_init__(self) -> None:
        self._row_of = {item_id: row for row, item_id in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def row_of(self, item_id: str) -> int | None:
        return self._row_of.get(item_id)

    def write(self, path: str | Path) -> None:
        table = pa.table(
            {
                "id": self.ids,
                "label": self.labels,
                "path": self.paths,
                "metadata": [json.dumps(m, ensure_ascii=False, sort_keys=True) for m in self.metadata],
            }
        )
        pq.write_table(table, str(path))

    @classmethod
    def read(cls, path: str | Path) -> ItemTable:
        columns = pq.read_table(str(path)).to_pydict()
        return cls(
            ids=columns["id"],
            labels=columns["label"],
            paths=columns["path"],
            metadata=[json.loads(m) for m in columns["metadata"]],
        )
