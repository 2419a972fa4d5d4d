"""What the search service reads of the version it serves (`VersionView`): a published version
whose rows are read here (`index.versions.version.IndexVersion`, `serve`) and a sharded
server's ingress's view of one, which holds its manifest and no row
(`serving.ray_serve.ingress_version.IngressVersion`, `serve --ray`) both answer it.

Where the rows are not held, the view says so by its answers, not by a flag: `filters` is None
(each shard makes its own mask from the query's filter) and `groups(name)` is None (each shard
groups its own rows); an item is located, and the probe's sample gathered, wherever the rows
are."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from core.artifacts.index_manifest import IndexManifest
from index.search.filters import FilterIndex
from index.search.grouping import Groups
from index.versions.units import Unit
from index.versions.version import ItemLocation, SampledItem


class VersionView(Protocol):
    directory: Path
    manifest: IndexManifest

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int:
        """Items that answer (the manifest's live size)."""
        ...

    @property
    def group_fields(self) -> list[str]: ...

    @property
    def labelled(self) -> bool: ...

    @property
    def filters(self) -> FilterIndex | None:
        """The filterable fields' value → rows structure; None where there is none here to mask
        with (a version that declares no filterable field, or rows held elsewhere)."""
        ...

    def groups(self, name: str) -> Groups | None:
        """The rows grouped by the declared field `name`; None where the rows are held elsewhere."""
        ...

    def units(self) -> list[Unit]: ...

    def locate(self, item_id: str, field: str | None = None) -> ItemLocation | None: ...

    def probe_sample(self, size: int, item_field: str | None = None) -> list[SampledItem]: ...
