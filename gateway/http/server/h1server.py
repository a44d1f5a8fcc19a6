"""The gateway's HTTP/1.1 server protocol: rollouts served lean, everything else by uvicorn.

Why: at its throughput ceiling, uvicorn's generic ASGI cycle (scope and state copies, an
``asyncio.Event`` per request, header regexes, a separate ``write`` for the head and the
body) was the largest share of the gateway's CPU per rollout that the gateway did not need
(``bench/ceiling.py``: the profile, and the ``floor`` front).

How: every connection starts here. While it sends well-formed ``POST /v1/completions`` or
``POST /v1/chat/completions`` requests (HTTP/1.1, ``Content-Length`` framed, no ``Expect``,
``Upgrade`` or ``Transfer-Encoding``, no query string), each request is sliced from the
buffer, validated by ``httptools`` (the same strict parser uvicorn uses), and handed to the
gateway's handler as a ``gateway.http.server.exchange.LeanExchange``, with no ASGI scope.
The first request that is anything else hands the connection, with every byte not yet
consumed, to uvicorn's own protocol for the rest of its life, so admin calls, probes, odd
framings and errors keep uvicorn's behaviour exactly; a rollout arriving there later
reaches the same handler as an ``AsgiExchange``. One request at a time per connection:
pipelined bytes wait in the buffer (reading pauses above a bound) until the response
before them is complete.

``tests/http/server/test_h1server_differential.py`` sends one corpus of raw requests (CL/TE
variants, obs-fold, bare LF, big heads and bodies, HTTP/1.0, pipelining, half-close,
``Expect``) here and to plain uvicorn, and holds both to the same framing decision. One
difference is kept: a well-formed request pipelined in front of a malformed one is answered
before the 400 (uvicorn writes its 400 at once, and the answer in flight is lost).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools

from gateway.http.server.exchange import Handler, LeanExchange
from gateway.http.server.uvicorn_private import Config, ServerState, hand_off, refusal

__all__ = ["ROUTED_PATHS", "LeanProtocol", "lean_protocol"]

# The rollout paths: read here off the socket, and in the API's route table (the ASGI
# path, for connections handed to uvicorn). Defined once, here, the lower of the two.
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_ROUTED = tuple(f"POST {path} HTTP/1.1\r\n".encode() for path in ROUTED_PATHS)
_LONGEST = max(len(p) for p in _ROUTED)
_HAND_OFF_HEADERS = (b"transfer-encoding", b"expect", b"upgrade")
_MAX_LEAN_BODY = 4 << 20  # larger bodies go to uvicorn, which streams them to the app
_MAX_HEAD = 64 << 10  # no end of headers by then: uvicorn (and the app's 431) decide
_PIPELINE_PAUSE = 256 << 10  # buffered bytes behind a request in flight: stop reading


def lean_protocol(handler: Handler) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``; ROUTED requests go to
    ``handler`` (the gateway's ``FastPath.serve``), every other connection is uvicorn's."""

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
        """From here on the connection is uvicorn's (``uvicorn_private.hand_off``): the
        bytes not consumed yet are replayed to its protocol as if they had just arrived."""
        transport = self.transport
        assert transport is not None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.server_state.connections.discard(self)
        self.parser = None
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        data, self.buf = bytes(self.buf), bytearray()
        hand_off(transport, self.config, self.server_state, self.app_state, self.loop, data)

    def _refuse_400(self) -> None:
        """uvicorn's answer to a request its parser refuses, byte for byte (its default
        headers included), then the connection is closed."""
        assert self.transport is not None
        msg = b"Invalid HTTP request received."
        self.transport.write(refusal(self.server_state, 400, b"text/plain; charset=utf-8", msg))
        self.transport.close()  # as uvicorn does after its 400
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


def _addr(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, tuple) and value else None
