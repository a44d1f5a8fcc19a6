"""Relaying one upstream response to the client, with cleanup that always runs.

``RelayResponse`` streams the upstream body chunk by chunk as it arrives (SSE included,
``data: [DONE]`` and all), and guarantees its ``on_close`` callback runs exactly once --
even when the client is gone before the first byte, where a plain Starlette
``StreamingResponse`` would never start its generator and so never run its ``finally``.
A client disconnect cancels the relay and *closes* the upstream connection (instead of
returning it to the pool), which makes vLLM abort the generation.

``DisconnectGuard`` does the same for the wait on the upstream: while armed (a ``with``
block) it cancels the serving task when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import UpstreamError

if TYPE_CHECKING:
    from gateway.http.h1server import LeanExchange
    from gateway.http.upstream import UpstreamResponse

__all__ = ["BodyResponse", "ClientDisconnected", "DisconnectGuard", "RelayResponse"]

_ARM_AFTER_S = 0.05


class ClientDisconnected(Exception):
    """The client went away while the gateway was waiting on the upstream."""


class DisconnectGuard:
    """``with guard: await work``: if the client disconnects meanwhile, the serving task
    is cancelled and the block raises ``ClientDisconnected`` instead.

    A plain context manager, not a wrapping coroutine: no frame in the await chain of
    every rollout. On a connection served by ``gateway.http.h1server`` the server resolves
    ``lost`` when the connection goes: watching costs one callback. Otherwise a watcher
    task reads ASGI ``receive``; it is armed lazily, after ``_ARM_AFTER_S``: most rollouts
    finish sooner and then cost one timer instead of one task (a disconnect is still
    noticed within that delay, which is what cancelling a generation needs). Reusable:
    one block after another (a retry is a new block)."""

    __slots__ = ("_armed", "_fired", "_lost", "_receive", "_task", "_timer", "_watcher")

    def __init__(
        self,
        task: asyncio.Task[Any],
        *,
        lost: asyncio.Future[None] | None = None,
        receive: Receive | None = None,
    ) -> None:
        assert lost is not None or receive is not None
        self._task = task
        self._lost = lost
        self._receive = receive
        self._armed = self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Future[None] | None = None

    def __enter__(self) -> None:
        self._armed, self._fired = True, False
        if self._lost is not None:
            self._lost.add_done_callback(self._on_gone)
        else:
            self._timer = asyncio.get_running_loop().call_later(_ARM_AFTER_S, self._watch)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._armed = False
        if self._lost is not None:
            self._lost.remove_done_callback(self._on_gone)
        else:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher.remove_done_callback(self._on_gone)
                watcher.cancel()
        if kind is asyncio.CancelledError and self._fired:
            self._task.uncancel()
            raise ClientDisconnected from None

    def _watch(self) -> None:
        assert self._receive is not None
        self._timer = None
        self._watcher = asyncio.ensure_future(_wait_disconnect(self._receive))
        self._watcher.add_done_callback(self._on_gone)

    def _on_gone(self, signal: asyncio.Future[None]) -> None:
        # A callback already scheduled when the block ended does nothing.
        if self._armed and not signal.cancelled() and signal.exception() is None:
            self._fired = True
            self._task.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class BodyResponse(Response):
    """A complete body with headers already in ASGI form: no per-request header rendering
    (``Response.__init__`` re-encodes and re-scans them)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]


class RelayResponse(Response):
    """Stream ``upstream``'s body to the client; ``on_close(completed)`` runs once.

    ``ejected()`` is asked when the relay is cancelled: True means the replica was ejected
    (``gateway.fleet.aborts``), which ends the stream like an upstream failure; otherwise the
    cancellation is the client's disconnect (or shutdown) and propagates."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        guard: DisconnectGuard,
        on_close: Callable[[bool], None],
        ejected: Callable[[], bool] = lambda: False,
    ) -> None:
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = headers
        self._upstream = upstream
        self._guard = guard
        self._on_close = on_close
        self._ejected = ejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._relay(self._pump(send))

    async def stream_to(self, exchange: LeanExchange) -> None:
        """The same relay on a ``gateway.http.h1server`` connection: chunks are written as they
        arrive, without an ASGI message per chunk."""
        await self._relay(self._pump_lean(exchange))

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
        if not intact and (event := self._error_event()):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return intact

    async def _pump_lean(self, exchange: LeanExchange) -> bool:
        """``_pump`` over ``LeanExchange.write_chunk``."""
        intact = True
        try:
            exchange.start_chunked(self.status_code, self.raw_headers)
            async for chunk in self._upstream.content.iter_any():
                if not exchange.write_chunk(chunk):
                    await exchange.drain()
        except asyncio.CancelledError:
            if not self._ejected():
                raise
            intact = False
        except (ConnectionError, TimeoutError):
            intact = False
        exchange.write_chunk(b"" if intact else self._error_event(), last=True)
        return intact

    def _error_event(self) -> bytes:
        """Headers are out: for SSE the only honest signal left is an error event."""
        if self._upstream.content_type != "text/event-stream":
            return b""
        return b"data: " + UpstreamError("upstream replica failed mid-stream").body() + b"\n\n"

    async def _relay(self, pump: Coroutine[Any, Any, bool]) -> None:
        completed = False
        try:
            with self._guard:
                completed = await pump
        except (ClientDisconnected, OSError):
            pass  # the client left; nobody to answer
        finally:
            if completed:
                self._upstream.release()  # connection back to the pool
            else:
                self._upstream.close()  # abort: vLLM cancels the generation
            self._on_close(completed)
