"""Upstream failures that happen after the response started: honest errors, no hangs."""

from __future__ import annotations

import asyncio

import httpx
from rollout_testbed.serve import serve_asgi
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.config import load_settings


async def _dies_mid_stream(scope: Scope, receive: Receive, send: Send) -> None:
    """A replica that starts an SSE stream, sends one event, then crashes."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/resume":  # the gateway resumes a replica it admits
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"status": "resumed"}'})
        return
    if scope["path"] == "/v1/models":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"data": []}'})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True})
    await asyncio.sleep(0.05)
    raise RuntimeError("replica crashed mid-stream")


async def test_mid_stream_failure_ends_with_sse_error_event() -> None:
    async with serve_asgi(_dies_mid_stream) as upstream:
        settings = load_settings({"replicas": [upstream]}, environ={})
        async with serve_asgi(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as c:
            body = {"model": "tiny-base", "prompt": "x", "stream": True}
            async with asyncio.timeout(10):  # never a hang
                r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            events = [line for line in r.text.split("\n") if line.startswith("data: ")]
            assert events[0] == 'data: {"n": 1}'
            assert '"error"' in events[-1] and "mid-stream" in events[-1]
            assert (await c.get("/health")).status_code == 200  # the gateway keeps serving
