"""A run's answers show its own adapter names, and its requests name only its own (pure).

On the replicas a run's adapter is ``RUN~trl-policy-v3``; the run must read
``trl-policy-v3`` in the ``model`` field of completions and of every stream chunk, and in
errors. Only ``model`` fields are rewritten in a success body: generated text may hold
anything. vLLM writes compact JSON, so the fast path replaces ``"model":"RUN~`` as
written; when the prefix is still there after it (another layout: ``"model": "RUN~``,
newlines vLLM does not write, or the name in generated text) or a ``\\u``
escape could spell it, the answer is read exactly instead (the body, or each SSE event,
parsed: ``gateway.runs.usage.load``) and only events whose ``model`` changed are written
again. An answer that is not JSON loses every occurrence of the prefix as text, and is
counted (``gateway_run_answers_unread_total{part="model"}``): the prefix never reaches a
client. Error bodies hold no generated text: every occurrence of the prefix goes
(``Run.unscope``).

The other way, an adapter a request names is scoped to its run here too
(``scoped_model``), once for rollouts and FORWARDED paths alike: a run can only ever name
its own adapters.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.errors import NotFound
from gateway.runs.table import SEP, Run, owner_of
from gateway.runs.usage import (
    UNREADABLE,
    RunUsage,
    escaped,
    event_data,
    is_document,
    load,
    sse_parts,
    usage_tokens,
)

__all__ = [
    "RunScope", "StreamUnscope", "answer_body", "own_listing", "scoped_model", "unknown_model",
    "unscope_body",
]  # fmt: skip

log = logging.getLogger("gateway.runs")


class _Candidates(Protocol):
    def candidates(self, model: str | None) -> frozenset[int] | None: ...


class RunScope(Protocol):
    """What ``scoped_model`` reads of a run (``gateway.runs.tenancy.Tenant`` is one):
    named here so that this pure module does not import the run-time one."""

    @property
    def routes(self) -> _Candidates: ...

    def scope_rollout(self, payload: dict[str, Any], body: bytes) -> bytes: ...


_FIELD = b'"model":"'
_SEP = SEP.encode()
_EVENT_ENDS = (b"\n\n", b"\n\r\n")  # a blank line: LF, or CRLF, line ends
_MAX_HELD = 1 << 16  # a "stream" without event ends: pass it on rather than hold it
_TERMINATOR = re.compile(rb"\r\n|\r|\n")


def unscope_body(
    run: Run, status: int, content: bytes, unread: Counter[str] | None = None
) -> bytes:
    """``content`` (a body, or whole SSE events) without ``run``'s prefix in its names;
    ``unread`` counts a success answer that could not be read (its prefix cut as text)."""
    if status >= 400:
        return run.unscope(content)
    if not run.prefix:
        return content
    prefix = run.prefix.encode()
    out = content.replace(_FIELD + prefix, _FIELD)
    # The prefix ends in SEP, which no run name holds: one byte, found by memchr (a search
    # for the whole prefix costs about ten times more); and most answers hold neither.
    if (_SEP not in out or prefix not in out) and not escaped(out):
        return out  # vLLM's compact answers: a replace and two memchr scans, nothing decoded
    exact = _unscope_exact(run.prefix, out)
    if exact is None:
        if unread is not None:
            unread["model"] += 1
        return run.unscope(out)
    return exact


def answer_body(run: Run, usage: RunUsage, status: int, content: bytes) -> bytes:
    """A complete answer as ``run`` reads it, its tokens counted in ``usage``."""
    unread = usage.unread
    before = dict(unread) if unread else None  # almost always empty: nothing to copy
    content = unscope_body(run, status, content, unread)
    if 200 <= status < 300:
        usage.tokens(usage_tokens(content))
    if unread and unread != before:  # rare: an answer vLLM would not write
        _note(run, unread, before or {})
    return content


def _note(run: Run, unread: Mapping[str, int], before: Mapping[str, int]) -> None:
    """Say so, once per run and part, when an answer could not be read: when that part
    is first counted (not when another part is)."""
    for part, count in unread.items():
        if count == 1 and not before.get(part):
            log.warning("run %s: a replica's answer could not be read as JSON for its %s "
                        "(counted in gateway_run_answers_unread_total{part=%r}); "
                        "is something between the gateway and vLLM rewriting answers?",
                        run.name, part, part)  # fmt: skip


def _unscope_exact(prefix: str, content: bytes) -> bytes | None:
    """``content`` with every ``model`` field that starts with ``prefix`` without it,
    read as JSON (a body) or as SSE events (each ``data`` a JSON document); unchanged
    events keep their bytes. None: some document is not JSON."""
    if is_document(content):
        loaded = load(content)
        if loaded is None:
            return None
        doc, dumps = loaded
        return dumps(doc) if _strip_models(doc, prefix) else content
    parts = sse_parts(content)
    changed = False
    for i in range(0, len(parts), 2):
        event = parts[i]
        data, lines = event_data(event)
        if data is None or data.strip() in (b"", b"[DONE]"):
            if prefix.encode() in event:  # an event or id field naming it: as text
                parts[i], changed = event.replace(prefix.encode(), b""), True
            continue
        loaded = load(data)
        if loaded is None:
            return None
        doc, dumps = loaded
        if not _strip_models(doc, prefix):
            continue
        found = _TERMINATOR.search(event)
        newline = found.group() if found is not None else b"\n"
        kept = [line for line in lines if not line.startswith(b"data:")]
        at = next(n for n, line in enumerate(lines) if line.startswith(b"data:"))
        kept.insert(at, b"data: " + dumps(doc))  # one data line: JSON holds no newline
        parts[i], changed = newline.join(kept), True
    return b"".join(parts) if changed else content


def _strip_models(doc: object, prefix: str) -> bool:
    """Cut ``prefix`` off every ``model`` string of ``doc`` that starts with it, at any
    depth (as the fast path's replace does); True if one was."""
    changed = False
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            model = node.get("model")
            if isinstance(model, str) and model.startswith(prefix):
                node["model"] = model[len(prefix) :]
                changed = True
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return changed


def scoped_model(
    tenant: RunScope, payload: dict[str, Any], body: bytes
) -> tuple[str | None, frozenset[int] | None, bytes]:
    """What a request naming ``payload["model"]`` (a string or None) asks of its run's
    replicas: the name there, the replicas that may serve it (None: not an adapter, e.g. the
    base model; empty: none may), and the body to send.

    An adapter name is always read as the run's own: it is sent under the run's prefix,
    so another run's adapter (or a name no run has) is simply unknown to it, and a
    prefixed name written by the client becomes ``RUN~other~...``, unknown too. The base
    model is never prefixed: it is shared by every run."""
    model = payload.get("model")
    routes = tenant.routes
    allowed = routes.candidates(model)
    # An adapter, not the base model; a name some run owns is never the base model, even
    # before the base models are known (``candidates`` says None for every name then).
    # (``SEP in model`` first: the base model's rollouts, the common case, skip the call.)
    if isinstance(model, str) and (
        allowed is not None or (SEP in model and owner_of(model) is not None)
    ):
        body = tenant.scope_rollout(payload, body)
        if payload["model"] != model:  # the run's name on the replicas
            model = payload["model"]
            allowed = routes.candidates(model)
    return model, allowed, body


def unknown_model(asked: object) -> NotFound:
    """vLLM's own answer for a model it does not serve, by the name the client sent."""
    return NotFound(f"The model `{asked}` does not exist.", param="model")


def own_listing(run: Run, content: bytes) -> bytes:
    """A success body listing models (``{"data": [{"id": ...}, ...]}``, as vLLM's
    ``/v1/models``) as ``run`` may read it: the base models (no ``parent``) and its own
    adapters by its own names; anything else is returned unchanged. For answers of
    FORWARDED paths: the gateway's own ``/v1/models`` is built from the run's adapters."""
    if not run.prefix or (b'"data"' not in content and not escaped(content)):
        return content
    loaded = load(content)
    if loaded is None:
        return content
    listing, dumps = loaded
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return content
    kept = []
    for entry in data:
        name = entry.get("id") if isinstance(entry, dict) else entry
        if not isinstance(name, str):
            kept.append(entry)
        elif (own := run.client_name(name)) is not None:
            kept.append({**entry, "id": own} if isinstance(entry, dict) else own)
        elif not (owner_of(name) or (isinstance(entry, dict) and entry.get("parent"))):
            kept.append(entry)  # a base model: every run's
    listing["data"] = kept
    return dumps(listing)


class StreamUnscope:
    """``unscope_body`` over an SSE stream read in arbitrary pieces: only whole events are
    rewritten (a name split between two reads would be missed), so a partial event is held
    until its end arrives (a blank line, with LF or CRLF line ends), or the stream ends.

    Its tokens are the largest usage it carried: the final chunk's with
    ``include_usage``, and with vLLM's ``continuous_usage_stats`` every chunk's running
    total, of which only the growth is added (a stream cut short keeps what it used)."""

    __slots__ = ("_find", "_held", "_seen", "_usage")

    def __init__(self, run: Run, status: int, usage: RunUsage | None = None) -> None:
        self._find = (run, status)
        self._held = b""
        self._usage = usage if 200 <= status < 300 else None
        self._seen = (0, 0)

    def __call__(self, chunk: bytes, last: bool) -> bytes:
        data = self._held + chunk if self._held else chunk
        if last or len(data) > _MAX_HELD:
            self._held = b""
            return self._out(data)
        end = -1
        for mark in _EVENT_ENDS:  # the first that a stream uses is the one it always uses
            if (found := data.rfind(mark)) >= 0:
                end = found + len(mark)
                break
        if end < 0:
            self._held = data
            return b""
        self._held = data[end:]
        return self._out(data[:end])

    def _out(self, events: bytes) -> bytes:
        run, status = self._find
        usage = self._usage
        if usage is None:
            return unscope_body(run, status, events)
        unread = usage.unread
        before = dict(unread) if unread else None
        events = unscope_body(run, status, events, unread)
        found = usage_tokens(events)
        if found is UNREADABLE or found is None:
            usage.tokens(found)
        else:
            seen = self._seen
            self._seen = (max(seen[0], found[0]), max(seen[1], found[1]))
            usage.tokens((self._seen[0] - seen[0], self._seen[1] - seen[1]))
        if unread and unread != before:
            _note(run, unread, before or {})
        return events
