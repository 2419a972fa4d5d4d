"""Python client for simsearch: deadlines on every call, retries on UNAVAILABLE."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

_RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "simsearch.v1.SimilaritySearch"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def condition(
    field: str,
    value: str | float | None = None,
    any_of: Sequence[str | float] | None = None,
    **bounds: float,
) -> pb.Condition:
    """One filter condition: `condition("category", "shoes")`, `condition("brand", any_of=["a", "b"])`,
    `condition("price", gte=10, lt=50)`; combine them in `pb.Filter(must=[...], should=[...], must_not=[...])`."""
    if value is not None:
        return pb.Condition(field=field, value=str(value))
    if any_of is not None:
        return pb.Condition(field=field, any_of=pb.ValueSet(values=[str(v) for v in any_of]))
    if bounds:
        return pb.Condition(field=field, range=pb.Range(**bounds))
    return pb.Condition(field=field)


class SearchClient:
    """A channel to one server. Use as a context manager or call `close()`."""

    def __init__(
        self,
        target: str,
        timeout: float = 10.0,
        admin_token: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        tls_ca: str | Path | None = None,
        token: str | None = None,
    ) -> None:
        self.timeout = timeout
        self.admin_token = admin_token
        self.metadata = [("authorization", f"Bearer {token}")] if token else None
        options = [
            ("grpc.service_config", _RETRY_SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A client is a connection of its own: by default gRPC Python shares one subchannel
            # between every channel to a target, so a server of worker processes
            # (`serve --processes`) saw all of a program's clients on one connection, one worker.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.SimilaritySearchStub(self.channel)
        self.admin = pb_grpc.IndexAdminStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> SearchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def healthy(self, service: str = "") -> bool:
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def search(self, request: pb.SearchRequest, timeout: float | None = None) -> pb.SearchResponse:
        return self.stub.Search(request, timeout=timeout or self.timeout, metadata=self.metadata)

    def search_image(
        self,
        image: bytes | str | Path,
        k: int = 10,
        request_id: str = "",
        label: str | None = None,
        exclude_ids: Sequence[str] = (),
        timeout: float | None = None,
        min_score: float | None = None,
        filter: pb.Filter | None = None,
    ) -> pb.SearchResponse:
        """`min_score`: every neighbour at or above that cosine similarity, at most k (k = 0: up
        to the server's max_k); the response's `truncated` says when k cut the answer."""
        data = image if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
        return self.search(
            pb.SearchRequest(
                image=bytes(data),
                k=k,
                request_id=request_id,
                label=label,
                exclude_ids=list(exclude_ids),
                min_score=min_score,
                filter=filter,
            ),
            timeout,
        )

    def search_embedding(
        self,
        values: Sequence[float],
        k: int = 10,
        timeout: float | None = None,
        min_score: float | None = None,
        filter: pb.Filter | None = None,
    ) -> pb.SearchResponse:
        return self.search(
            pb.SearchRequest(embedding=pb.Embedding(values=list(values)), k=k, min_score=min_score, filter=filter),
            timeout,
        )

    def search_item(
        self,
        item_id: str,
        k: int = 10,
        timeout: float | None = None,
        min_score: float | None = None,
        filter: pb.Filter | None = None,
    ) -> pb.SearchResponse:
        return self.search(pb.SearchRequest(item_id=item_id, k=k, min_score=min_score, filter=filter), timeout)

    def search_text(
        self,
        text: str,
        k: int = 10,
        timeout: float | None = None,
        min_score: float | None = None,
        filter: pb.Filter | None = None,
    ) -> pb.SearchResponse:
        return self.search(pb.SearchRequest(text=text, k=k, min_score=min_score, filter=filter), timeout)

    def search_batch(
        self, requests: Sequence[pb.SearchRequest], timeout: float | None = None
    ) -> pb.SearchBatchResponse:
        return self.stub.SearchBatch(
            pb.SearchBatchRequest(requests=list(requests)), timeout=timeout or self.timeout, metadata=self.metadata
        )

    def embed(self, image: bytes, timeout: float | None = None) -> pb.EmbedResponse:
        return self.stub.Embed(pb.EmbedRequest(image=image), timeout=timeout or self.timeout, metadata=self.metadata)

    def feedback(self, request_id: str, relevant_ids: Sequence[str]) -> pb.FeedbackResponse:
        return self.stub.Feedback(
            pb.FeedbackRequest(request_id=request_id, relevant_ids=list(relevant_ids)),
            timeout=self.timeout,
            metadata=self.metadata,
        )

    def get_info(self, timeout: float | None = None) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout or self.timeout, metadata=self.metadata)

    @property
    def _admin_metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.admin_token}")] if self.admin_token else []

    def reload(
        self,
        index_version: str = "",
        model_dir: str = "",
        timeout: float | None = None,
        restore_taken_down: bool = False,
    ) -> pb.ReloadResponse:
        """Load a version (default: CURRENT's); items taken down since a named version was built
        stay down (re-applied in a version derived from it) unless `restore_taken_down`."""
        return self.admin.Reload(
            pb.ReloadRequest(index_version=index_version, model_dir=model_dir, restore_taken_down=restore_taken_down),
            timeout=timeout or max(self.timeout, 60.0),
            metadata=self._admin_metadata,
        )

    def remove_items(
        self, ids: Sequence[str], reason: str = "", timeout: float | None = None
    ) -> pb.RemoveItemsResponse:
        """A takedown: returns once the server answers from a version without these items."""
        return self.admin.RemoveItems(
            pb.RemoveItemsRequest(ids=list(ids), reason=reason),
            timeout=timeout or max(self.timeout, 60.0),
            metadata=self._admin_metadata,
        )

    def add_items(
        self, items: Sequence[pb.NewItem], upsert: bool = False, timeout: float | None = None
    ) -> pb.AddItemsResponse:
        """An ingest: returns once the server answers from a version with these items."""
        return self.admin.AddItems(
            pb.AddItemsRequest(items=list(items), upsert=upsert),
            timeout=timeout or max(self.timeout, 60.0),
            metadata=self._admin_metadata,
        )
