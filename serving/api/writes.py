"""What a server writes to its index root: ingests (AddItems) and takedowns (RemoveItems),
committed in groups (`serving.api.group_commit`), each published, loaded and then answered; and
the compaction a write makes due, run after its answer as `index compact` in a process of its
own. The app (`serving.server.SearchApp`) holds one and hands it its reload."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.data.items import ItemTable
from index.changes.add import add_vectors
from index.changes.lifecycle import RemovalReport, remove_items
from index.changes.merges import merge_command, merge_due
from index.versions.merge_policy import TIERED, TieredMergePolicy
from index.versions.segments import MAX_DELETED_FRACTION, compaction_due
from index.versions.version import IndexVersion
from serving.api.admin_service import Ingested
from serving.api.group_commit import AddCall, GroupCommit, commit_each, joined_adds, removal_of
from serving.api.search_service import SearchService
from serving.errors import FailedPrecondition
from serving.search.checks import CheckedImage
from serving.search.engine import ServingPair
from serving.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)

Reload = Callable[[str | None], Awaitable[tuple[ServingPair | None, ServingPair]]]


@dataclass(frozen=True)
class WriteOptions:
    """The server's options its writes follow (`serving.config.ServerConfig`'s)."""

    index_root: str
    keep_versions: int
    max_segments: int
    drain_timeout_s: float
    window_s: float
    merges: str = TIERED  # `--merges`: tiered merges, or whole shards past max_segments


@dataclass(frozen=True)
class RemoveCall:
    """A RemoveItems call's part of a group: the ids it names."""

    ids: list[str]


class IndexWrites:
    """Ingests and takedowns of one server, in groups, one group at a time (`lock`, which a
    rollback takes too)."""

    def __init__(
        self,
        options: WriteOptions,
        reload: Reload,
        service: SearchService,
        metrics: ServiceMetrics,
        stopping: threading.Event,
    ) -> None:
        self.options = options
        self._reload = reload
        self.service = service
        self.metrics = metrics
        self._stopping = stopping
        self.lock = asyncio.Lock()
        self._adds: GroupCommit[AddCall, Ingested] = GroupCommit(options.window_s, self._commit_adds)
        self._removes: GroupCommit[RemoveCall, RemovalReport] = GroupCommit(options.window_s, self._commit_removes)
        self._compaction: asyncio.Task | None = None  # `index compact` after a write, in its own process
        self._policy = TieredMergePolicy(max_deleted_share=MAX_DELETED_FRACTION)  # with --merges tiered
        self._compact_again = False  # a write came while it ran: it runs once more

    # -- takedowns --------------------------------------------------------------------------

    async def remove_items(self, ids: list[str], who: str, reason: str, via: str) -> RemovalReport:
        """A takedown: the version CURRENT names less `ids` — with the other takedowns by the
        same person for the same reason within the window —, published (the previous one stays
        for rollback), swapped in, and returned once no request still answers from the old pair."""
        return await self._removes.submit((who, reason, via), RemoveCall(ids))

    async def _commit_removes(self, key: Hashable, calls: list[RemoveCall]) -> list[RemovalReport | Exception]:
        who, reason, via = key  # type: ignore[misc]
        ids = list(dict.fromkeys(item_id for call in calls for item_id in call.ids))
        async with self.lock:
            opts = self.options
            remove = functools.partial(
                remove_items, opts.index_root, ids, who, reason, via=via, keep=opts.keep_versions,
                compact_when_due=False,
            )  # fmt: skip
            report = await asyncio.get_running_loop().run_in_executor(None, remove)
            self.metrics.items_removed.inc(report.removed)
            if report.version is not None:
                _, new = await self._reload(report.version)
                if not await self.service.drained(new.serial, opts.drain_timeout_s):
                    log.warning(
                        "takedown %s: requests still answering from an earlier version after %.0f s",
                        report.version,
                        opts.drain_timeout_s,
                    )
                self._compact_if_due()
        return [removal_of(report, call.ids) for call in calls]

    # -- ingests ----------------------------------------------------------------------------

    async def add_items(
        self, pair: ServingPair, checked: list[CheckedImage | np.ndarray], rows: ItemTable, upsert: bool, who: str,
        via: str,
    ) -> Ingested:  # fmt: skip
        """An ingest: the items' images embedded by `pair`'s model (in the batches queries share),
        then added with the other ingests of the window to the version CURRENT names as one
        segment (`index.changes.add.add_vectors`, which refuses them unless that version was built
        with this model), published, and loaded before it returns."""
        vectors = await self.service.item_vectors(pair, checked)
        # An upsert and a plain add never share a group: a plain add must be refused where it
        # names a held id, which an upsert beside it would replace instead.
        return await self._adds.submit((upsert, pair.model_id), AddCall(vectors, rows, who, via))

    async def _commit_adds(self, key: Hashable, calls: list[AddCall]) -> list[Ingested | Exception]:
        upsert, model_id = key  # type: ignore[misc]
        try:
            return await self._publish_added(calls, upsert, model_id)
        except ValueError:
            if len(calls) == 1:
                raise
        # The root refused the group for some call's items: each alone, so only that call fails.
        return await commit_each(calls, lambda call: self._publish_one(call, upsert, model_id), (ValueError,))

    async def _publish_one(self, call: AddCall, upsert: bool, model_id: str) -> Ingested:
        return (await self._publish_added([call], upsert, model_id))[0]

    async def _publish_added(self, calls: list[AddCall], upsert: bool, model_id: str) -> list[Ingested]:
        async with self.lock:
            opts = self.options
            vectors, rows = joined_adds(calls)
            engine = self.service.engine
            add = functools.partial(
                add_vectors, opts.index_root, vectors, rows, upsert=upsert, keep=opts.keep_versions,
                max_segments=opts.max_segments, model_id=model_id, compact=False,
                opened=engine.pair.index_version if engine.loaded else None,
            )  # fmt: skip
            loop = asyncio.get_running_loop()
            report = await loop.run_in_executor(None, add)
            published = await loop.run_in_executor(None, IndexManifest.read, report.version)
            self.metrics.items_added.inc(len(rows))
            for call in calls:
                log.info(
                    "%s added %d items via %s: version %s", call.who, len(call.rows), call.via, published.version,
                    extra={"index_version": published.version},
                )  # fmt: skip
            try:
                old, new = await self._reload(published.version)
            except Exception as exc:
                raise FailedPrecondition(
                    f"the items were added as version {published.version}, but loading it failed: {exc}"
                ) from None
            # An upsert, as a takedown, answers once no request still answers with the rows it replaced.
            if upsert and not await self.service.drained(new.serial, opts.drain_timeout_s):
                log.warning("ingest %s: requests still answering from an earlier version", published.version)
            self._compact_if_due()
            parent = published.parent_version or ""
            if len(calls) == 1:
                counts = published.rows
                added = counts.added if counts is not None else len(rows)
                replaced = (counts.replaced or 0) if counts is not None else 0
                return [Ingested(parent, new.version, added, replaced, new.index_version.size)]
            return await self._parts_of(calls, parent, old, new, upsert)

    async def _parts_of(
        self, calls: list[AddCall], parent: str, old: ServingPair | None, new: ServingPair, upsert: bool
    ) -> list[Ingested]:
        """Each call's counts in a group's version: an upsert's replaced rows are its ids the
        parent version held, looked up in the pair that served it (a shard at a time on `serve --ray`)."""
        held: set[str] = set()
        if upsert and old is not None:
            ids = [item_id for call in calls for item_id in call.rows.ids]
            found = await asyncio.get_running_loop().run_in_executor(None, old.index_version.rows_of_ids, ids)
            held = {item_id for item_id, row in found.items() if row is not None}
        size = new.index_version.size
        parts = []
        for call in calls:
            replaced = sum(1 for item_id in call.rows.ids if item_id in held)
            parts.append(Ingested(parent, new.version, len(call.rows) - replaced, replaced, size))
        return parts

    # -- compaction -------------------------------------------------------------------------

    def _compact_if_due(self) -> None:
        """After a write's answer, the merges it made due (tiered, or with --merges whole the
        shards it took past --max-segments): `index compact` in a process of its own (the merge
        holds about three times a shard's rows, which a server must not keep; on a Ray cluster,
        RAY_ADDRESS set, a task a shard), then the version it published loaded. One at a time: a
        write meanwhile has it run once more after."""
        self._compact_again = True
        if self._compaction is None or self._compaction.done():
            self._compaction = asyncio.get_running_loop().create_task(self._compactions(), name="compaction")

    async def _compactions(self) -> None:
        loop = asyncio.get_running_loop()
        while self._compact_again and not self._stopping.is_set():
            self._compact_again = False
            # Off the loop: the tiered policy reads each unit's deleted rows from the root. A write
            # that makes nothing due starts no `index compact` process (a second of CPU each).
            if await loop.run_in_executor(None, self._merge_due):
                await self._compacted()

    def _merge_due(self) -> bool:
        """Whether the live version of the root has a merge due: read from the root, since a
        `serve --ray` ingress holds none of its rows."""
        version = IndexVersion.open(self.options.index_root)
        if self.options.merges == TIERED:
            return merge_due(version, self._policy)
        return compaction_due(version, self.options.max_segments, MAX_DELETED_FRACTION)

    async def _compacted(self) -> None:
        opts = self.options
        if opts.merges == TIERED:
            command = merge_command(opts.index_root, opts.keep_versions, self._policy)
        else:
            command = [
                sys.executable, "-m", "index", "compact", "--index-root", str(opts.index_root),
                "--max-segments", str(opts.max_segments), "--keep", str(opts.keep_versions), "--no-progress",
            ]  # fmt: skip
        before = artifacts.current_version(opts.index_root)
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, stderr = await process.communicate()
        if process.returncode != 0:
            said = stderr.decode(errors="replace").strip().splitlines()
            log.warning("compaction after an ingest failed (exit %d): %s", process.returncode, said[-1] if said else "")
            return
        if artifacts.current_version(opts.index_root) == before or self._stopping.is_set():
            return
        async with self.lock:
            # Read under the lock: an ingest that waited for it has published (and loaded) a
            # version made from the compacted one, which the compaction's must not replace.
            after = artifacts.current_version(opts.index_root)
            live = self.service.engine.pair.version if self.service.engine.loaded else None
            if live is not None and live != after:
                try:
                    await self._reload(after)
                except Exception as exc:  # noqa: BLE001 — the live version keeps serving; say why
                    log.warning("compacted version %s was published but not loaded: %s", after, exc)

    def cancel(self) -> None:
        """Stop the compaction in flight (the server is stopping)."""
        if self._compaction is not None:
            self._compaction.cancel()
