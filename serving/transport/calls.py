"""What every call is finished by, whichever transport carried it (the gRPC servicers, the HTTP
routes): its count and latency, the traffic history, the access log, and a failure's status."""

from __future__ import annotations

import logging

import grpc

from serving.errors import status_of
from serving.logs import REQUEST_ID
from serving.telemetry.history import TrafficHistory
from serving.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class CallRecorder:
    """Counts and times every call, whatever carried it: one count in
    `simsearch_requests_total{method,code,protocol}`, one latency observation, the traffic
    history, and an access-log line when asked. The gRPC servicers and the HTTP routes both
    finish each call here."""

    def __init__(self, metrics: ServiceMetrics, history: TrafficHistory, access_log: bool = False) -> None:
        self.metrics = metrics
        self.history = history
        self.access_log = access_log
        # (method, code, protocol) → its counter and histogram children, bound once: `labels()`
        # hashes and locks on every call, and a call's few label sets repeat forever.
        self._children: dict[tuple[str, grpc.StatusCode, str], tuple] = {}

    def finished(self, method: str, protocol: str, code: grpc.StatusCode, elapsed: float) -> None:
        key = (method, code, protocol)
        children = self._children.get(key)
        if children is None:
            counter = self.metrics.requests.labels(method, code.name, protocol)
            children = (counter, self.metrics.latency.labels(method, protocol))
            self._children[key] = children
        children[0].inc()
        children[1].observe(elapsed)
        self.metrics.count_call()
        self.history.observe(elapsed)
        if self.access_log:
            fields = {"method": method, "protocol": protocol, "code": code.name, "ms": round(elapsed * 1e3, 3)}
            log.info("call", extra={"request_id": REQUEST_ID.get(), **fields})

    def failed(self, method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """The status a failed call is answered with, logged: a bug with its traceback."""
        code, message = status_of(exc)
        fields = {"request_id": REQUEST_ID.get(), "method": method, "code": code.name}
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method, extra=fields)
        else:
            log.warning("%s: %s", method, message, extra=fields)
        return code, message
