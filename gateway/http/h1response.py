"""What ``gateway.http.h1client`` hands back: one upstream response, and its errors.

The response is fed by its connection (``_feed``, ``_finish``) and read by the relay
(``read``, ``content.iter_any``) with back-pressure for streams; ``release``/``close``
give the connection back to its pool or abort it. Errors are split the way
``upstream.map_errors`` maps aiohttp's: nothing came back (safe to retry elsewhere) or
the response broke after it started.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

__all__ = ["BrokenResponse", "ConnectFailed", "H1Response", "ResetBeforeResponse"]

_HIGH_WATER = 1 << 20  # pause reading a stream the client consumes slower than this
_LOW_WATER = 1 << 18


class Connection(Protocol):
    """What a response asks of the connection it arrives on."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def finished(self, response: H1Response, *, reuse: bool) -> None: ...


class ConnectFailed(OSError):
    """No connection could be opened; ``kind`` says why (``gateway.http.failures``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class ResetBeforeResponse(ConnectionResetError):
    """The connection failed before any byte of the response arrived."""


class BrokenResponse(ConnectionError):
    """The connection failed, or sent invalid HTTP, after the response started."""


class H1Response:
    """One upstream response; the subset of ``aiohttp.ClientResponse`` the relay uses."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_released",
        "_streaming",
        "_waiter",
        "content_length",
        "content_type",
        "raw_headers",
        "status",
    )  # fmt: skip

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self._released = False
        self._streaming = False  # back-pressure only for streams: read() needs it all
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.content_type = "application/octet-stream"

    # -- fed by the connection ------------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._streaming and self._buffered > _HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if not self._done:
            self._done = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- read by the caller --------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body (raises ``ConnectionError`` / ``TimeoutError`` if it broke)."""
        while not self._done:
            await self._wait()
        return self._take()

    def read_nowait(self) -> bytes | None:
        """The whole body if all of it has arrived (as ``read``), else None: a sized
        rollout answer usually arrives with its head, and then needs no coroutine."""
        return self._take() if self._done else None

    def _take(self) -> bytes:
        if self._error is not None:
            raise self._error
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return body

    @property
    def content(self) -> H1Response:
        """``aiohttp``'s spelling: ``response.content.iter_any()``."""
        return self

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive: everything buffered at that moment, as one piece. A
        burst of SSE events read together is then relayed with one write, not one each
        (nothing is held back to wait for more)."""
        self._streaming = True
        chunks = self._chunks
        while True:
            if chunks:
                if len(chunks) == 1:
                    chunk = chunks.popleft()
                else:
                    chunk = b"".join(chunks)
                    chunks.clear()
                self._buffered -= len(chunk)
                if self._buffered < _LOW_WATER and self._conn is not None:
                    self._conn.resume()
                yield chunk
            elif self._done:
                if self._error is not None:
                    raise self._error
                return
            else:
                await self._wait()

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if the body was
        read to the end, otherwise it is closed."""
        if self._released:
            return
        self._released = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(self, reuse=self._done and self._error is None)

    def close(self) -> None:
        """Abort: close the connection (the replica then cancels the generation)."""
        if self._released:
            return
        self._released = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(self, reuse=False)
