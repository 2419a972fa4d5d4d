"""The IndexAdmin service and the console's admin pages: Reload, RemoveItems, AddItems and make
live, and what the index root holds — its versions with their manifests' figures, a version's
contact sheet, the takedown audit log, the live version's duplicate groups. Plain classes,
protobuf messages in and out, as `serving.api.search_service`; the app (`serving.server`) does the loading."""

from __future__ import annotations

import csv
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable
from index.build.duplicates import GROUPS_FILE, SUMMARY_FILE, runs_of
from index.changes.lifecycle import RemovalReport, RollbackReport
from index.versions.audit import audit_entries
from index.versions.units import segment_counts
from protos.simsearch.v1 import search_pb2 as pb
from serving.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from serving.search.checks import CheckedImage, RequestChecks
from serving.search.engine import ServingPair

# The path an ingested item records when its call names none: no file, so its thumbnail is NOT_FOUND.
INGEST_PATH = "ingest:{id}"


@dataclass(frozen=True)
class Ingested:
    """What an AddItems call did: the version its items were added to, the version now served
    (the one published, or a compaction of it), and its counts."""

    parent_version: str
    version: str
    added: int
    replaced: int
    size: int


Reloader = Callable[[str | None, str | None], Awaitable[tuple[ServingPair | None, ServingPair]]]
# (version, model_dir, unless_live=…) → old pair, new pair: a reload of this worker alone
LocalReloader = Callable[..., Awaitable[tuple[ServingPair | None, ServingPair]]]
Remover = Callable[[list[str], str, str, str], Awaitable[RemovalReport]]
# (pair, the items' checked images or vectors, their rows, upsert, who, via) → what the ingest did
Adder = Callable[[ServingPair, list[CheckedImage | np.ndarray], ItemTable, bool, str, str], Awaitable[Ingested]]
# (version, model_dir, who, via, restore_taken_down, make_current) → what the rollback did, old pair, new pair
RollingBack = Callable[
    [str, str | None, str, str, bool, bool],
    Awaitable[tuple[RollbackReport, ServingPair | None, ServingPair]],
]


class AdminService:
    """Reload: a new pair swapped in, or FAILED_PRECONDITION with the old one still serving.
    RemoveItems: a takedown published as a new version and swapped in. AddItems: items embedded
    by the live model, published as a new version and swapped in. A named version (Reload, make
    live) goes through `rollback`: takedowns made since it was built are re-applied."""

    def __init__(
        self,
        reload: Reloader,
        remove: Remover | None = None,
        index_root: str | Path | None = None,
        rollback: RollingBack | None = None,
        live: Callable[[], ServingPair | None] | None = None,
        add: Adder | None = None,
        checks: RequestChecks | None = None,
        reload_here: LocalReloader | None = None,
    ) -> None:
        self._reload = reload
        self._reload_here = reload_here  # a relayed reload's: this worker alone (serving.api.siblings)
        self._remove = remove
        self._add = add
        self._checks = checks
        self._rollback = rollback
        self._live = live
        self.index_root = Path(index_root) if index_root is not None else None

    def _root(self) -> Path:
        if self.index_root is None:
            raise FailedPrecondition("this server has no index root")
        return self.index_root

    def versions(self, live: str | None) -> list[dict]:
        """Every version in the root, newest first, with its manifest's figures."""
        root = self._root()
        current = artifacts.current_version(root)
        listed = []
        for version in reversed(artifacts.list_versions(root)):
            try:
                m = IndexManifest.read(artifacts.version_dir(root, version))
            except (ArtifactError, FileNotFoundError, ValueError) as exc:
                listed.append({"version": version, "error": str(exc)})
                continue
            quality = m.quality
            listed.append(
                {
                    "version": version,
                    "live": version == live,
                    "current": version == current,
                    "size": m.live_size,
                    "deletedRows": m.deleted_rows,
                    "factory": m.factory,
                    "modelId": m.model_id,
                    "annRecall": quality.ann_recall_at_k if quality else None,
                    "probeRecallAtK": (quality.probe_recall_at_k or {}) if quality else {},
                    "probeIntervalAtK": (quality.probe_interval_at_k or {}) if quality else {},  # 95%, Wilson
                    "probeQueries": quality.probe_queries if quality else None,
                    "created": m.created,
                    "parentVersion": m.parent_version,
                    "shards": len(m.shards) if m.shards else 1,
                    # Segments: its units' together (an unsegmented shard is one), as `index list` counts
                    # them; 0 for a version whose rows lie in no segments (built whole, never changed).
                    "segments": sum(segment_counts(m)) if m.segmented else 0,
                    "textModelId": m.text_model_id,
                }
            )
        return listed

    def neighbours_sheet(self, version: str) -> Path:
        path = self._version_dir(version) / artifacts.NEIGHBOURS_FILE
        if not path.is_file():
            raise NotFound(f"version {version} has no {artifacts.NEIGHBOURS_FILE}")
        return path

    def _version_dir(self, version: str) -> Path:
        if version not in artifacts.list_versions(self._root()):  # a name from the listing, never a path
            raise NotFound(f"no index version {version!r}")
        return artifacts.version_dir(self._root(), version)

    async def make_live(
        self, version: str, who: str = "", via: str = "http", restore_taken_down: bool = False
    ) -> pb.ReloadResponse:
        """Make `version` live — what `index rollback --to` does — and load it: CURRENT names it,
        or a version derived from it without the items taken down since it was built."""
        self._version_dir(version)
        return await self._roll_back(version, None, who, via, restore_taken_down, make_current=True)

    def audit(self, limit: int) -> list[dict]:
        """The newest `limit` entries of the root's takedown audit log."""
        return audit_entries(self._root())[::-1][:limit]

    def duplicates(self, live: str) -> dict:
        """The groups of the live version's latest `index duplicates` run in its default folder."""
        runs = runs_of(self._root(), live)
        if not runs:  # not an error: a version nobody has looked for duplicates in yet
            return {"indexVersion": live, "minScore": None, "run": None, "groups": []}
        run = runs[-1]
        summary = json.loads((run / SUMMARY_FILE).read_text()) if (run / SUMMARY_FILE).is_file() else {}
        groups: dict[int, dict] = {}
        with open(run / GROUPS_FILE, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                group = groups.setdefault(int(row["group"]), {"group": int(row["group"]), "ids": [], "labels": []})
                group["ids"].append(row["id"])
                group["labels"].append(row.get("label") or "")
        for group in groups.values():
            group["size"] = len(group["ids"])
        return {
            "indexVersion": live,
            "minScore": summary.get("min_score"),
            "run": run.name,
            "groups": sorted(groups.values(), key=lambda g: (-g["size"], g["group"])),
        }

    async def remove_items(self, request: pb.RemoveItemsRequest, who: str, via: str) -> pb.RemoveItemsResponse:
        ids = list(request.ids)
        if not ids:
            raise InvalidArgument("ids: empty; name the items to remove")
        if any(not item_id for item_id in ids):
            raise InvalidArgument("ids: an empty string is not an item id")
        if self._remove is None:
            raise FailedPrecondition("this server cannot remove items")
        try:
            report = await self._remove(ids, who, request.reason, via)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(f"removal failed, nothing changed: {exc}") from None
        return pb.RemoveItemsResponse(
            index_version=report.version or report.parent_version,
            previous_index_version=report.parent_version,
            removed=report.removed,
            not_found=report.not_found,
            index_size=report.size,
        )

    async def add_items(self, request: pb.AddItemsRequest, who: str, via: str) -> pb.AddItemsResponse:
        """Items checked against the live pair (`RequestChecks.new_items`), then embedded, added
        to the version CURRENT names as one segment, published and swapped in. What the root
        refuses them for (an id already indexed without upsert, an id given twice, a label the
        version's items lack, a filterable field's value of the wrong type) is INVALID_ARGUMENT;
        a root that cannot take them now (its writer busy, a version unreadable) FAILED_PRECONDITION."""
        if self._add is None or self._checks is None:
            raise FailedPrecondition("this server cannot add items")
        pair = self._live() if self._live is not None else None
        if pair is None:
            raise Unavailable("no model and index are loaded yet: nothing to embed the items with")
        items = list(request.items)
        checked = self._checks.new_items(pair, items)
        rows = ItemTable(
            ids=[item.id for item in items],
            labels=[item.label for item in items] if items[0].HasField("label") else None,
            paths=[item.path or INGEST_PATH.format(id=item.id) for item in items],
            metadata=[dict(item.metadata) for item in items],
        )
        try:
            done = await self._add(pair, checked, rows, request.upsert, who, via)
        except ValueError as exc:
            raise InvalidArgument(f"nothing added: {exc}") from None
        except (ArtifactError, FileNotFoundError) as exc:  # WriterBusyError among them
            raise FailedPrecondition(f"nothing added: {exc}") from None
        return pb.AddItemsResponse(
            index_version=done.version,
            previous_index_version=done.parent_version,
            added=done.added,
            replaced=done.replaced,
            index_size=done.size,
        )

    async def reload(self, request: pb.ReloadRequest, who: str = "", via: str = "grpc") -> pb.ReloadResponse:
        if request.restore_taken_down and not request.index_version:
            raise InvalidArgument("restore_taken_down needs index_version: the version whose taken-down items to serve")
        if request.index_version and self._rollback is not None:
            model_dir = request.model_dir or None
            restore = request.restore_taken_down
            return await self._roll_back(request.index_version, model_dir, who, via, restore, make_current=False)
        try:
            old, new = await self._reload(request.index_version or None, request.model_dir or None)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(self._refused(request.index_version, request.model_dir, exc)) from None
        return _reloaded(old, new)

    async def reload_relayed(self, request: pb.ReloadRequest, fresh: bool) -> pb.ReloadResponse:
        """A sibling worker's reload, relayed (`serving.api.siblings`): the version it names, here
        alone — neither relayed again nor rolled back again. `fresh`: load it even if it is live."""
        if self._reload_here is None or not request.index_version:
            raise FailedPrecondition("this server has no sibling workers to take a relayed reload from")
        version, model_dir = request.index_version, request.model_dir or None
        try:
            old, new = await self._reload_here(version, model_dir, unless_live=not fresh)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(self._refused(version, model_dir, exc)) from None
        return _reloaded(old, new)

    async def _roll_back(
        self, version: str, model_dir: str | None, who: str, via: str, restore: bool, make_current: bool
    ) -> pb.ReloadResponse:
        if self._rollback is None:
            raise FailedPrecondition("this server cannot make a version live")
        try:
            report, old, new = await self._rollback(version, model_dir, who, via, restore, make_current)
        except (ArtifactError, FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(self._refused(version, model_dir, exc)) from None
        return _reloaded(old, new, reapplied_ids=report.reapplied, restored_ids=report.restored)

    def _refused(self, version: str | None, model_dir: str | None, exc: Exception) -> str:
        """A refused reload's message: the candidate it refused, and the pair still serving."""
        candidate = f"index {version or 'CURRENT names'}" + (f" with the model in {model_dir}" if model_dir else "")
        live = self._live() if self._live is not None else None
        serving = f"index {live.version} with model {live.model_id}" if live is not None else "nothing loaded yet"
        return f"reload of {candidate} refused, still serving the old pair ({serving}): {exc}"


def _reloaded(old: ServingPair | None, new: ServingPair, **rollback: list[str]) -> pb.ReloadResponse:
    """A Reload's answer: the pair now served, the one before it, what a rollback re-applied or restored."""
    return pb.ReloadResponse(
        index_version=new.version, model_id=new.model_id, previous_index_version=old.version if old else "", **rollback
    )
