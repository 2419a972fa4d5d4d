"""Structured (JSON-lines) logging for the server, with request ids where there is one."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

# A record's structured fields (`extra=`), in the order both formats write them. `deployment`
# and `replica`: which process of a sharded server (`serve --ray`) wrote it; `worker`: which of
# a server's worker processes (`serve --processes N`).
FIELDS = (
    "request_id", "method", "protocol", "code", "ms", "index_version", "model_id", "peer", "shard", "deployment",
    "replica", "worker",
)  # fmt: skip


def shard_label(number: int) -> str:
    """A shard's name as answers, errors, metrics and records' `shard` field give it ("000", "001", ...):
    here, where a replica (`serving.ray_serve.replicas`) and a shard's search (`serving.shards.searcher`) both
    import it without importing each other."""
    return f"{number:03d}"


# The request a call answers, where it has one (a Search's request_id, given or made up): set by
# the service, read by the call's access line and failure log, which are written outside it.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def one_line(text: str) -> str:
    """A paragraph (Ray's: a dead actor's or worker's ids, its likely causes) as one line."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def failure_reason(exc: BaseException, typed: bool = True, first: bool = False) -> str:
    """An exception as one line: its message's last non-blank line (a remote error's message is a
    traceback that ends with the error; `first`: its first line), after its type's name. With
    `typed=False` the line alone, or the type's name where the message is blank."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = (lines[0] if first else lines[-1]) if lines else ""
    if not typed:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}".rstrip(": ")


def fields_of(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields a record carries (an access-log line's method, code, protocol, ms)."""
    return {name: value for name in FIELDS if (value := getattr(record, name, None)) is not None}


class JsonFormatter(logging.Formatter):
    FIELDS = FIELDS

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(fields_of(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a record relayed from another process carries its traceback as text
            entry["exc"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """One line a record for people: the message, then its structured fields as key=value
    (without them an access-log line is only `call`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{name}={value}" for name, value in fields_of(record).items())
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # after the message, before any traceback
        return f"{head} {fields}{newline}{rest}"


def _name_worker(worker: str) -> Callable[[logging.LogRecord], bool]:
    """A handler's filter (logging takes a callable) that names the worker on every record."""

    def name(record: logging.LogRecord) -> bool:
        record.worker = worker
        return True

    return name


def configure(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # A worker of `serve --processes N` (serving.listen.WORKER_ENV, "I/N"): its records say which
    # one wrote them, since the workers share the supervisor's standard error.
    if worker := os.environ.get("SIMSEARCH_WORKER", "").partition("/")[0]:
        handler.addFilter(_name_worker(worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# -- a sharded server's records, relayed to the command that started it -----------------------


class Sink(Protocol):
    """Where relayed records travel (a Ray queue between a `serve --ray` command and its replicas)."""

    def put_nowait(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


SHIP_EVERY_S = 0.2  # a shipper sends what it holds this often (a batch a call, whatever the log rate)
SHIP_MOST = 512  # records a batch; past `HELD_MOST` waiting, new ones are dropped and counted
HELD_MOST = 10_000
OWN_LOGGERS = ("serving", "index", "core", "simsearch")


class RecordShipper(logging.Handler):
    """A replica's records at `level` and above, shipped in batches to `sink` by a thread of
    its own (a log call never waits on the network), named by `deployment` and the replica's
    pid, their tracebacks as text: `relay` in the command writes them in its own format."""

    def __init__(self, sink: Sink, deployment: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.sink = sink
        self.deployment = deployment
        self.replica = str(os.getpid())
        self.dropped = 0
        self._held: queue.SimpleQueue[dict] = queue.SimpleQueue()
        threading.Thread(target=self._ship, name="log-shipper", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and record.name.split(".", 1)[0] not in OWN_LOGGERS:
            return  # the server's own lines (access log, loads) as `serve` writes them; others' warnings
        if self._held.qsize() >= HELD_MOST:
            self.dropped += 1
            return
        try:
            self._held.put(self.plain(record))
        except Exception:  # noqa: BLE001 - a record that cannot be made plain must not fail the caller
            self.handleError(record)

    def plain(self, record: logging.LogRecord) -> dict:
        """The record as plain data: its message formatted, its traceback as text."""
        exc_text = record.exc_text
        if record.exc_info and not exc_text:
            exc_text = logging.Formatter().formatException(record.exc_info)
        message = record.getMessage()
        if record.name.split(".", 1)[0] not in OWN_LOGGERS:  # Ray's paragraphs (a dead actor's ids): one line
            message = one_line(message)
        entry = {
            "name": record.name, "levelno": record.levelno, "levelname": record.levelname, "msg": message,
            "created": record.created, "msecs": record.msecs, "exc_text": exc_text,
        }  # fmt: skip
        entry.update(fields_of(record))
        entry.setdefault("deployment", self.deployment)
        entry.setdefault("replica", self.replica)
        return entry

    def _ship(self) -> None:
        while True:
            batch = [self._held.get()]
            deadline = time.monotonic() + SHIP_EVERY_S
            while len(batch) < SHIP_MOST and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self._held.get(timeout=left))
                except queue.Empty:
                    break
            try:
                self.sink.put_nowait(batch)
            except Exception:  # noqa: BLE001 - the command is gone or its queue full: the records are lost
                self.dropped += len(batch)


def ship_records(sink: Sink | None, deployment: str, level: int = logging.WARNING) -> None:
    """In a replica: its records at `level` and above (and Serve's own warnings) go to `sink`."""
    if sink is None:
        return
    shipper = RecordShipper(sink, deployment, level)
    root = logging.getLogger()
    root.addHandler(shipper)
    root.setLevel(min(root.level, level) if root.level else level)
    serve_logger = logging.getLogger("ray.serve")  # Serve's logger does not propagate to the root
    if not serve_logger.propagate:
        serve_logger.addHandler(RecordShipper(sink, deployment, logging.WARNING))


def relay(sink: Sink, stopped: threading.Event) -> None:
    """In the command: every record its replicas ship, written by this process's own handlers
    (the same JSON or text lines as `serve`), until `stopped`."""
    while not stopped.is_set():
        try:
            batch = sink.get(timeout=0.5)
        except queue.Empty:
            continue
        except Exception:  # noqa: BLE001 - the queue's actor gone (the cluster going down): try again
            stopped.wait(1.0)
            continue
        for entry in batch:
            record = logging.makeLogRecord({**entry, "args": None, "exc_info": None})
            logging.getLogger(record.name).handle(record)
