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
