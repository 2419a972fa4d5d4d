"""Ingests committed in groups (issue 61): AddItems and RemoveItems calls that arrive within a
short window of each other (`serve --ingest-window-ms`) are published as one segment and one
version, and loaded once, where a version a call had cost the searches a reload each and the
root a segment each.

`GroupCommit` is the window: a call joins the open group of its key (or opens one, which closes
`window_s` later), then waits for the group's commit to answer it; each call still answers only
once its items are live. Calls whose writes cannot share a version take different keys (an
upsert and a plain add; takedowns by different people or for different reasons, which the audit
log records apart). A call's items stay all-or-nothing and a bad one fails its call alone: when
the root refuses a group (`ValueError`: an id already indexed, twice among the group, labels
unlike the version's), the committer publishes its calls one by one, so each gets the answer it
would have had alone, naming its own bad item (`commit_each`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from core.data.items import ItemTable
from index.changes.lifecycle import RemovalReport

T = TypeVar("T")
R = TypeVar("R")

# A group's commit: (key, the calls' items in arrival order) → each call's result or its error.
Commit = Callable[[Hashable, list[T]], Awaitable[list[R | Exception]]]


class GroupCommit(Generic[T, R]):
    """Calls of one key arriving within `window_s` of the first committed together. Lives on
    the server's loop; a group's commit runs in a task of its own, so a caller that goes away
    (a cancelled RPC) neither stops the group nor its siblings' answers."""

    def __init__(self, window_s: float, commit: Commit) -> None:
        if window_s < 0:
            raise ValueError(f"the ingest window must be ≥ 0 seconds, got {window_s}")
        self.window_s = window_s
        self._commit = commit
        self._open: dict[Hashable, list[tuple[T, asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks

    async def submit(self, key: Hashable, item: T) -> R:
        """`item` committed with whatever else of `key` arrives within the window; its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        group = self._open.get(key)
        if group is None:
            group = self._open[key] = []
            task = loop.create_task(self._close_after(key), name="group-commit")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        group.append((item, future))
        return await asyncio.shield(future)

    async def _close_after(self, key: Hashable) -> None:
        await asyncio.sleep(self.window_s)
        group = self._open.pop(key)  # a call from now on opens the next group
        futures = [future for _, future in group]
        try:
            results = await self._commit(key, [item for item, _ in group])
        except Exception as exc:  # the group's failure is each of its calls' (a root it cannot write)
            results = [exc] * len(group)
        for future, result in zip(futures, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


async def commit_each(
    items: Sequence[T], one: Callable[[T], Awaitable[R]], refused: tuple[type[Exception], ...]
) -> list[R | Exception]:
    """The calls of a refused group published one at a time, in arrival order: each gets what it
    would have got alone — its own version, or the refusal naming its own bad item."""
    results: list[R | Exception] = []
    for item in items:
        try:
            results.append(await one(item))
        except refused as exc:
            results.append(exc)
    return results


@dataclass(frozen=True)
class AddCall:
    """An AddItems call's part of a group: its rows (embedded already) and who asked."""

    vectors: np.ndarray
    rows: ItemTable
    who: str
    via: str


def joined_adds(calls: Sequence[AddCall]) -> tuple[np.ndarray, ItemTable]:
    """The group's rows, call after call: one segment."""
    if len(calls) == 1:
        return calls[0].vectors, calls[0].rows
    return np.concatenate([c.vectors for c in calls]), ItemTable.joined([c.rows for c in calls])


def removal_of(group: RemovalReport, ids: Sequence[str]) -> RemovalReport:
    """One call's part of a group's takedown: its own ids' counts, the group's versions."""
    asked = set(ids)
    missing = [item_id for item_id in group.not_found if item_id in asked]
    return RemovalReport(
        group.parent_version,
        group.version,
        len(asked),
        len(asked) - len(missing),
        missing,
        group.size,
        group.deleted_rows,
        group.seconds,
        group.bytes_written,
        group.compacted_to,
        group.touched,
    )
