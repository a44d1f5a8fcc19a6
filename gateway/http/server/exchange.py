"""How a rollout handler reads one request and writes its response, whichever server
protocol parsed it.

Why: the gateway serves a rollout on one of two protocols. ``gateway.http.server.h1server`` reads
most of them; a connection it handed to uvicorn (its first request was a probe, an admin
call or an odd framing) is served by uvicorn's own protocol, as ASGI. Both are adapted
to one ``Exchange``, so from "request parsed" to "response written" a rollout takes the
same code (``gateway.api.FastPath.serve``, ``gateway.http.relay.RelayResponse``) either
way; only the last step, putting bytes on the socket, differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.types import Message, Receive, Scope, Send

from gateway.http.server.disconnect import DisconnectGuard
from gateway.http.server.inbound import Inbound
from gateway.http.server.uvicorn_private import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, ServerState

__all__ = ["AsgiExchange", "Connection", "Exchange", "Handler", "LeanExchange"]

log = logging.getLogger("gateway.server")


class Connection(Protocol):
    """What a ``LeanExchange`` reads and writes of the connection that parsed its request
    (``gateway.http.server.h1server.LeanProtocol``): the exchange sits below the server, which
    creates it, so it names what it needs rather than importing the server."""

    raw_path: bytes
    headers: list[tuple[bytes, bytes]]
    client: tuple[str, int] | None
    lost_signal: asyncio.Future[None]
    server_state: ServerState
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    write_paused: bool

    def finished(self, exchange: LeanExchange, *, reuse: bool) -> None: ...
    async def drain(self) -> None: ...


class Exchange(Protocol):
    """One rollout request and the ways to answer it.

    Answering: ``respond`` writes a whole response and returns True, or returns False and
    the caller sends it through ``send`` (ASGI). A stream is ``start_chunked``, then
    ``write_chunk`` per chunk, awaiting ``drain`` whenever ``write_chunk`` returns False.
    """

    def inbound(self) -> Inbound | None:
        """The request (None: the client left before it was served)."""

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response at once, if this exchange can; the headers are trusted."""

    def start_chunked(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of a streamed response."""

    def write_chunk(self, data: bytes, *, last: bool = False) -> bool:
        """One chunk of it; False: ``await drain()`` before the next."""

    async def drain(self) -> None:
        """Wait until the chunks written so far are on their way."""

    @property
    def receive(self) -> Receive:
        """ASGI ``receive`` (after the body: only ``http.disconnect``)."""

    @property
    def send(self) -> Send:
        """ASGI ``send``, for a response ``respond`` did not take."""


Handler = Callable[["LeanExchange"], Awaitable[None]]
"""Serves one rollout; must answer (``respond`` or ``send``); raising, or returning without
an answer, gets a 500 and closes the connection, as uvicorn does for an ASGI app."""


class AsgiExchange:
    """A rollout on uvicorn's protocol: the ASGI triple behind the ``Exchange`` interface.

    ``respond`` declines, so a whole response goes out as ASGI messages; stream chunks are
    queued by ``write_chunk`` and sent by ``drain``, which the caller awaits after every
    chunk (``write_chunk`` returns False). uvicorn frames the response and checks the
    headers."""

    __slots__ = ("_queue", "receive", "scope", "send")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self._queue: deque[Message] = deque()

    def inbound(self) -> Inbound:
        return Inbound.from_scope(self.scope, self.receive)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        return False

    def start_chunked(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._queue.append({"type": "http.response.start", "status": status, "headers": headers})

    def write_chunk(self, data: bytes, *, last: bool = False) -> bool:
        self._queue.append({"type": "http.response.body", "body": data, "more_body": not last})
        return False

    async def drain(self) -> None:
        queue = self._queue
        while queue:
            await self.send(queue.popleft())


class LeanExchange:
    """One rollout on a ``gateway.http.server.h1server`` connection: the request already read
    (head and body), ``respond`` for a whole response in one write, ``start_chunked`` /
    ``write_chunk`` for a stream, and a minimal ASGI ``receive``/``send`` pair for the
    rest (a response sent while writing is paused)."""

    __slots__ = (
        "body", "chunked", "client", "conn", "done", "gone", "headers", "keep_alive", "lost",
        "path", "pending", "raw_path", "remaining", "started", "task", "waiters",
    )  # fmt: skip

    task: asyncio.Task[None]
    """The task serving the request (set as it is created)."""

    def __init__(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        self.conn = conn
        self.path = conn.raw_path.decode("ascii")
        self.raw_path = conn.raw_path
        self.headers = conn.headers  # lower-case names, as httptools parsed them
        self.client = conn.client
        self.lost = conn.lost_signal  # resolved when the client's connection is lost
        self.body = body
        self.keep_alive = keep_alive
        self.pending: Message | None = None  # http.response.start, written with the body
        self.started = False
        self.done = False
        self.gone = False  # the client left
        self.chunked = False
        self.remaining = 0
        self.waiters: list[asyncio.Future[None]] = []

    def inbound(self) -> Inbound | None:
        if self.gone:
            return None
        task = self.task
        return Inbound(
            "POST", self.path, self.raw_path, b"", self.headers, self.client, task,
            DisconnectGuard(task, lost=self.lost), body=self.body,
        )  # fmt: skip

    async def run(self, handler: Handler) -> None:
        try:
            await handler(self)
        except asyncio.CancelledError:  # server shutdown: drop the connection
            self._finish(reuse=False)
            raise
        except Exception as exc:
            log.error("Exception in the rollout handler", exc_info=exc)
            await self._fail()
        else:
            if not self.done:  # the client left (nothing to say), or the handler misbehaved
                if not self.gone:
                    log.error("The rollout handler returned without completing its response")
                await self._fail()

    async def _fail(self) -> None:
        """As uvicorn: a 500 if nothing was sent yet; the connection is not reused."""
        if not self.started and not self.gone:
            self.pending = None
            self.keep_alive = False
            plain = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")]
            await self.send({"type": "http.response.start", "status": 500, "headers": plain})
            await self.send({"type": "http.response.body", "body": b"Internal Server Error"})
        self._finish(reuse=False)

    def _finish(self, *, reuse: bool) -> None:
        if not self.done:
            self.done = True
            self.conn.server_state.tasks.discard(self.task)
            self.conn.finished(self, reuse=reuse)

    def disconnected(self) -> None:
        self.gone = True
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def receive(self) -> Message:
        """The body was handed over already: ``receive`` only waits for the disconnect."""
        if not self.gone and not self.done:
            # One future per waiter: a disconnect watcher that is cancelled (its exchange
            # finished) must not take the next watcher's wake-up with it.
            waiter = self.conn.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                self.waiters.remove(waiter)
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused:
            await conn.drain()
        if self.gone or self.done:
            return
        transport = conn.transport
        assert transport is not None
        kind = message["type"]
        if not self.started:
            if kind == "http.response.start":
                if self.pending is not None:
                    raise RuntimeError("http.response.start sent twice")
                self.pending = message
                return
            if kind != "http.response.body" or self.pending is None:
                raise RuntimeError(f"Unexpected ASGI message {kind!r} before the response")
            start, self.pending = self.pending, None
            head = self._head(start)  # may refuse the headers: then a 500 goes out
            self.started = True
        elif kind != "http.response.body":
            raise RuntimeError(f"Unexpected ASGI message {kind!r} in a response body")
        else:
            head = b""
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.chunked:
            out = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                out += b"0\r\n\r\n"
        else:
            if len(body) > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= len(body)
            out = body
            if not more and self.remaining:
                raise RuntimeError("Response content shorter than Content-Length")
        transport.write(head + out if head else out)
        if not more:
            self._finish(reuse=self.keep_alive)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """The whole response in one write; False: send it the ASGI way (a response has
        started, or writing is paused). The headers are trusted: lower-case, valid and not
        hop-by-hop (the gateway's own, or upstream ones its parser accepted), so neither
        ASGI messages nor ``_head``'s checks are needed."""
        if self.started or self.pending is not None or self.conn.write_paused:
            return False
        if not (self.gone or self.done):
            self._write_head(status, headers, body)
            self._finish(reuse=self.keep_alive)
        return True

    def start_chunked(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of a streamed response (chunked), headers trusted as in ``respond``;
        then ``write_chunk`` per chunk: a stream relayed without one ASGI message (and one
        coroutine) per chunk."""
        if self.started or self.pending is not None:
            raise RuntimeError("the response has started already")
        self.chunked = True
        if not (self.gone or self.done):
            self._write_head(status, [*headers, (b"transfer-encoding", b"chunked")], b"")

    def write_chunk(self, data: bytes, *, last: bool = False) -> bool:
        """One chunk (``last``: then the end of the response). False: the client reads
        slower than the stream arrives; ``await drain()`` before writing more (never
        after the last chunk: the response is complete once it is buffered)."""
        conn = self.conn
        if self.gone or self.done:
            return True
        out = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        if last:
            out += b"0\r\n\r\n"
        if out:
            assert conn.transport is not None
            conn.transport.write(out)
        if last:
            self._finish(reuse=self.keep_alive)
            return True
        return not conn.write_paused

    async def drain(self) -> None:
        await self.conn.drain()

    def _write_head(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        conn = self.conn
        defaults = conn.server_state.default_headers
        if defaults is not _DEFAULTS[0]:  # uvicorn renews the list (Date) once a second
            _DEFAULTS[:] = [defaults, b"".join([n + b": " + v + b"\r\n" for n, v in defaults])]
        parts = [STATUS_LINE[status], _DEFAULTS[1]]
        parts += [n + b": " + v + b"\r\n" for n, v in headers]
        parts.append(b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n")
        parts.append(body)
        assert conn.transport is not None
        conn.transport.write(b"".join(parts))
        self.started = True

    def _head(self, start: Message) -> bytes:
        headers = [*self.conn.server_state.default_headers, *start.get("headers", ())]
        # As uvicorn, refuse what would corrupt the framing; one search over all names and
        # one over all values (joined by HTAB, which values may hold and names may not).
        if HEADER_RE.search(b"".join(n for n, _ in headers)) or HEADER_VALUE_RE.search(
            b"\t".join(v for _, v in headers)
        ):
            raise RuntimeError("Invalid HTTP header.")
        parts = [STATUS_LINE[start["status"]]]
        has_length = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
                self.remaining = int(value)
            elif lower == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
        if not has_length and start["status"] not in (204, 304):
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


# uvicorn's default headers (Date, Server) and their rendering, refreshed when it renews them.
_DEFAULTS: list[Any] = [None, b""]
