"""The HTTP/JSON API's one table of routes: each route's method and path, the `HttpApi` call that
answers it, the protobuf messages it takes and returns, its query parameters and who may call it.
The HTTP handlers (`serving.transport.http`) register it and the OpenAPI document (`serving.transport.openapi`) is
written from it, so the two cannot drift."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from protos.simsearch.v1 import search_pb2 as pb
from serving.search.checks import DEFAULT_K, MAX_ADD_ITEMS
from serving.transport.auth import Scope

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds, the HTTP form of a gRPC deadline
IMAGE_TYPES = ("image/", "application/octet-stream")
# The bounds of the routes' own integer query parameters, checked by the handlers and stated in the
# OpenAPI document.
QUERY_BOUNDS = {"size": (16, 512), "limit": (1, 10_000)}


@dataclass(frozen=True)
class Route:
    """One HTTP route: `call` is the `HttpApi` method that answers it."""

    method: str
    path: str
    name: str  # the call's name in metrics and logs: the gRPC method it mirrors, where there is one
    call: str
    summary: str
    scope: Scope = Scope.SEARCH
    request: type[Message] | None = None  # a JSON body of this message
    response: type[Message] | None = None  # a JSON body of this message (None: described in `produces`)
    body: str | None = None  # "image": the raw image (or a multipart upload); described by `params`
    params: tuple[tuple[str, str, str], ...] = ()  # (name, type, description) of query parameters
    produces: str | None = None  # a response that is not a message: its content type
    tag: str = "search"


_IMAGE_QUERY_PARAMS = (
    ("k", "integer", f"neighbours to return (default {DEFAULT_K}; with minScore: up to the server's max_k)"),
    ("minScore", "number", "every neighbour at or above this cosine similarity"),
    ("filter", "string", "a Filter as proto3 JSON (URL-encoded)"),
    ("excludeIds", "string", "item ids to leave out, comma-separated"),
    ("requestId", "string", "the request's id, for Feedback (default: made up)"),
    ("label", "string", "the query's true label, scored into the traffic Recall@K"),
    ("groupBy", "string", "k counts groups of this declared field (default: the index's item field; empty: none)"),
    ("perGroup", "integer", "rows per group (default 1)"),
    ("region", "string", "x,y,width,height: search for that crop, in pixels of the upright image"),
)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/search", "Search", "search", "Nearest neighbours of an image, embedding, item id or text",
          request=pb.SearchRequest, response=pb.SearchResponse),
    Route("POST", "/v1/search/image", "Search", "search_image",
          "Nearest neighbours of an image sent as the raw body or a multipart upload (field `image`)",
          response=pb.SearchResponse, body="image", params=_IMAGE_QUERY_PARAMS),
    Route("POST", "/v1/search-batch", "SearchBatch", "search_batch", "Several searches in one call",
          request=pb.SearchBatchRequest, response=pb.SearchBatchResponse),
    Route("POST", "/v1/embed", "Embed", "embed", "The embedding of an image", request=pb.EmbedRequest,
          response=pb.EmbedResponse),
    Route("POST", "/v1/embed/image", "Embed", "embed_image", "The embedding of an image sent as the raw body",
          response=pb.EmbedResponse, body="image"),
    Route("POST", "/v1/feedback", "Feedback", "feedback", "Which neighbours of an answer were relevant",
          request=pb.FeedbackRequest, response=pb.FeedbackResponse),
    Route("GET", "/v1/info", "GetInfo", "info", "The live versions, limits and recall figures",
          response=pb.GetInfoResponse),
    Route("GET", "/v1/items/{item_id}/thumbnail", "Thumbnail", "thumbnail",
          "An indexed item's image, scaled down (by item id only)", produces="image/jpeg",
          params=(("size", "integer", "longest side in pixels, 16..512 (default 160)"),)),
    Route("GET", "/v1/health/history", "History", "history",
          "The last hour of q/s and p50/p99 latency, the live recall figures and versions",
          produces="application/json"),
    Route("GET", "/v1/duplicates", "Duplicates", "duplicates",
          "The groups of the live version's latest `index duplicates` run (none: `run` is null)",
          produces="application/json"),
    Route("POST", "/v1/admin/reload", "Reload", "reload", "Load a version (default: CURRENT's) and swap it in",
          scope=Scope.ADMIN, request=pb.ReloadRequest, response=pb.ReloadResponse, tag="admin"),
    Route("POST", "/v1/admin/remove-items", "RemoveItems", "remove_items",
          "Take items down: a new version without them, swapped in", scope=Scope.ADMIN,
          request=pb.RemoveItemsRequest, response=pb.RemoveItemsResponse, tag="admin"),
    Route("POST", "/v1/admin/add-items", "AddItems", "add_items",
          f"Ingest items (images, embedded by the live model, or embeddings; up to {MAX_ADD_ITEMS:,} a call): a new "
          "version with them, swapped in before the answer", scope=Scope.ADMIN,
          request=pb.AddItemsRequest, response=pb.AddItemsResponse, tag="admin"),
    Route("GET", "/v1/admin/versions", "ListVersions", "versions", "Every version with its manifest figures",
          scope=Scope.ADMIN, produces="application/json", tag="admin"),
    Route("GET", "/v1/admin/versions/{version}/neighbours.png", "VersionSheet", "neighbours_sheet",
          "A version's sample queries and their neighbours", scope=Scope.ADMIN, produces="image/png", tag="admin"),
    Route("POST", "/v1/admin/versions/{version}/live", "MakeLive", "make_live",
          "Make this version live (what `index rollback --to` does) and load it; items taken down since it was "
          "built stay down (a version derived from it without them is published) unless restoreTakenDown=true",
          scope=Scope.ADMIN, response=pb.ReloadResponse, tag="admin",
          params=(("restoreTakenDown", "boolean",
                   "serve the items taken down since this version was built again (audited by id)"),)),
    Route("GET", "/v1/admin/audit", "Audit", "audit", "The takedown audit log, newest first", scope=Scope.ADMIN,
          produces="application/json", params=(("limit", "integer", "entries to return (default 100)"),),
          tag="admin"),
)  # fmt: skip
