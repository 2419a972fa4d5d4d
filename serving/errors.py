"""Errors the search logic raises, each tied to the gRPC status it becomes at the edge."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


INTERNAL_MESSAGE = "internal error; see server logs"


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message an RPC that raised `exc` is answered with: a service error's own;
    anything else is a bug, INTERNAL, its details kept for the server's log."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
