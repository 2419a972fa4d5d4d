"""HTTP/JSON beside gRPC, in the same process and on the same event loop (aiohttp).

Each route is one entry of `ROUTES` (`serving.transport.routes`): its method and path, the call on the
service layer it makes, the protobuf messages it takes and returns (bodies are their proto3 JSON
mapping, `google.protobuf.json_format`: camelCase names, bytes as base64), and who may call it.
The same table registers the routes here and writes the OpenAPI document (`serving.transport.openapi`), so
the two cannot drift. Routes are thin: validation, admission, error mapping and counting are the service
layer's and the `CallRecorder`'s, shared with the gRPC servicers — a failure is the same
`ServiceError`, answered with its HTTP status (`ServiceError.http_status`, after google.rpc.Code's
mapping) and `{"error": {"code": "INVALID_ARGUMENT", "message": "…"}}`.

The web console (`serving/console/`) is served at `/`; its images come from
`/v1/items/{id}/thumbnail`, by item id only — never a path a request names.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf import json_format
from google.protobuf.message import Message

from core.data.catalog import parse_bbox
from protos.simsearch.v1 import search_pb2 as pb
from serving.api.admin_service import AdminService
from serving.api.search_service import SearchService
from serving.errors import InvalidArgument, PayloadTooLarge, ServiceError, json_name, status_of
from serving.transport.auth import Tokens, token_fingerprint
from serving.transport.calls import CallRecorder
from serving.transport.json_bodies import INT32_MAX, INT32_MIN, FieldChecks, count_items, parse_json, to_json
from serving.transport.openapi import Served, openapi_document
from serving.transport.routes import IMAGE_TYPES, QUERY_BOUNDS, ROUTES, TIMEOUT_HEADER, Route

log = logging.getLogger(__name__)

CONSOLE_DIR = Path(__file__).resolve().parent.parent / "console"
# The console's own files only: no inline script or style, images from the server or made in the page.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' blob: data:; style-src 'self'; script-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
# aiohttp's default of 8 KiB is short for a Filter in the query string of /v1/search/image; a longer
# request line is refused by aiohttp itself (400, in plain text).
MAX_REQUEST_LINE = 64 * 1024


class UnsupportedMediaType(InvalidArgument):
    http_status = 415


class NotFoundRoute(InvalidArgument):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class WrongMethod(InvalidArgument):
    http_status = 405


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, where a request aiohttp cannot parse (a malformed header, a NUL
    byte) is one warning line: it is the client's error, answered 400, and a client must not be
    able to fill the error log with tracebacks. Errors of the server's own stay errors."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError) and 400 <= exc_info.code < 500:
            text = str(msg) % args if args else str(msg)
            # aiohttp's message quotes the bad line on lines of its own: kept, on this one
            reason = " ".join(line.strip() for line in str(exc_info.message).splitlines() if line.strip())
            self.warning("%s: %s (answered %d)", text, reason, exc_info.code)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _query_number(request: web.Request, name: str) -> int | None:
    """A whole-number query parameter (None: not given)."""
    text = request.query.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name}: not a whole number: {text!r}") from None


def error_response(exc: ServiceError | Exception) -> web.Response:
    code, message = status_of(exc, json_names=True)
    status = exc.http_status if isinstance(exc, ServiceError) else 500
    return web.json_response({"error": {"code": code.name, "message": message}}, status=status)


class HttpApi:
    """The routes of `ROUTES` over the service layer."""

    def __init__(
        self,
        service: SearchService,
        admin: AdminService,
        tokens: Tokens,
        recorder: CallRecorder,
        max_body_bytes: int,
        cors_origin: str | None = None,
    ) -> None:
        self.service = service
        # SearchRequest's integer fields the service layer bounds: a number past int32 in a query
        # string or JSON body meets the same check, and the same message, as one within it
        self.bounded: FieldChecks = {"k": service.checks.check_k, "per_group": service.checks.check_per_group}
        self.admin = admin
        self.tokens = tokens
        self.recorder = recorder
        self.max_body_bytes = max_body_bytes
        self.cors_origin = cors_origin
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- the application -------------------------------------------------------------------

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._unrouted])
        for route in ROUTES:
            app.router.add_route(route.method, route.path.replace("{item_id}", "{item_id:.+}"), self._handler(route))
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/", self._console_page)
        if CONSOLE_DIR.is_dir():
            app.router.add_static("/console/", CONSOLE_DIR, follow_symlinks=False)
        if self.cors_origin:
            app.router.add_route("OPTIONS", "/{tail:.*}", self._preflight)
        app.on_response_prepare.append(self._headers)
        return app

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None, shared: bool = False) -> int:
        """Listen on `host:port` (0: a free port); the port bound. `shared`: with SO_REUSEPORT, as
        each of one server's processes does (`serving.workers`), never otherwise."""
        self._runner = web.AppRunner(
            self.application(),
            access_log=None,
            handle_signals=False,
            logger=ServerLog(logging.getLogger("aiohttp.server")),
            max_line_size=MAX_REQUEST_LINE,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls, reuse_port=shared)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace: float | None) -> None:
        """Stop taking connections; calls in flight get `grace` seconds to finish."""
        if self._runner is not None:
            # aiohttp takes the drain time only at construction; the grace is known only now.
            self._runner._shutdown_timeout = grace or 0.0
            await self._runner.cleanup()
            self._runner = None

    def _handler(self, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        call = getattr(self, route.call)

        async def handle(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                self.tokens.check(route.scope, request.headers.get("Authorization"))
                self._timeout(request)  # refused on every route alike when malformed, as the document says
                answer = await call(request, route)
                return web.json_response(to_json(answer)) if isinstance(answer, Message) else answer
            except web.HTTPRequestEntityTooLarge:
                size = f"body of {request.content_length} bytes" if request.content_length else "body"
                error = PayloadTooLarge(
                    f"{size} exceeds the server's limit of {self.max_body_bytes} bytes (--max-message-bytes)"
                )
                code = error.code
                return error_response(error)
            except Exception as exc:  # noqa: BLE001 — every failure is answered, a bug as INTERNAL
                code, _ = self.recorder.failed(route.name, exc)
                return error_response(exc)
            finally:
                self.recorder.finished(route.name, "http", code, time.perf_counter() - started)

        handle.__name__ = route.call
        return handle

    @web.middleware
    async def _unrouted(self, request: web.Request, handler) -> web.StreamResponse:
        """aiohttp's own 404/405 pages, as the API's JSON errors."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return error_response(NotFoundRoute(f"no route {request.method} {request.path}"))
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            response = error_response(WrongMethod(f"{request.method} is not allowed on {request.path}; use {allowed}"))
            response.headers["Allow"] = allowed  # RFC 9110 §15.5.6: a 405 names the methods the target takes
            return response

    async def _headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        if self.cors_origin and request.headers.get("Origin") == self.cors_origin:
            response.headers["Access-Control-Allow-Origin"] = self.cors_origin
            response.headers["Vary"] = "Origin"

    async def _preflight(self, request: web.Request) -> web.Response:
        if request.headers.get("Origin") != self.cors_origin:
            return web.Response(status=403)
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": f"Authorization, Content-Type, {TIMEOUT_HEADER}",
                "Access-Control-Max-Age": "600",
            },
        )

    async def _openapi(self, request: web.Request) -> web.Response:
        served = Served(self.service.engine.limits)
        if self.service.engine.loaded:  # the rules that hang on the live model and index version
            pair = self.service.engine.pair
            manifest = pair.manifest
            served = Served(served.limits, pair.dim, tuple(manifest.filterable.items()), manifest.item_field)
        return web.json_response(openapi_document(served))

    async def _console_page(self, request: web.Request) -> web.StreamResponse:
        page = CONSOLE_DIR / "index.html"
        if not page.is_file():
            return error_response(NotFoundRoute("this server has no console files"))
        return web.FileResponse(page, headers={"Cache-Control": "no-cache"})

    # -- reading requests ------------------------------------------------------------------

    @staticmethod
    def _timeout(request: web.Request) -> float | None:
        text = request.headers.get(TIMEOUT_HEADER)
        if text is None:
            return None
        try:
            timeout = float(text)
        except ValueError:
            raise InvalidArgument(f"{TIMEOUT_HEADER}: not a number of seconds: {text!r}") from None
        if not 0 < timeout < float("inf"):
            raise InvalidArgument(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {text}")
        return timeout

    async def _message(
        self, request: web.Request, message: Message, before: Callable[[dict], None] | None = None
    ) -> Message:
        kind = request.content_type
        if request.can_read_body and kind not in ("application/json", "application/octet-stream"):
            raise UnsupportedMediaType(f"Content-Type {kind!r}: send application/json")
        return parse_json(await request.read(), message, self.bounded, before)

    async def _image(self, request: web.Request) -> bytes:
        """The image of a request: its raw body, or the `image` field of a multipart upload."""
        kind = request.content_type
        if kind == "multipart/form-data":
            # aiohttp's reader raises ValueError for a missing or bad boundary (when made) and for
            # a body that does not follow it, HttpProcessingError for a part's bad headers (when
            # read): the client's error, not ours.
            try:
                reader = await request.multipart()
                async for part in reader:
                    if part.name != "image":  # as a JSON body's unknown field is refused
                        raise InvalidArgument(f"multipart upload: unknown field {part.name!r}; send only 'image'")
                    return bytes(await part.read())
            except (ValueError, HttpProcessingError) as exc:
                reason = " ".join(str(getattr(exc, "message", exc)).split())
                raise InvalidArgument(
                    f"multipart/form-data: not a readable upload ({reason}); send a boundary in "
                    "the Content-Type and the image as the 'image' field"
                ) from None
            raise InvalidArgument("multipart upload has no 'image' field")
        if not kind.startswith(IMAGE_TYPES):
            raise UnsupportedMediaType(
                f"Content-Type {kind!r}: send the image as the body (image/*, application/octet-stream) "
                "or as the 'image' field of multipart/form-data"
            )
        data = await request.read()
        if not data:
            raise InvalidArgument("image: the body is empty")
        return data

    @staticmethod
    def _query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
        """A route's own integer query parameter (`QUERY_BOUNDS`)."""
        value = _query_number(request, name)
        if value is None:
            return default
        if not low <= value <= high:
            raise InvalidArgument(f"{name} must be within {low}..{high}, got {value}")
        return value

    def _search_int(self, request: web.Request, field: str) -> int | None:
        """A SearchRequest field given in the query string (None: not given), left to the service
        layer's check of that field, as a JSON body's or a gRPC request's is; a number past int32
        cannot be set on the request, and is refused by that same check here."""
        value = _query_number(request, json_name(field))
        if value is not None and not INT32_MIN <= value <= INT32_MAX:
            self.bounded[field](value)
        return value

    # -- the calls: one service call each ---------------------------------------------------

    async def search(self, request: web.Request, route: Route) -> Message:
        message = await self._message(request, pb.SearchRequest())
        return await self.service.search(message, self._timeout(request))

    async def search_image(self, request: web.Request, route: Route) -> Message:
        query = request.query
        # k left out is 0, as in a JSON body or over gRPC: the service layer's default
        message = pb.SearchRequest(k=self._search_int(request, "k") or 0)
        unknown = set(query) - {name for name, _, _ in route.params}
        if unknown:
            raise InvalidArgument(f"unknown query parameter {sorted(unknown)[0]!r}")
        if "minScore" in query:
            try:
                message.min_score = float(query["minScore"])
            except ValueError:
                raise InvalidArgument(f"minScore: not a number: {query['minScore']!r}") from None
        if "filter" in query:
            try:
                json_format.Parse(query["filter"], message.filter)
            except json_format.ParseError as exc:
                raise InvalidArgument(f"filter is not a Filter in proto3 JSON: {exc}") from None
        message.exclude_ids.extend(i for i in query.get("excludeIds", "").split(",") if i)
        message.request_id = query.get("requestId", "")
        if "label" in query:
            message.label = query["label"]
        if "groupBy" in query:
            message.group_by = query["groupBy"]
        if "perGroup" in query:  # 0 is refused as out of range, not read as unset
            message.per_group = self._search_int(request, "per_group")
        if "region" in query:
            try:
                x, y, width, height = parse_bbox(query["region"])
            except ValueError as exc:
                raise InvalidArgument(f"region: {exc}") from None
            message.region.CopyFrom(pb.Region(x=x, y=y, width=width, height=height))
        message.image = await self._image(request)
        return await self.service.search(message, self._timeout(request))

    async def search_batch(self, request: web.Request, route: Route) -> Message:
        message = await self._message(request, pb.SearchBatchRequest())
        return await self.service.search_batch(message, self._timeout(request))

    async def embed(self, request: web.Request, route: Route) -> Message:
        message = await self._message(request, pb.EmbedRequest())
        return await self.service.embed(message, self._timeout(request))

    async def embed_image(self, request: web.Request, route: Route) -> Message:
        message = pb.EmbedRequest(image=await self._image(request))
        return await self.service.embed(message, self._timeout(request))

    async def feedback(self, request: web.Request, route: Route) -> Message:
        return await self.service.feedback(await self._message(request, pb.FeedbackRequest()))

    async def info(self, request: web.Request, route: Route) -> Message:
        return await self.service.info()

    async def thumbnail(self, request: web.Request, route: Route) -> web.Response:
        size = self._query_int(request, "size", 160, *QUERY_BOUNDS["size"])
        data, content_type = await self.service.thumbnail(request.match_info["item_id"], size)
        return web.Response(body=data, content_type=content_type, headers={"Cache-Control": "private, max-age=300"})

    async def history(self, request: web.Request, route: Route) -> web.Response:
        return web.json_response(self.service.history(self.recorder.history))

    async def duplicates(self, request: web.Request, route: Route) -> web.Response:
        return web.json_response(self.admin.duplicates(self.service.engine.pair.version))

    @staticmethod
    def _caller(request: web.Request) -> str:
        """Who made an admin call, for the audit log: its token's fingerprint and the peer."""
        return f"{token_fingerprint(request.headers.get('Authorization'))} from {request.remote}"

    async def reload(self, request: web.Request, route: Route) -> Message:
        return await self.admin.reload(await self._message(request, pb.ReloadRequest()), self._caller(request), "http")

    async def remove_items(self, request: web.Request, route: Route) -> Message:
        message = await self._message(request, pb.RemoveItemsRequest())
        return await self.admin.remove_items(message, self._caller(request), "http")

    async def add_items(self, request: web.Request, route: Route) -> Message:
        message = await self._message(request, pb.AddItemsRequest(), count_items)
        return await self.admin.add_items(message, self._caller(request), "http")

    async def versions(self, request: web.Request, route: Route) -> web.Response:
        live = self.service.engine.pair.version if self.service.engine.loaded else None
        return web.json_response({"versions": self.admin.versions(live)})

    async def neighbours_sheet(self, request: web.Request, route: Route) -> web.Response:
        return web.FileResponse(self.admin.neighbours_sheet(request.match_info["version"]))

    async def make_live(self, request: web.Request, route: Route) -> Message:
        unknown = set(request.query) - {name for name, _, _ in route.params}
        if unknown:
            raise InvalidArgument(f"unknown query parameter {sorted(unknown)[0]!r}")
        restore = request.query.get("restoreTakenDown", "false")
        if restore not in ("true", "false"):
            raise InvalidArgument(f"restoreTakenDown must be true or false, got {restore!r}")
        version = request.match_info["version"]
        return await self.admin.make_live(version, self._caller(request), "http", restore == "true")

    async def audit(self, request: web.Request, route: Route) -> web.Response:
        limit = self._query_int(request, "limit", 100, *QUERY_BOUNDS["limit"])
        return web.json_response({"entries": self.admin.audit(limit)})


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context
