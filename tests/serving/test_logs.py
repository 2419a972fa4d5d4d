"""The server's two log formats carry the same structured fields: an access-log line names the
call's method, protocol, status code and latency in text as in JSON."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from serving import logs
from serving.telemetry.history import TrafficHistory
from serving.telemetry.metrics import ServiceMetrics
from serving.transport.calls import CallRecorder


@pytest.fixture()
def restored_logging():
    """`logs.configure` replaces the root logger's handlers, as the server's start does: put back
    what pytest had."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_access_log_line_names_method_protocol_code_and_latency(fmt, capsys, restored_logging):
    logs.configure(fmt)
    recorder = CallRecorder(ServiceMetrics(), TrafficHistory(), access_log=True)
    recorder.finished("Search", "http", grpc.StatusCode.INVALID_ARGUMENT, 0.0123)
    line = capsys.readouterr().err.strip()
    if fmt == "json":
        entry = json.loads(line)
        assert entry["msg"] == "call"
        assert (entry["method"], entry["protocol"], entry["code"], entry["ms"]) == (
            "Search",
            "http",
            "INVALID_ARGUMENT",
            12.3,
        )
    else:
        assert line.endswith(
            "serving.transport.calls: call method=Search protocol=http code=INVALID_ARGUMENT ms=12.3"
        ), line


def test_a_text_line_keeps_its_traceback_after_the_fields(capsys, restored_logging):
    logs.configure("text")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("serving.transport.calls").exception(
            "Search failed", extra={"method": "Search", "code": "INTERNAL"}
        )
    head, *rest = capsys.readouterr().err.splitlines()
    assert head.endswith("Search failed method=Search code=INTERNAL") and rest[0].startswith("Traceback")
