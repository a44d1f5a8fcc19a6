"""Logging setup: stdlib logging, human-readable or one JSON object per line.

Configured once by the CLI (never in a constructor). Records never carry secrets: the
gateway logs replicas by index and ``host:port`` only, and never logs headers or bodies.

Request ids: ``routes`` sets ``REQUEST_ID`` (a context variable, so it is private to the
request's task) when it assigns a request its ``X-Request-Id``; every record logged while
serving that request carries it as ``request_id``.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Literal

import orjson

__all__ = ["REQUEST_ID", "JsonFormatter", "TextFormatter", "configure_logging", "escape"]

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

# C0 and C1 controls (CR, LF, ESC, ...), except TAB, as backslash escapes.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09}
_CONTROLS |= {0x0A: "\\n", 0x0D: "\\r"}


def escape(text: str) -> str:
    """One record, one line: a request-controlled string (an adapter name, a path) must
    not be able to forge a log line or move the cursor of whoever tails the log."""
    return text.translate(_CONTROLS)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": escape(record.getMessage()),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            data["request_id"] = request_id
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(data).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{text} [request_id={request_id}]" if request_id else text


def configure_logging(fmt: Literal["text", "json"] = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx/httpcore log every request at INFO: noise on the hot path.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
