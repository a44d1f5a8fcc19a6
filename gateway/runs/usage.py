"""What each run used of the shared fleet, for a cost split (pure); and how an answer's
JSON is read whatever its layout.

The tokens are vLLM's own count, read from the ``usage`` object of each answer (the
whole body, or the stream's chunk that carries it when the client asked for
``stream_options.include_usage``): what the replicas computed for the run, the same
numbers their ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` add up.
Only the run's rollouts are counted (multi-run mode; single-run mode has one run, whose
use is the fleet's own metrics).

Two readings, one answer. vLLM writes compact JSON (``"usage":{...}``), and the fast
scan finds that object without decoding the generated text. Any other valid JSON
(spaces or newlines between tokens, another key order, ``"\\u0075sage"``, ``"usage":
null`` in every chunk, an SSE ``data:`` field over several lines) is read exactly: the
body, or each event of a stream, is parsed whole (:func:`load`). The fast scan hands over
whenever it cannot be sure: no compact ``"usage":{`` while ``"usage"`` (or any ``\\u``
escape) is there, or an object it cannot read. What even the exact reading cannot read
(not JSON, a usage without integer counts) is counted, never guessed
(``RunUsage.unread``: ``gateway_run_answers_unread_total``). ``tests/runs/test_usage.py``
checks that every layout of an answer counts what its compact form counts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

__all__ = [
    "UNREADABLE", "RunUsage", "escaped", "event_data", "is_document", "load", "sse_parts",
    "usage_tokens",
]  # fmt: skip

UNREADABLE: Final = (-1, -1)
"""``usage_tokens``: the answer has a usage the gateway cannot read (counted as such)."""

_USAGE = b'"usage":{'
_KEY = b'"usage"'
_NULL = b'"usage":null'
_ESCAPE = b"\\u"
_WINDOW = 512  # vLLM's usage object, details included, is far shorter

Loaded = tuple[Any, Callable[[Any], bytes]]
"""A parsed JSON document and how to write it back (the parser's own writer)."""


def _dumps_std(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()


def load(raw: bytes) -> Loaded | None:
    """``raw`` parsed (None: not JSON). orjson first; the standard library for what orjson
    refuses and Python servers write (``-Infinity`` logprobs, ``1e400``, lone surrogates),
    written back by the same library so that nothing changes but names. (orjson reads an
    integer past 64 bits as a float: no OpenAI answer holds one.)"""
    try:
        return orjson.loads(raw), orjson.dumps
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw), _dumps_std
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def is_document(content: bytes) -> bool:
    """A JSON body (an object or an array), not an SSE stream."""
    return content.lstrip()[:1] in (b"{", b"[")


_BLANK = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")
_LINES = re.compile(rb"\r\n|\r|\n")


def sse_parts(content: bytes) -> list[bytes]:
    """An SSE text as ``[event, end, event, end, ..., tail]``: joined, the same bytes."""
    return _BLANK.split(content)


def event_data(event: bytes) -> tuple[bytes | None, list[bytes]]:
    """(the event's ``data`` field, None if it has none; its lines): several ``data:``
    lines are one value joined by newlines, one space after the colon is not part of it
    (the SSE rules)."""
    lines = _LINES.split(event)
    data = [line[5:] for line in lines if line.startswith(b"data:")]
    if not data:
        return None, lines
    return b"\n".join(d[1:] if d.startswith(b" ") else d for d in data), lines


def _documents(content: bytes) -> Iterator[Loaded | None]:
    """Every JSON document of a body (one) or a stream (one per event; ``[DONE]`` and
    events without data skipped); None for one that is not JSON."""
    if is_document(content):
        yield load(content)
        return
    for event in sse_parts(content)[::2]:
        data, _ = event_data(event)
        if data is not None and data.strip() not in (b"", b"[DONE]"):
            yield load(data)


def _counts(usage: object) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return UNREADABLE
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int or prompt < 0 or completion < 0:
        return UNREADABLE
    return prompt, completion


def _compact(content: bytes, at: int) -> tuple[int, int] | None:
    """The compact ``"usage":{...}`` at ``at`` (None: not readable so; the exact reading
    decides). Only the usage object is parsed: it ends at the ``}`` that closes it, past
    its nested ``prompt_tokens_details``, if any."""
    start = at + len(_USAGE) - 1
    limit = min(len(content), start + _WINDOW)
    end = content.find(b"}", start, limit)
    # Each nested object (prompt_tokens_details) moves the end one "}" on: found by find
    # (memchr), not byte by byte in Python (docs/decisions.md, 'Runs: the usage scan').
    while end >= 0 and content.count(b"{", start, end) > content.count(b"}", start, end + 1):
        end = content.find(b"}", end + 1, limit)
    if end < 0:
        return None
    try:
        found = _counts(orjson.loads(content[start : end + 1]))
    except orjson.JSONDecodeError:
        return None
    return None if found is UNREADABLE else found


def usage_tokens(content: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last usage in ``content`` (a JSON body, or whole
    SSE events), None if it has none (or only ``null`` ones), ``UNREADABLE`` if one
    cannot be read."""
    at = content.rfind(_USAGE)
    if at >= 0:
        found = _compact(content, at)
        if found is not None:
            return found
    elif not escaped(content) and content.count(_KEY) == content.count(_NULL):
        return None  # no usage, or only compact nulls: vLLM's answers without usage
    return _exact(content)


def escaped(content: bytes) -> bool:
    """Whether ``content`` holds a ``\\uXXXX`` escape, which may spell any key or name.
    The backslash is looked for first: memchr finds one byte about ten times faster than
    a search finds two (2 KB: 0.3 us against 2.7 us), and most answers hold none."""
    return b"\\" in content and _ESCAPE in content


def _exact(content: bytes) -> tuple[int, int] | None:
    last: tuple[int, int] | None = None
    for loaded in _documents(content):
        if loaded is None:
            return UNREADABLE
        doc = loaded[0]
        if isinstance(doc, dict) and doc.get("usage") is not None:
            last = _counts(doc["usage"])
            if last is UNREADABLE:
                return UNREADABLE
    return last


@dataclass
class RunUsage:
    """One run's counts since the gateway started (Prometheus counters, read at scrape)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    rollouts: Counter[str] = field(default_factory=Counter)
    """Answered rollouts by status class: ``2xx``, ``4xx``, ``5xx``."""
    held_s: float = 0.0
    """Time its rollouts waited at the gateway (its scoped ``/pause``)."""
    unread: Counter[str] = field(default_factory=Counter)
    """Success answers the gateway could not read, by what it looked for: ``usage`` (its
    tokens are not counted) or ``model`` (its run's prefix was cut out as text)."""

    def answered(self, status: int) -> None:
        self.rollouts[f"{status // 100}xx"] += 1

    def tokens(self, found: tuple[int, int] | None) -> None:
        if found is UNREADABLE:
            self.unread["usage"] += 1
        elif found is not None:
            self.prompt_tokens += found[0]
            self.completion_tokens += found[1]

    def status(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "rollouts": dict(sorted(self.rollouts.items())),
            "held_s": round(self.held_s, 3),
        }
