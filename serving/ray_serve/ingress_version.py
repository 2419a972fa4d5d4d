"""What `serve --ray`'s ingress holds of a version (`IngressVersion`): its manifest and no row.
It is the service's view of the version it serves (`serving.search.version_view.VersionView`),
answered from the manifest and, for what needs rows, by the shards."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from core.artifacts.index_manifest import IndexManifest
from index.versions.units import Unit, units_for_id, units_of
from index.versions.version import IndexVersion, ItemLocation, SampledItem

if TYPE_CHECKING:
    from serving.ray_serve.handles import RayShards


class IngressVersion:
    """A version as the ingress holds it: its manifest and no row — no items, filters,
    tombstones, vectors or faiss index (it has none to read, so a read left on the ingress's
    path fails rather than loading every shard's rows here). The shards answer for their rows:
    hits named (`ShardAnswer`), exclusions resolved, filters' masks and groups made (`filters`
    and `groups` are None here), an item located (`locate`: the shard its id places it in where
    ids are the shard key, else every shard at once), the probe's sample gathered
    (`probe_sample`); whether the rows are labelled, each shard says when it opens the version."""

    def __init__(self, directory: str | Path, shards: RayShards | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = IndexManifest.read(self.directory)
        self._reach = shards
        self._labelled: bool | None = None  # its shards' rows', as they say when they open it

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def size(self) -> int:
        """Items that answer: the manifest's `live_size`."""
        return self.manifest.live_size

    @property
    def group_fields(self) -> list[str]:
        """What queries may group by: the declared fields (the item field among them)."""
        return list(self.manifest.filterable)

    def units(self) -> list[Unit]:
        """Its units (shards), from the manifest."""
        return units_of(self.manifest)

    @property
    def filters(self) -> None:
        """None: each shard makes its own mask from a query's filter."""
        return None

    def groups(self, name: str) -> None:
        """None: each shard groups its own rows by `name`."""
        return None

    @property
    def labelled(self) -> bool:
        if self._labelled is None:
            raise RuntimeError(f"version {self.name} is not open on its shards yet")
        return self._labelled

    def warmed(self, held: dict) -> None:
        """A shard replica's `warm` answer for this version: its rows labelled or not."""
        self._labelled = bool(held["labelled"]) and self._labelled is not False

    def probe_sample(self, size: int, item_field: str | None = None) -> list[SampledItem]:
        """Every shard's part of the sample merged by key: the whole version's sample (rows are
        placed by item, so an item's rows, and its size, are all in one shard)."""
        if self._reach is None:
            raise RuntimeError("this ingress version reaches no shards")
        parts = self._reach.gathered("probe_sample", self.name, (size, item_field))
        return sorted((s for part in parts for s in part), key=lambda s: (s.key, s.row))[:size]

    def units_for_id(self, item_id: str) -> list[int]:
        """The shards that may hold `item_id` (`index.versions.units.units_for_id`)."""
        return units_for_id(self.manifest, item_id)

    def locate(self, item_id: str, field: str | None = None) -> ItemLocation | None:
        if self._reach is None:
            raise RuntimeError("this ingress version reaches no shards")
        return self._reach.locate(self.name, item_id, field, self.units_for_id(item_id))

    def check(self) -> IngressVersion:
        """Its manifest's shards are there and their counts add up (each shard's files are
        checked where they load, in the shard replicas)."""
        if self.manifest.shards:
            IndexVersion(self.directory, self.manifest).check_shard_list()
        return self
