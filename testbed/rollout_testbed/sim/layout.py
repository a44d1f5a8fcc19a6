"""``sim-replica --json-layout spaced``: the sim's answers written as another
OpenAI-compatible server (or a proxy that re-serializes) may write them.

vLLM writes compact JSON; the gateway must read any valid layout the same
(``gateway.runs.usage``, ``gateway.runs.scope``). This wrapper rewrites every JSON body
and every SSE ``data:`` document of the sim with Python's default separators
(``", "`` and ``": "``) and ``\\uXXXX`` escapes for non-ASCII text: what
``json.dumps(obj)`` writes, and what ``"model": "RUN~trl-policy-v1"`` looked like when
the gateway let a run's prefix through.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LAYOUTS", "Spaced"]

LAYOUTS = ("compact", "spaced")


def _spaced(raw: bytes) -> bytes:
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(doc).encode()


def _events(body: bytes) -> bytes:
    lines = body.split(b"\n")
    return b"\n".join(
        b"data: " + _spaced(line[6:]) if line.startswith(b"data: {") else line for line in lines
    )


class Spaced:
    """Wraps an ASGI app: JSON bodies and SSE events re-written spaced (sizes fixed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind: list[str] = [""]
        start: dict[str, Any] = {}
        held: list[bytes] = []

        async def spaced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                named = dict(message.get("headers", []))
                kind[0] = named.get(b"content-type", b"").decode().split(";")[0]
                if kind[0] == "application/json":
                    start.update(message)  # sent with the whole body: its length changes
                    return
                await send(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            if kind[0] == "text/event-stream":
                await send({**message, "body": _events(message.get("body", b""))})
            elif kind[0] == "application/json":
                held.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = _spaced(b"".join(held))
                headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            else:
                await send(message)

        await self.app(scope, receive, spaced_send)
