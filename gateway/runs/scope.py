"""A run's rollout answers with its own adapter names (pure).

On the replicas a run's adapter is ``RUN~trl-policy-v3``; the run must read
``trl-policy-v3`` in the ``model`` field of completions and of every stream chunk, and in
errors. Only the ``"model":"`` field is rewritten in a success body: generated text may
hold anything, and vLLM writes compact JSON, so the field is found as written. Error
bodies hold no generated text: every occurrence of the prefix goes.
"""

from __future__ import annotations

from gateway.runs.table import Run
from gateway.runs.usage import RunUsage, usage_tokens

__all__ = ["StreamUnscope", "unscope_body"]

_FIELD = b'"model":"'
_EVENT_END = b"\n\n"
_MAX_HELD = 1 << 16  # a "stream" without event ends: pass it on rather than hold it


def unscope_body(run: Run, status: int, content: bytes) -> bytes:
    if status >= 400:
        return run.unscope(content)
    return content.replace(_FIELD + run.prefix.encode(), _FIELD)


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
