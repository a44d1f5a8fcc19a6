"""The gateway's HTTP/1.1 server protocol: rollouts served lean, everything else by uvicorn.

Why: at its throughput ceiling, uvicorn's generic ASGI cycle (scope and state copies, an
``asyncio.Event`` per request, header regexes, a separate ``write`` for the head and the
body) was the largest share of the gateway's CPU per rollout that the gateway did not need
(``bench/ceiling.py``: the profile, and the ``floor`` front).

How: every connection starts here. While it sends well-formed ``POST /v1/completions`` or
``POST /v1/chat/completions`` requests (HTTP/1.1, ``Content-Length`` framed, no ``Expect``,
``Upgrade`` or ``Transfer-Encoding``, no query string), each request is sliced from the
buffer, validated by ``httptools`` (the same strict parser uvicorn uses), and handed to the
gateway's handler as a ``LeanExchange``, with no ASGI scope: the handler answers with one
``respond`` (one ``write``) when the response is complete, or through the exchange's
minimal ASGI ``receive``/``send`` pair (chunked when the length is unknown). The first
request that is anything else hands the connection, with every byte not yet consumed, to
uvicorn's own protocol for the rest of its life, so admin calls, probes, odd framings and
errors keep uvicorn's behaviour exactly. One request at a time per connection: pipelined bytes wait
in the buffer (reading pauses above a bound) until the response before them is complete.

``tests/test_h1server_differential.py`` sends one corpus of raw requests (CL/TE variants,
obs-fold, bare LF, big heads and bodies, HTTP/1.0, pipelining, half-close, ``Expect``) here
and to plain uvicorn, and holds both to the same framing decision. One difference is kept:
a well-formed request pipelined in front of a malformed one is answered before the 400
(uvicorn writes its 400 at once, and the answer in flight is lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from starlette.types import Message
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
)
from uvicorn.server import ServerState

__all__ = ["Handler", "LeanExchange", "lean_protocol"]

log = logging.getLogger("gateway.server")

_ROUTED = (b"POST /v1/completions HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n")
_LONGEST = max(len(p) for p in _ROUTED)
_HAND_OFF_HEADERS = (b"transfer-encoding", b"expect", b"upgrade")
_MAX_LEAN_BODY = 4 << 20  # larger bodies go to uvicorn, which streams them to the app
_MAX_HEAD = 64 << 10  # no end of headers by then: uvicorn (and the app's 431) decide
_PIPELINE_PAUSE = 256 << 10  # buffered bytes behind a request in flight: stop reading


Handler = Callable[["LeanExchange"], Awaitable[None]]
"""Serves one rollout; must answer (``respond`` or ``send``); raising, or returning without
an answer, gets a 500 and closes the connection, as uvicorn does for an ASGI app."""


def lean_protocol(handler: Handler) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``; ROUTED requests go to
    ``handler`` (the gateway's ``FastPath.lean``), every other connection is uvicorn's."""

    class Bound(LeanProtocol):
        pass

    Bound.handler = staticmethod(handler)
    return Bound


class LeanProtocol(asyncio.Protocol):
    handler: Handler

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = _loop or asyncio.get_event_loop()
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: LeanExchange | None = None  # the request in flight
        self.reading_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.lost = False
        self.lost_signal: asyncio.Future[None] = self.loop.create_future()  # exchange.lost
        self.closing = False
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_active = 0.0
        # the request being read: its head's size (0 = not parsed yet), body length, path
        self.head_size = 0
        self.length = 0
        self.raw_path = b""
        # filled by the parser callbacks for the message being validated
        self.headers: list[tuple[bytes, bytes]] = []
        self.messages = 0
        self.keep_alive = True
        self.complete = False

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        self.server = _addr(transport.get_extra_info("sockname"))
        self.client = _addr(transport.get_extra_info("peername"))
        self._touch()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.last_active = self.loop.time()
        if self.exchange is None:
            self._next()
        elif len(self.buf) > _PIPELINE_PAUSE and not self.reading_paused:
            self.reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.lost_signal.done():
            self.lost_signal.set_result(None)
        self.parser = None  # the parser holds our callbacks: break the cycle
        self.server_state.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.exchange is not None:
            self.exchange.disconnected()
        self._resume_writing()

    def eof_received(self) -> bool | None:
        return None  # close our side too; a request in flight sees the disconnect

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self._resume_writing()

    # -- uvicorn's server calls these -------------------------------------------------

    def shutdown(self) -> None:
        """Graceful shutdown: close when idle, else after the response in flight."""
        self.closing = True
        if self.exchange is None and self.transport is not None:
            self.transport.close()

    # -- httptools callbacks (validation of one sliced message) ------------------------

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None  # asked here: after the message it reads the next one
        self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        self.complete = True

    # -- the request loop -------------------------------------------------------------

    def _next(self) -> None:
        """Start the next buffered request, or hand the connection to uvicorn. The head
        is parsed once, when it is complete; the body is fed when all of it is in."""
        if self.lost or self.closing or not self.buf:
            return
        buf = self.buf
        if not self.head_size:
            if not buf.startswith(_ROUTED):
                if len(buf) < _LONGEST and any(p.startswith(buf) for p in _ROUTED):
                    return  # the request line is still arriving
                self._hand_off()
                return
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                # No end of head yet. One ended by bare LFs never gets one: uvicorn's
                # parser refuses it (400) at once, rather than the client waiting for ever.
                if len(buf) > _MAX_HEAD or b"\n\n" in buf or b"\n\r\n" in buf:
                    self._hand_off()
                return
            length = self._parse_head(bytes(buf[: end + 4]))
            if length is None:
                return  # refused or handed off
            self.head_size, self.length = end + 4, length
            self.raw_path = bytes(buf[5 : buf.index(b" ", 5)])  # after "POST "
        size = self.head_size + self.length
        if len(buf) < size:
            return  # the body is still arriving
        body = bytes(buf[self.head_size : size])
        del buf[:size]
        self.head_size = 0
        self._serve(body)

    def _parse_head(self, head: bytes) -> int | None:
        """Validate the head with httptools and return the body's length; ``None`` once
        the request was refused (400) or the connection handed to uvicorn (framings and
        headers this protocol leaves to it)."""
        parser = self.parser
        assert parser is not None
        self.headers = []
        self.messages = 0
        self.keep_alive = True
        self.complete = False
        try:
            parser.feed_data(head)
        except httptools.HttpParserError:
            self._refuse_400()
            return None
        except httptools.HttpParserUpgrade:  # Connection: upgrade (e.g. h2c): uvicorn's
            self._hand_off()
            return None
        length: int | None = None
        for name, value in self.headers:
            if name == b"content-length":
                # Digits only, as the app's ``read_body`` on uvicorn's path reads it: a
                # value with OWS ("48 ") gets the same 400 there, never a different answer.
                if length is not None or not value.isdigit():
                    length = -1
                    break
                length = int(value)
            elif name in _HAND_OFF_HEADERS:
                length = -1
                break
        if length is None or not 0 <= length <= _MAX_LEAN_BODY:
            self._hand_off()
            return None
        return length

    def _serve(self, body: bytes) -> None:
        parser = self.parser
        assert parser is not None and self.transport is not None
        if body:
            try:
                parser.feed_data(body)
            except httptools.HttpParserError:
                self._refuse_400()
                return
        if not self.complete or self.messages != 1:  # framings disagree: refuse, never guess
            self._refuse_400()
            return
        exchange = LeanExchange(self, body, self.keep_alive and not self.closing)
        self.exchange = exchange
        # In uvicorn's task set until the response is out (``LeanExchange._finish``): its
        # graceful shutdown waits for, and past the timeout cancels, what is in there.
        exchange.task = self.loop.create_task(exchange.run(self.handler))
        self.server_state.tasks.add(exchange.task)

    def finished(self, exchange: LeanExchange, *, reuse: bool) -> None:
        """The response is out (or abandoned): next request, or close."""
        if exchange is not self.exchange:
            return
        self.exchange = None
        if self.lost:
            return
        assert self.transport is not None
        if not reuse or self.closing:
            self.transport.close()
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        self._touch()
        if self.buf:
            self.loop.call_soon(self._next)

    def _hand_off(self) -> None:
        """From here on the connection is uvicorn's: the bytes not consumed yet are
        replayed to its protocol as if they had just arrived."""
        transport = self.transport
        assert transport is not None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.server_state.connections.discard(self)
        protocol = HttpToolsProtocol(
            config=self.config,
            server_state=self.server_state,
            app_state=self.app_state,
            _loop=self.loop,
        )
        self.parser = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        data, self.buf = bytes(self.buf), bytearray()
        protocol.data_received(data)

    def _refuse_400(self) -> None:
        """uvicorn's answer to a request its parser refuses, byte for byte (its default
        headers included), then the connection is closed."""
        assert self.transport is not None
        msg = b"Invalid HTTP request received."
        defaults = b"".join([n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers])
        self.transport.write(
            STATUS_LINE[400] + defaults + b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(msg), msg)
        )
        self.transport.close()
        self.buf.clear()
        self.head_size = 0

    # -- idle keep-alive: one lazy timer per connection ------------------------------

    def _touch(self) -> None:
        self.last_active = self.loop.time()
        if self.idle_timer is None:
            self._arm_idle(self.config.timeout_keep_alive)

    def _arm_idle(self, delay: float) -> None:
        self.idle_timer = self.loop.call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        self.idle_timer = None
        if self.lost or self.transport is None:
            return
        if self.exchange is not None:  # busy: look again a full period later
            self._touch()
            return
        quiet = self.loop.time() - self.last_active
        if quiet >= self.config.timeout_keep_alive:
            self.transport.close()
        else:
            self._arm_idle(self.config.timeout_keep_alive - quiet)

    # -- write flow control ----------------------------------------------------------

    def _resume_writing(self) -> None:
        self.write_paused = False
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def drain(self) -> None:
        if self.write_paused and not self.lost:
            if self.drained is None:
                self.drained = self.loop.create_future()
            await self.drained


class LeanExchange:
    """One request/response on a lean connection: what the handler reads of the request,
    ``respond`` for a whole response, and an ASGI ``receive``/``send`` pair for the rest."""

    __slots__ = (
        "body", "chunked", "client", "conn", "done", "gone", "headers", "keep_alive", "lost",
        "path", "pending", "raw_path", "remaining", "started", "task", "waiters",
    )  # fmt: skip

    task: asyncio.Task[None]
    """The task serving the request (set as it is created)."""

    def __init__(self, conn: LeanProtocol, body: bytes, keep_alive: bool) -> None:
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
        slower than the stream arrives; ``await drain()`` before writing more."""
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


def _addr(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, tuple) and value else None
