"""Structured (JSON-lines) logging for the server, with request ids where there is one."""

from __future__ import annotations

import json
import logging
import time

# A record's structured fields (`extra=`), in the order both formats write them.
FIELDS = ("request_id", "method", "protocol", "code", "ms", "index_version", "model_id", "peer")


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


def configure(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
