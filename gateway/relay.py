"""Relaying one upstream response to the client, with cleanup that always runs.

``RelayResponse`` streams the upstream body chunk by chunk as it arrives (SSE included,
``data: [DONE]`` and all), and guarantees its ``on_close`` callback runs exactly once --
even when the client is gone before the first byte, where a plain Starlette
``StreamingResponse`` would never start its generator and so never run its ``finally``.
A client disconnect cancels the relay and *closes* the upstream connection (instead of
returning it to the pool), which makes vLLM abort the generation.

``cancel_on_disconnect`` does the same for buffered (non-streaming) exchanges: it watches
the ASGI ``receive`` channel and cancels the waiting handler when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import UpstreamError

if TYPE_CHECKING:
    from gateway.upstream import UpstreamResponse

__all__ = ["BodyResponse", "ClientDisconnected", "RelayResponse", "cancel_on_disconnect"]

T = TypeVar("T")
_ARM_AFTER_S = 0.05
LOST = "gateway.lost"
"""Scope key: a future the server resolves when the client's connection is lost."""
RESPOND = "gateway.respond"
"""Scope key: ``respond(status, headers, body) -> bool`` writes a whole response at once,
bypassing the ASGI messages; the headers must be lower-case, valid and not hop-by-hop (the
gateway's own, or upstream ones its parser accepted). False: send it the ASGI way."""
BODY = "gateway.body"
"""Scope key: ``take_body() -> bytes | None``, the whole request body the server already
read (None: the client is gone); ``receive`` then only waits for the disconnect."""
TASK = "gateway.task"
"""Scope key: the task serving the request (``asyncio.current_task`` costs a ``getpid``)."""


class ClientDisconnected(Exception):
    """The client went away while the gateway was waiting on the upstream."""


class BodyResponse(Response):
    """A complete body with headers already in ASGI form: no per-request header rendering
    (``Response.__init__`` re-encodes and re-scans them)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = scope.get(RESPOND)
        if respond is None or not respond(self.status_code, self.raw_headers, self.body):
            await super().__call__(scope, receive, send)


class RelayResponse(Response):
    """Stream ``upstream``'s body to the client; ``on_close(completed)`` runs once.

    ``ejected()`` is asked when the relay is cancelled: True means the replica was ejected
    (``gateway.aborts``), which ends the stream like an upstream failure; otherwise the
    cancellation is the client's disconnect (or shutdown) and propagates."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[bool], None],
        ejected: Callable[[], bool] = lambda: False,
    ) -> None:
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = headers
        self._upstream = upstream
        self._on_close = on_close
        self._ejected = ejected

    async def _pump(self, send: Send) -> bool:
        """Relay everything; False if the upstream broke (or was ejected) mid-body."""
        intact = True
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for chunk in self._upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if not self._ejected():
                raise
            intact = False
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            intact = False
        if not intact and self._upstream.content_type == "text/event-stream":
            # Headers are out: the only honest signal left is an SSE error event.
            err = UpstreamError("upstream replica failed mid-stream").body()
            event = b"data: " + err + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return intact

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            completed = await cancel_on_disconnect(scope, receive, self._pump(send))
        except (ClientDisconnected, OSError):
            pass  # the client left; nobody to answer
        finally:
            if completed:
                self._upstream.release()  # connection back to the pool
            else:
                self._upstream.close()  # abort: vLLM cancels the generation
            self._on_close(completed)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def cancel_on_disconnect(
    scope: Scope, receive: Receive, work: Awaitable[T], task: asyncio.Task[Any] | None = None
) -> Coroutine[Any, Any, T]:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected``.

    On a connection served by ``gateway.h1server`` the scope carries ``LOST``, a future
    resolved when the connection is lost: watching costs one callback. Otherwise a
    watcher task reads ``receive``; it is armed lazily, after ``_ARM_AFTER_S``: most
    rollouts finish sooner and then cost one timer instead of one task (a disconnect is
    still noticed within that delay, which is what cancelling a generation needs).
    ``task``: the current task, if the caller has it at hand. (A plain function returning
    the watching coroutine: one coroutine frame less per request.)"""
    task = task or scope.get(TASK) or asyncio.current_task()
    assert task is not None
    lost: asyncio.Future[None] | None = scope.get(LOST)
    if lost is not None:
        return _cancel_on_lost(lost, task, work)
    return _cancel_on_receive(receive, task, work)


async def _cancel_on_receive(receive: Receive, task: asyncio.Task[Any], work: Awaitable[T]) -> T:
    watcher: asyncio.Future[None] | None = None

    def on_disconnect(w: asyncio.Future[None]) -> None:
        if not w.cancelled() and w.exception() is None:
            task.cancel()

    def arm() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_disconnect)

    timer = asyncio.get_running_loop().call_later(_ARM_AFTER_S, arm)
    try:
        return await work
    except asyncio.CancelledError:
        if watcher is not None and watcher.done() and not watcher.cancelled():
            task.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()


async def _cancel_on_lost(
    lost: asyncio.Future[None], task: asyncio.Task[Any], work: Awaitable[T]
) -> T:
    fired = settled = False

    def on_lost(_: asyncio.Future[None]) -> None:
        nonlocal fired
        if not settled:  # a callback already scheduled when ``work`` ended does nothing
            fired = True
            task.cancel()

    lost.add_done_callback(on_lost)
    try:
        return await work
    except asyncio.CancelledError:
        if fired:
            task.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        settled = True
        lost.remove_done_callback(on_lost)
