"""A run's answers show its own adapter names, and its requests name only its own (pure).

On the replicas a run's adapter is ``RUN~trl-policy-v3``; the run must read
``trl-policy-v3`` in the ``model`` field of completions and of every stream chunk, and in
errors. Only the ``"model":"`` field is rewritten in a success body: generated text may
hold anything, and vLLM writes compact JSON, so the field is found as written. Error
bodies hold no generated text: every occurrence of the prefix goes.

The other way, an adapter a request names is scoped to its run here too
(``scoped_model``), once for rollouts and FORWARDED paths alike: a run can only ever name
its own adapters.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from gateway.errors import NotFound
from gateway.runs.table import SEP, Run, owner_of
from gateway.runs.usage import RunUsage, usage_tokens

__all__ = [
    "RunScope", "StreamUnscope", "own_listing", "scoped_model", "unknown_model", "unscope_body",
]  # fmt: skip


class _Candidates(Protocol):
    def candidates(self, model: str | None) -> frozenset[int] | None: ...


class RunScope(Protocol):
    """What ``scoped_model`` reads of a run (``gateway.runs.tenancy.Tenant`` is one):
    named here so that this pure module does not import the run-time one."""

    @property
    def routes(self) -> _Candidates: ...

    def scope_rollout(self, payload: dict[str, Any], body: bytes) -> bytes: ...


_FIELD = b'"model":"'
_EVENT_END = b"\n\n"
_MAX_HELD = 1 << 16  # a "stream" without event ends: pass it on rather than hold it


def unscope_body(run: Run, status: int, content: bytes) -> bytes:
    if status >= 400:
        return run.unscope(content)
    return content.replace(_FIELD + run.prefix.encode(), _FIELD)


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
    if not run.prefix or b'"data"' not in content:
        return content
    try:
        listing = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content
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
    return orjson.dumps(listing)


class StreamUnscope:
    """``unscope_body`` over an SSE stream read in arbitrary pieces: only whole events are
    rewritten (a name split between two reads would be missed), so a partial event is held
    until its end arrives, or the stream ends."""

    __slots__ = ("_find", "_held", "_usage")

    def __init__(self, run: Run, status: int, usage: RunUsage | None = None) -> None:
        self._find = (run, status)
        self._held = b""
        self._usage = usage if 200 <= status < 300 else None

    def __call__(self, chunk: bytes, last: bool) -> bytes:
        data = self._held + chunk if self._held else chunk
        if last or len(data) > _MAX_HELD:
            self._held = b""
            return self._out(data)
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._held = data
            return b""
        end += len(_EVENT_END)
        self._held = data[end:]
        return self._out(data[:end])

    def _out(self, events: bytes) -> bytes:
        if self._usage is not None and b'"usage":{' in events:  # the final chunk's, if asked
            self._usage.tokens(usage_tokens(events))
        return unscope_body(*self._find, events)
