"""Logging setup: stdlib logging, human-readable or one JSON object per line.

Configured once by the CLI (never in a constructor). Records never carry secrets: the
gateway logs replicas by index and ``scheme://host:port`` only (``Replica.display``,
credentials stripped), and never logs headers or bodies.

Structured fields. A call site passes what an on-call searches by as ``extra=`` (only the
names in ``FIELDS``): ``event`` (a stable snake_case name of what happened, e.g.
``replica_ejected``), ``replica`` (its index) and ``replica_url``, ``run``, ``adapter``,
``kind`` (what a failure was: ``dns``, ``refused``, ``reset``, ``connect_timeout``,
``timeout``, ``tls``, ``unreachable``: the same word as the ``kind`` label of
``gateway_upstream_errors_total``), ``status``. JSON lines carry them as keys; text lines
append them as ``key=value``. Timestamps are UTC ISO-8601 with milliseconds and a ``Z``.

Request ids: ``gateway.api.requests`` sets ``REQUEST_ID`` (a context variable, so it is
private to the request's task) when a request arrives; every record logged while serving
that request carries it as ``request_id``.

Logger names are the gateway's own: uvicorn's ``uvicorn.error`` (server start and stop
lines) is written as ``gateway.server`` and ``uvicorn.access`` as ``gateway.access``, so
one prefix, ``gateway.``, selects every line the process writes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = [
    "FIELDS",
    "REQUEST_ID",
    "JsonFormatter",
    "Repeats",
    "Streak",
    "TextFormatter",
    "configure_logging",
    "escape",
    "timestamp",
]

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

FIELDS = (
    "event", "request_id", "replica", "replica_url", "run", "adapter", "kind", "status",
)  # fmt: skip
"""The structured fields a record may carry (``extra=``), in the order they are written."""

# Third-party loggers whose lines are the gateway's own: written under its names.
_RENAMED = {"uvicorn.error": "gateway.server", "uvicorn.access": "gateway.access",
            "uvicorn": "gateway.server"}  # fmt: skip

# C0 and C1 controls (CR, LF, ESC, ...), except TAB, as backslash escapes.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09}
_CONTROLS |= {0x0A: "\\n", 0x0D: "\\r"}


def escape(text: str) -> str:
    """One record, one line: a request-controlled string (an adapter name, a path) must
    not be able to forge a log line or move the cursor of whoever tails the log."""
    return text.translate(_CONTROLS)


def timestamp(created: float) -> str:
    """``created`` (epoch seconds) as UTC ISO-8601 with milliseconds: sortable as text,
    and fine enough to order the lines of one rollout's retry across replicas."""
    seconds = int(created)
    millis = min(int((created - seconds) * 1000), 999)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is None:
            continue
        if not isinstance(value, (int, float, bool)):
            value = escape(str(value))
        out[name] = value
    return out


class _RequestIdFilter(logging.Filter):
    """Tags a record with the request being served (unless the call site named one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname,
            "logger": _RENAMED.get(record.name, record.name),
            "message": escape(record.getMessage()),
        }
        data |= _fields(record)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(data).decode()


def _text_value(value: Any) -> str:
    text = str(value)
    return orjson.dumps(text).decode() if not text or " " in text or '"' in text else text


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <message> key=value ...``; values with a space are
    quoted."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        name = _RENAMED.get(record.name, record.name)
        text = f"{timestamp(record.created)} {record.levelname} {name}: {escape(record.message)}"
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        return f"{text} {pairs}" if pairs else text


@dataclass
class Streak:
    """A condition that keeps happening (a replica failing its probes): since when, how
    often, and what it was the last time."""

    detail: str
    since: float
    count: int = 1
    logged_at: float = 0.0


class Repeats:
    """Which occurrences of a repeating condition are worth a log line: the first, each
    change of its ``detail`` (refused, then DNS), and then one every ``every_s`` while it
    lasts. A down replica is probed every ``health_interval_s`` (0.5 s in tests, 2 s by
    default): a line per probe would bury everything else, no line at all hides why it
    stays down. Pure: the caller passes ``now`` and logs what ``seen`` returns."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._streaks: dict[Hashable, Streak] = {}

    def seen(self, key: Hashable, detail: str, now: float) -> Streak | None:
        """One more occurrence; its streak when this one deserves a line, else None."""
        streak = self._streaks.get(key)
        if streak is None:
            streak = self._streaks[key] = Streak(detail, now, logged_at=now)
            return streak
        streak.count += 1
        if detail != streak.detail or now - streak.logged_at >= self.every_s:
            streak.detail = detail
            streak.logged_at = now
            return streak
        return None

    def peek(self, key: Hashable) -> Streak | None:
        """The streak going on for ``key``, if any; changes nothing."""
        return self._streaks.get(key)

    def ended(self, key: Hashable) -> Streak | None:
        """The condition is over; its streak, if there was one."""
        return self._streaks.pop(key, None)


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
