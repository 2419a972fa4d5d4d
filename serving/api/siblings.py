"""A worker's siblings: the other worker processes of one `serve --processes N` server, each
reached on its own Unix socket (`serving.listen.worker_socket`). The kernel spreads connections,
not calls, over the workers, so a caller's next call may reach any of them: a reload one worker
makes — a Reload call, a rollback, an ingest's or a takedown's new version — is relayed to every
sibling and the call answers once all of them serve it. Each sibling loads it alone (a relayed
Reload is never relayed again, nor rolled back again: the version named is the one to load).
GetInfo's Recall@K figures are the whole server's: each worker measures the answers it gave, and
the one asked merges its siblings' figures with its own (`merged_figures`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.errors import Unavailable
from serving.telemetry.metrics import merged_recall

log = logging.getLogger(__name__)

# Metadata of a Reload one worker relays to a sibling: "fresh" (a Reload call: load again even
# what is live) or "unless-live" (a write's new version, which the sibling's CURRENT watcher
# may have loaded already).
RELAYED = "x-simsearch-relayed"
FRESH, UNLESS_LIVE = "fresh", "unless-live"
RELAY_TIMEOUT_S = 300.0  # a load with its run-size measurement, on a machine every worker shares
INFO_TIMEOUT_S = 5.0


class Siblings:
    """The other workers of this worker's server, and the reloads relayed to them."""

    def __init__(self, own: int, addresses: dict[int, str], admin_token: str | None, search_token: str | None) -> None:
        self.own = own
        self.addresses = addresses  # each sibling's gRPC address, by its index
        self._auth = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self._search_auth = (("authorization", f"Bearer {search_token}"),) if search_token else ()
        self._channels: dict[int, grpc.aio.Channel] = {}  # made on the loop that relays, on first use

    async def reload(self, version: str, model_dir: str | None, fresh: bool) -> None:
        """Every sibling serves `version` (with `model_dir`, else the one it records) when this
        returns; `Unavailable` naming each sibling that did not load it, and why."""
        request = pb.ReloadRequest(index_version=version, model_dir=model_dir or "")
        metadata = (*self._auth, (RELAYED, FRESH if fresh else UNLESS_LIVE))
        indexes = list(self.addresses)
        answers = await asyncio.gather(
            *(self._stub(i).Reload(request, metadata=metadata, timeout=RELAY_TIMEOUT_S) for i in indexes),
            return_exceptions=True,
        )
        failed = {i: answer for i, answer in zip(indexes, answers, strict=True) if isinstance(answer, BaseException)}
        if failed:
            said = "; ".join(f"worker {i}: {_reason(exc)}" for i, exc in failed.items())
            raise Unavailable(f"worker {self.own} serves index {version}, but not every worker does ({said})")

    async def infos(self) -> list[pb.GetInfoResponse]:
        """Each sibling's own GetInfo (a sibling that does not answer in INFO_TIMEOUT_S is left
        out: the figures are then of the workers that did)."""
        metadata = (*self._search_auth, (RELAYED, FRESH))
        answers = await asyncio.gather(
            *(
                pb_grpc.SimilaritySearchStub(self._channel(i)).GetInfo(
                    pb.GetInfoRequest(), metadata=metadata, timeout=INFO_TIMEOUT_S
                )
                for i in self.addresses
            ),
            return_exceptions=True,
        )
        for index, answer in zip(self.addresses, answers, strict=True):
            if isinstance(answer, BaseException):
                log.debug("worker %d gave no GetInfo: %s", index, _reason(answer))
        return [answer for answer in answers if isinstance(answer, pb.GetInfoResponse)]

    def _stub(self, index: int) -> pb_grpc.IndexAdminStub:
        return pb_grpc.IndexAdminStub(self._channel(index))

    def _channel(self, index: int) -> grpc.aio.Channel:
        if index not in self._channels:
            self._channels[index] = grpc.aio.insecure_channel(self.addresses[index])
        return self._channels[index]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def merged_figures(per_worker: list[Sequence[pb.RecallFigure]]) -> list[pb.RecallFigure]:
    """One figure a (source, K) over every worker's: their sample sizes summed, their values
    merged as the supervisor's /metrics merges them (`merged_recall`)."""
    by_key: dict[tuple[str, int], list[pb.RecallFigure]] = {}
    for figures in per_worker:
        for figure in figures:
            by_key.setdefault((figure.source, figure.k), []).append(figure)
    return [
        pb.RecallFigure(
            source=source,
            k=k,
            value=merged_recall([f.value for f in figures], [f.samples for f in figures]),
            samples=sum(f.samples for f in figures),
        )
        for (source, k), figures in by_key.items()
    ]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
