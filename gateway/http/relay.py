"""Relaying one upstream response to the client, with cleanup that always runs.

``RelayResponse`` streams the upstream body chunk by chunk as it arrives (SSE included,
``data: [DONE]`` and all), and guarantees its ``on_close`` callback runs exactly once --
even when the client is gone before the first byte, where a plain Starlette
``StreamingResponse`` would never start its generator and so never run its ``finally``.
A client disconnect cancels the relay and *closes* the upstream connection (instead of
returning it to the pool), which makes vLLM abort the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamError
from gateway.http.server.disconnect import ClientDisconnected, DisconnectGuard
from gateway.http.server.exchange import AsgiExchange, Exchange
from gateway.logs import REQUEST_ID

if TYPE_CHECKING:
    from gateway.http.upstream import UpstreamResponse

__all__ = ["BodyResponse", "RelayResponse", "broken_mid_stream"]


def broken_mid_stream() -> UpstreamError:
    """What a stream's client reads when its replica failed (or was ejected) mid-body."""
    return UpstreamError("upstream replica failed mid-stream")


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

    ``ejected()`` is asked when the relay is cancelled: an error means the cancellation
    owes the client an answer (the replica was ejected, or the run paused with ``abort``:
    ``gateway.fleet.aborts``, ``gateway.runs.aborts``), which ends the stream like an
    upstream failure, naming it; None means it is the client's disconnect (or shutdown)
    and propagates."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        guard: DisconnectGuard,
        on_close: Callable[[bool], None],
        ejected: Callable[[], GatewayError | None] = lambda: None,
        transform: Callable[[bytes, bool], bytes] | None = None,
    ) -> None:
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = headers
        self._upstream = upstream
        self._guard = guard
        self._on_close = on_close
        self._ejected = ejected
        self._transform = transform
        """Rewrites each chunk (``last``: the stream's end), e.g. a run's adapter names."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's entry (FORWARDED paths): the same relay over ASGI."""
        await self.stream_to(AsgiExchange(scope, receive, send))

    async def stream_to(self, exchange: Exchange) -> None:
        """Relay the body, writing chunks as they arrive; ``on_close`` runs once."""
        completed = False
        try:
            with self._guard:
                completed = await self._pump(exchange)
        except (ClientDisconnected, OSError):
            pass  # the client left; nobody to answer
        finally:
            if completed:
                self._upstream.release()  # connection back to the pool
            else:
                self._upstream.close()  # abort: vLLM cancels the generation
            self._on_close(completed)

    async def _pump(self, exchange: Exchange) -> bool:
        """Relay everything; False if the upstream broke (or was ejected) mid-body."""
        failure: GatewayError | None = None
        try:
            exchange.start_chunked(self.status_code, self.raw_headers)
            transform = self._transform
            async for chunk in self._upstream.content.iter_any():
                if transform is not None and not (chunk := transform(chunk, False)):
                    continue
                if not exchange.write_chunk(chunk):
                    await exchange.drain()
        except asyncio.CancelledError:
            if (failure := self._ejected()) is None:
                raise
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            failure = broken_mid_stream()
        tail = b"" if self._transform is None else self._transform(b"", True)
        if not exchange.write_chunk(tail + self._error_event(failure), last=True):
            await exchange.drain()
        return failure is None

    def _error_event(self, failure: GatewayError | None) -> bytes:
        """Headers are out: for SSE the only honest signal left is an error event."""
        if failure is None or self._upstream.content_type != "text/event-stream":
            return b""
        return b"data: " + failure.body(REQUEST_ID.get()) + b"\n\n"  # the stream's task
