"""Sharded and single index versions over one catalog, in seconds, for the sharded-serving
tests: clustered vectors (an item's rows near one another), an item field and a filterable
shade, published with a tiny model's id so a server can load them."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from core.artifacts.index_manifest import RowCounts
from core.artifacts.model_manifests import ModelManifest, TextModelManifest
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.build.gate import GateThresholds
from index.build.publish import IndexRecipe, NewVersion, PublishTarget, publish_index_version
from index.search.faiss_index import build_index
from index.search.filters import parse_filterable
from index.search.merge import MergedIndex
from index.versions.version import IndexVersion
from tests.support.index import write_tiny_model

FILTERABLE = parse_filterable(["item", "shade"])


def catalog(rows: int, dim: int, items: int, seed: int = 0) -> tuple[np.ndarray, ItemTable]:
    """`rows` clustered unit vectors (rows of one item drawn near one another) and their items:
    ids, an `item` field (rows / items rows an item) and a `shade` spanning items."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(8, items // 4), dim))
    item_of = np.arange(rows) % items
    vectors = centres[item_of % len(centres)] + 0.8 * rng.standard_normal((rows, dim))
    table = ItemTable(
        [f"id{i:05d}" for i in range(rows)],
        None,
        [f"/images/{i}.png" for i in range(rows)],
        [{"item": f"item{item_of[i]}", "shade": str(i % 5)} for i in range(rows)],
    )
    return l2_normalized(vectors.astype(np.float32)), table


def publish(
    root: Path,
    data: tuple[np.ndarray, ItemTable],
    model: Path,
    shards: int,
    factory: str = "Flat",
    params: dict | None = None,
    text_model: Path | None = None,
    item_field: str | None = "item",
) -> Path:
    """A version of `data` in `root` (live), of `shards` shards placed by `item_field` (None: by
    id), for the model at `model` (and the text model at `text_model`, when given); `params` its
    search effort (nprobe, efSearch), tuned to the recall target where not given."""
    vectors, items = data
    new = NewVersion(
        model_id=ModelManifest.read(model).model_id,
        embeddings=vectors,
        items=items,
        catalog="/catalog.csv",
        rows=RowCounts(len(items), len(items)),
        started=time.perf_counter(),
        embed_seconds=0.0,
    )
    gate = GateThresholds(
        ks=(1,), quality_sample=100, ann_k=10, min_ann_recall=0, min_probe_recall_at_1=0, max_recall_drop=None,
        force=False,
    )  # fmt: skip
    recipe = IndexRecipe(factory, params or {}, None, "cpu", 0.95, shards)
    text_id = TextModelManifest.read(text_model).text_model_id if text_model is not None else None
    target = PublishTarget(root, 5, str(model), {}, str(text_model) if text_model else None, text_id)
    return publish_index_version(new, recipe, gate, None, FILTERABLE, item_field, target)


def model(folder: Path, dim: int, side: int = 8) -> Path:
    return write_tiny_model(folder, dim=dim, side=side)


def opened(root: Path) -> IndexVersion:
    return IndexVersion.open(root)


class _TiesInOrder(MergedIndex):
    """Merged parts listing rows that tie (to 1e-6: two kernels' products of one pair of vectors
    differ in the last bits) lowest or highest row first, whatever their last bits say."""

    def __init__(self, parts, offsets, highest_row_first: bool) -> None:
        super().__init__(parts, offsets)
        self.sign = -1 if highest_row_first else 1

    def search(self, queries, k, params=None):
        scores, rows = super().search(queries, k * len(self.parts), params)  # every part's top k
        order = np.lexsort((self.sign * rows, -np.where(rows < 0, -np.inf, np.round(scores, 6))), axis=-1)[:, :k]
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)


def two_flat_shards(vectors: np.ndarray, highest_row_first: bool):
    """`vectors` as two Flat shards, merged as a sharded version is measured and searched whole,
    listing rows that tie in the order asked: an exact index whose tie order alone may differ
    from an exact ranking's."""
    half = len(vectors) // 2
    shards = [build_index(vectors[:half], "Flat", device="cpu"), build_index(vectors[half:], "Flat", device="cpu")]
    return _TiesInOrder(shards, np.array([0, half]), highest_row_first)


class Answered:
    """A Serve call's response as `RayShards` reads it: its outcome (an exception is raised where
    the answer is read, as Serve raises a replica's error), `cancel` a no-op."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def result(self, timeout_s: float):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        pass
