"""The uvicorn protocol a connection is handed to (``gateway.http.h1server``), with the
bounds uvicorn lacks before the end of a request head."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import HeadersTooLarge

__all__ = ["BoundedHttpToolsProtocol", "refusal"]

_MAX_OPEN_HEAD = 1 << 20  # bytes received while a handed-off head is unfinished: 431
# After that 431: keep reading (and dropping) what the client still sends, for at most this
# long and this much, so its kernel is not sent a reset that can destroy the answer.
_LINGER_S = 2.0
_LINGER_BYTES = 4 << 20


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
