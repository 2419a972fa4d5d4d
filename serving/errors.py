"""Errors the search logic raises, each tied to the gRPC status and the HTTP status it becomes at
the edge (the HTTP one after google.rpc.Code's mapping)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from core.data.preprocess import ImageDecodeError, ImageTooLarge


class ServiceError(Exception):
    """`field`: the request field the message names, by its protobuf name (`request_id`); each
    transport says it as its clients spell it (`message_for`: `requestId` in HTTP/JSON)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def message_for(self, json_names: bool) -> str:
        """The message as a transport says it: over HTTP/JSON (`json_names`) the field it names
        (its first mention: a value quoted after it is the client's) is spelled as the JSON body
        and query string spell it."""
        if not json_names or self.field is None:
            return self.message
        return re.sub(rf"(?<![\w-]){re.escape(self.field)}(?![\w-])", json_name(self.field), self.message, count=1)


def json_name(field: str) -> str:
    """A protobuf field's proto3 JSON name (`per_group` → `perGroup`), as protoc derives it."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), field)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class PayloadTooLarge(ResourceExhausted):
    """A request bigger than the server takes — a message past the size limit, an image past the
    pixel limit (a decompression bomb): RESOURCE_EXHAUSTED over gRPC, 413 over HTTP."""

    http_status = 413


INTERNAL_MESSAGE = "internal error; see server logs"


def status_of(exc: Exception, json_names: bool = False) -> tuple[grpc.StatusCode, str]:
    """The status and message an RPC that raised `exc` is answered with: a service error's own
    (`json_names`: its field as HTTP/JSON names it); anything else is a bug, INTERNAL, its details
    kept for the server's log."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message_for(json_names)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def image_error(exc: ImageDecodeError) -> ServiceError:
    """An image error as a service error: past the pixel limit, PayloadTooLarge; the rest INVALID_ARGUMENT."""
    if isinstance(exc, ImageTooLarge):
        return PayloadTooLarge(str(exc))
    return InvalidArgument(f"cannot decode image: {exc}")


@contextmanager
def image_errors() -> Iterator[None]:
    """Image errors raised as service errors (`image_error`)."""
    try:
        yield
    except ImageDecodeError as exc:
        raise image_error(exc) from exc


@contextmanager
def at_place(i: int, field: str = "requests") -> Iterator[None]:
    """Entry `i` of a call's list (a batch's requests, an AddItems call's items): one bad entry
    fails the call, so its error says which it was (`requests[3]: …`). The call's own errors —
    its deadline, no pair to answer — are not the entry's, and are left as they are."""
    try:
        yield
    except (DeadlineExceeded, Unavailable):
        raise
    except ServiceError as exc:
        raise type(exc)(f"{field}[{i}]: {exc.message}", exc.field) from exc
