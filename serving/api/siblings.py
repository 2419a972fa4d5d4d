"""A worker's siblings: the other worker processes of one `serve --processes N` server, each
reached on its own Unix socket (`serving.listen.worker_socket`). The kernel spreads connections,
not calls, over the workers, so a caller's next call may reach any of them: a reload one worker
makes — a Reload call, a rollback, an ingest's or a takedown's new version — is relayed to every
sibling and the call answers once all of them serve it. Each sibling loads it alone (a relayed
Reload is never relayed again, nor rolled back again: the version named is the one to load).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc
from serving.errors import Unavailable

log = logging.getLogger(__name__)

# Metadata of a Reload one worker relays to a sibling: "fresh" (a Reload call: load again even
# what is live) or "unless-live" (a write's new version, which the sibling's CURRENT watcher
# may have loaded already).
RELAYED = "x-simsearch-relayed"
FRESH, UNLESS_LIVE = "fresh", "unless-live"
RELAY_TIMEOUT_S = 300.0  # a load with its run-size measurement, on a machine every worker shares


class Siblings:
    """The other workers of this worker's server, and the reloads relayed to them."""

    def __init__(self, own: int, addresses: dict[int, str], admin_token: str | None) -> None:
        self.own = own
        self.addresses = addresses  # each sibling's gRPC address, by its index
        self._auth = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
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

    def _stub(self, index: int) -> pb_grpc.IndexAdminStub:
        if index not in self._channels:
            self._channels[index] = grpc.aio.insecure_channel(self.addresses[index])
        return pb_grpc.IndexAdminStub(self._channels[index])

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
