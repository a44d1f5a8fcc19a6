"""Every private uvicorn name the gateway's server relies on, and nothing else.

Why one module: uvicorn's public API is ``uvicorn.Config``, ``uvicorn.Server`` and ASGI.
The lean rollout protocol (``h1server``) needs more: uvicorn builds its protocol with
``(config, server_state, app_state, _loop)`` and a ``ServerState``; odd connections are
handed over, mid-stream, to uvicorn's ``HttpToolsProtocol``; responses are framed with its
status lines and checked with its header validators, so both protocols answer alike; and
``DrainingServer`` clears ``Server._captured_signals``. None of that is public. Kept here,
an upgrade of uvicorn is checked against one file, and
``tests/http/server/test_uvicorn_internals.py`` (the canary, with ``pyproject.toml``'s pin)
fails if any name below changes, or if another gateway module imports one directly.

What the rest of the server reads of these objects, besides what is defined here:
``ServerState.connections``, ``.tasks`` and ``.default_headers``, and
``Config.timeout_keep_alive`` (the canary checks those too).

Also here, because it overrides ``HttpToolsProtocol``'s parser callbacks:
``BoundedHttpToolsProtocol``, the bound uvicorn lacks on a request head that never ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
)
from uvicorn.server import ServerState

from gateway.errors import HeadersTooLarge

__all__ = [
    "HEADER_RE",
    "HEADER_VALUE_RE",
    "STATUS_LINE",
    "BoundedHttpToolsProtocol",
    "Config",
    "DrainingServer",
    "ServerState",
    "hand_off",
    "refusal",
]

_MAX_OPEN_HEAD = 1 << 20  # bytes received while a handed-off head is unfinished: 431
# After that 431: keep reading (and dropping) what the client still sends, for at most this
# long and this much, so its kernel is not sent a reset that can destroy the answer.
_LINGER_S = 2.0
_LINGER_BYTES = 4 << 20


def hand_off(
    transport: asyncio.Transport,
    config: Config,
    server_state: ServerState,
    app_state: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    data: bytes,
) -> None:
    """Give the connection on ``transport`` to uvicorn's protocol (bounded) for the rest of
    its life: ``data``, the bytes not consumed yet, is replayed to it as if it had just
    arrived."""
    protocol = BoundedHttpToolsProtocol(
        config=config, server_state=server_state, app_state=app_state, _loop=loop
    )
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    protocol.data_received(data)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol, with a bound on a request head that never ends.

    Why: uvicorn bounds nothing before the end of the head, and httptools accumulates an
    unfinished header value by concatenation; one connection sending an endless header
    grew the gateway by 320 MB in 40 s and burnt its core doing it. A complete head of any
    size still goes to the app (whose limit, ``max_header_bytes``, answers 431 with what
    it counted); past ``_MAX_OPEN_HEAD`` bytes with the head still open, the connection
    gets the same 431 body here and is closed.

    The close lingers (as nginx's ``lingering_close``): a client still sending its head
    would otherwise be answered by a reset, which over a real network can destroy the 431
    before it is read. The gateway's side is shut down for writing at once, and what the
    client still sends is dropped, until it closes or ``_LINGER_S`` / ``_LINGER_BYTES``."""

    head_open = True
    head_bytes = 0
    lingering: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self.head_open:
            self.head_bytes += len(data)
            if self.lingering is not None:  # dropped; bounded in bytes as in time
                if self.head_bytes > _MAX_OPEN_HEAD + _LINGER_BYTES:
                    self._stop_lingering()
                return
            if self.head_bytes > _MAX_OPEN_HEAD:
                if not self.transport.is_closing():
                    self._refuse_431()
                return
        super().data_received(data)

    def eof_received(self) -> None:
        if self.lingering is not None:  # the client is done sending: close now
            self._stop_lingering()
            return
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lingering is not None:
            self._stop_lingering()  # its timer; closing a lost transport does nothing
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self.head_open, self.head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.head_open = True  # the next request's head, if any, starts here
        super().on_message_complete()

    def _refuse_431(self) -> None:
        limit = _MAX_OPEN_HEAD >> 10
        body = HeadersTooLarge(f"Request head exceeds {limit} KiB.", limit="header_bytes").body()
        transport = self.transport
        transport.write(refusal(self.server_state, 431, b"application/json", body))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.lingering = self.loop.call_later(_LINGER_S, self._stop_lingering)

    def _stop_lingering(self) -> None:
        if self.lingering is not None:
            self.lingering.cancel()
            self.lingering = None
        self.transport.close()


def refusal(state: ServerState, status: int, ctype: bytes, body: bytes) -> bytes:
    """A refusal as uvicorn writes its own (its default headers included), closing."""
    defaults = b"".join([n + b": " + v + b"\r\n" for n, v in state.default_headers])
    return (
        STATUS_LINE[status] + defaults + b"content-type: " + ctype + b"\r\ncontent-length: "
        b"%d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, drain in-flight requests for up to
    ``shutdown_timeout_s``, then exit 0. (uvicorn re-raises the signal after its graceful
    shutdown, so the process would die by it with status 143, which orchestrators read as
    a crash.) Here because ``_captured_signals``, the list it clears, is private."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()
