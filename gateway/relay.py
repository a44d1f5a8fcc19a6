"""Relaying one upstream response to the client, with cleanup that always runs.

``RelayResponse`` streams the upstream body chunk by chunk as it arrives (SSE included,
``data: [DONE]`` and all), and guarantees its ``on_close`` callback runs exactly once --
even when the client is gone before the first byte, where a plain Starlette
``StreamingResponse`` would never start its generator and so never run its ``finally``.
A client disconnect cancels the relay, which closes the upstream connection, which makes
vLLM abort the generation.

``cancel_on_disconnect`` does the same for buffered (non-streaming) exchanges: it watches
the ASGI ``receive`` channel and cancels the waiting handler when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import UpstreamError

__all__ = ["ClientDisconnected", "RelayResponse", "cancel_on_disconnect"]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away while the gateway was waiting on the upstream."""


class RelayResponse(Response):
    """Stream ``upstream``'s body to the client; ``on_close`` runs once, whatever happens."""

    def __init__(
        self,
        upstream: httpx.Response,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = headers
        self._upstream = upstream
        self._on_close = on_close

    async def _pump(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        chunks: AsyncIterator[bytes] = self._upstream.aiter_raw()
        try:
            async for chunk in chunks:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpx.HTTPError, OSError):
            # Headers are out: the only honest signal left is an SSE error event.
            if self._upstream.headers.get("content-type", "").startswith("text/event-stream"):
                err = UpstreamError("upstream replica failed mid-stream").body()
                await send(
                    {"type": "http.response.body", "body": b"data: " + err + b"\n\n",
                     "more_body": True}
                )  # fmt: skip
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            task = asyncio.current_task()
            assert task is not None
            watcher = asyncio.ensure_future(_wait_disconnect(receive))
            watcher.add_done_callback(lambda w: _cancel_if_disconnected(w, task))
            try:
                await self._pump(send)
                completed = True
            except asyncio.CancelledError:
                if not watcher.done() or watcher.cancelled():
                    raise
                task.uncancel()
            except OSError:
                pass  # client socket closed under us
            finally:
                watcher.cancel()
        finally:
            await self._upstream.aclose()
            await self._on_close(completed)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _cancel_if_disconnected(watcher: asyncio.Future[None], task: asyncio.Task[object]) -> None:
    if not watcher.cancelled() and watcher.exception() is None:
        task.cancel()


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected``. Costs one watcher task per request."""
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(lambda w: _cancel_if_disconnected(w, task))
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            task.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        watcher.cancel()
