"""A minimal keep-alive HTTP/1.1 client for the ROUTED data path (asyncio + httptools).

Why: aiohttp's ``ClientSession.request`` does work a rollout does not need (tracing hooks,
``ClientRequest``, multidict headers, payload registry, timer objects, ``StreamReader``),
on the path every rollout takes (docs/decisions.md, 'HTTP: an own client for rollouts').
This client writes one pre-assembled request (head + body, one ``write``) on a pooled
connection and parses the response with ``httptools`` (already installed for uvicorn).

Scope: one request at a time per connection, ``Content-Length`` or chunked responses
(or a body ended by the close), streaming (SSE) bodies with back-pressure, plain ``http``
and ``https``. Control-plane calls (fan-out, probes, adapter loads) keep using aiohttp.

Framing is strict, as a proxy's should be (``tests/http/test_h1client_differential.py`` checks
it against aiohttp, case by case): httptools (llhttp) refuses what is ambiguous (duplicate
or listed ``Content-Length``, ``Content-Length`` with ``Transfer-Encoding``, obs-fold, bare
LF, bad chunk sizes); interim responses (``100``, ``103``) are skipped, ``101`` refused (no
request asks for an upgrade); a ``Transfer-Encoding`` other than ``chunked`` is refused
(the gateway relays bytes, it cannot re-apply a transfer coding it would have to drop);
``204`` and ``304`` have no body whatever their ``Content-Length`` says; bytes after the
end of a response never reach it (the response stands, the connection is closed).

Errors, mapped by ``Upstream.send_routed`` the way ``upstream.map_errors`` maps aiohttp's:

* ``ConnectFailed`` (DNS, refused, TLS, connect timeout: ``gateway.http.failures``) and
  ``ResetBeforeResponse`` (the connection died before any response byte, e.g. a stale
  keep-alive connection): the replica produced nothing, so retrying elsewhere is safe
  (``ReplicaConnectError``);
* ``TimeoutError``: no byte for ``read_timeout_s`` (``UpstreamTimeout``);
* ``BrokenResponse`` (a ``ConnectionError``): lost or unparsable after the first response
  byte; ``read()`` and ``content.iter_any()`` raise it (``UpstreamError``).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time

import httptools

from gateway.http.failures import connect_kind
from gateway.http.h1response import BrokenResponse, ConnectFailed, H1Response, ResetBeforeResponse

__all__ = ["H1Pool"]

_RACE_S = 1.0
"""A reused connection that dies this soon after the send, before any response byte, lost
the keep-alive race (the replica closed it as the request went out): sent once more. Later
than that, the replica took the request and died on it; re-sending it there is wrong."""
_MAX_HEADERS = 100  # upstream response headers: count, and bytes of names and values
_MAX_HEAD_BYTES = 64 << 10
_MAX_RAW_HEAD = 2 * _MAX_HEAD_BYTES
"""Bytes read before the head is complete (status lines, interim responses included):
httptools buffers a header until its end, so an endless header or status line (or an
endless run of 1xx) would otherwise be held in memory, never timing out."""


class _Conn(asyncio.Protocol):
    """One upstream connection; at most one request in flight."""

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        # Once per connection: in CPython 3.11 each get_running_loop() is a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        # The parser holds this protocol's callbacks: a reference cycle, broken in
        # ``connection_lost`` so a closed connection is freed at once, not at the next
        # full GC collection (which the tuned thresholds in ``cli.serve`` make rare).
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: H1Response | None = None
        self.headers_ready: asyncio.Future[H1Response] | None = None
        self.received = False  # any byte of the current response
        self.complete = False  # the current response ended cleanly
        self.keep_alive = True
        self.until_eof = False  # neither Content-Length nor chunked: the body ends at EOF
        self.lost = False
        self.last_io = 0.0
        self.sent_at = 0.0
        self.idle_since = 0.0
        self.head_bytes = 0
        self.head_read = 0
        self.fields: list[tuple[bytes, bytes]] = []
        self.refusal: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.last_io = time.monotonic()
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self._abort()
            return
        self.received = True
        if self.parser is None:  # lost already; uvloop may still deliver a last read
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            reason = self.refusal or f"invalid HTTP response from the replica: {exc}"
            self._fail(BrokenResponse(reason))
            self._abort()
            return
        if self.headers_ready is not None:  # the head is still arriving: bound it
            self.head_read += len(data)
            if self.head_read > _MAX_RAW_HEAD:
                self._fail(BrokenResponse(f"response head over {_MAX_RAW_HEAD} bytes"))
                self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.parser = None
        self.pool.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        response = self.response
        if response is None or self.complete:
            return
        if self.until_eof and exc is None and self.headers_ready is None:
            self.complete = True
            response._finish()
        elif self.received:
            self._fail(BrokenResponse("replica closed the connection mid-response"))
        else:
            self._fail(ResetBeforeResponse("replica closed the connection"))

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.fields
        headers.append((name, value))
        self.head_bytes += len(name) + len(value)
        if len(headers) > _MAX_HEADERS or self.head_bytes > _MAX_HEAD_BYTES:
            # Raised inside the parser (which hides the message): data_received fails it.
            self.refusal = f"response headers over {_MAX_HEADERS} or {_MAX_HEAD_BYTES} bytes"
            raise ValueError(self.refusal)

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        parser = self.parser
        assert parser is not None
        if self.complete:  # a second message behind the response: never part of it
            self.refusal = "bytes after the end of the response"
            raise ValueError(self.refusal)
        status = parser.get_status_code()
        if status < 200:
            if status == 101:
                self.refusal = "101 Switching Protocols, but no upgrade was asked for"
                raise ValueError(self.refusal)
            response.raw_headers = self.fields = []  # interim (100, 103): skipped
            return
        response.status = status
        self.keep_alive = parser.should_keep_alive()
        chunked = False
        for name, value in response.raw_headers:
            lower = name.lower()
            if lower == b"content-length" and value.strip().isdigit():
                response.content_length = int(value)
            elif lower == b"content-type":
                response.content_type = value.partition(b";")[0].strip().lower().decode("latin-1")
            elif lower == b"transfer-encoding":
                if chunked or value.strip().lower() != b"chunked":
                    self.refusal = f"unsupported transfer coding {value[:64]!r}"
                    raise ValueError(self.refusal)
                chunked = True
        if status == 204 or status == 304:
            response.content_length = 0  # never a body (llhttp reads none either)
        self.until_eof = response.content_length is None and not chunked
        # Trailers, and the fields of any message behind this one (refused when its head
        # is complete), go to a scratch list: bounded with the headers, then dropped.
        self.fields = []
        waiter, self.headers_ready = self.headers_ready, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if response.status:  # 0: the end of an interim response
            self.complete = True
            response._finish()

    # -- driving ------------------------------------------------------------------------

    def start(self, head: bytes, body: bytes) -> asyncio.Future[H1Response]:
        assert self.transport is not None
        response = H1Response(self)
        self.response = response
        self.fields = response.raw_headers  # on_header's list: the head's, then trailers'
        self.received = self.complete = self.until_eof = False
        self.head_bytes = self.head_read = 0
        self.refusal = None
        self.headers_ready = waiter = self.loop.create_future()
        if self.lost:
            waiter.set_exception(ResetBeforeResponse("replica closed the connection"))
            return waiter
        self.last_io = self.sent_at = time.monotonic()
        if self.timer is None:
            self._arm(self.pool.read_timeout_s)
        if len(body) < 65536:  # one segment; big bodies are not copied
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return waiter

    def abandon(self) -> None:
        """The caller gave up before the headers (error or cancellation): never reuse."""
        self.response = None
        self.headers_ready = None
        self._abort()
        self.pool.discard(self)

    def _arm(self, delay: float) -> None:
        self.timer = self.loop.call_later(delay, self._check_timeout)

    def _check_timeout(self) -> None:
        """One lazy timer per connection, not per request: re-armed for the remainder
        while bytes keep coming, so a busy connection costs no timer churn."""
        self.timer = None
        if self.response is None or self.complete or self.lost:
            return
        quiet = time.monotonic() - self.last_io
        limit = self.pool.read_timeout_s
        if quiet < limit:
            self._arm(limit - quiet)
            return
        self._fail(TimeoutError(f"no byte from replica {self.pool.replica} in {limit:g} s"))
        self._abort()

    def _fail(self, error: BaseException) -> None:
        waiter, self.headers_ready = self.headers_ready, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        elif self.response is not None:
            self.response._finish(error)

    def _abort(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def finished(self, response: H1Response, *, reuse: bool) -> None:
        if response is not self.response:
            return
        self.response = None
        self.headers_ready = None
        self.resume()
        if reuse and self.keep_alive and not self.lost:
            self.idle_since = time.monotonic()
            self.pool.put_back(self)
        else:
            self._abort()
            self.pool.discard(self)


class H1Pool:
    """Keep-alive connections to one replica (LIFO: the warmest connection first).

    Idle connections are dropped after ``keepalive_s`` (4 s): vLLM's uvicorn closes them
    after 5 s, and reusing one the replica is closing at that instant fails before any
    response byte -- retried, but counted against the replica."""

    def __init__(
        self,
        replica: int,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        keepalive_s: float = 4.0,
        max_connections: int = 1024,
    ) -> None:
        self.replica = replica
        self.host = host
        self.port = port
        self.ssl = ssl_context  # None: plain http
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.stale_resends = 0
        """Requests sent again after a reused connection died before answering."""

    async def request(self, head: bytes, body: bytes) -> H1Response:
        """Send ``head`` (request line + headers + blank line) and ``body``; return once
        the response headers arrived (errors: see the module docstring).

        A *reused* connection that dies at once (``_RACE_S``), before any response byte,
        was closed by the replica's keep-alive timeout as the request went out: the request
        is sent once more on a new connection, instead of failing over to another replica
        and counting a healthy one as dead."""
        conn = self._take_idle()  # the common case, without a coroutine for _acquire
        reused = conn is not None
        if conn is None:
            conn, reused = await self._acquire()
        try:
            return await conn.start(head, body)
        except ResetBeforeResponse:
            conn.abandon()
            if not reused or time.monotonic() - conn.sent_at > _RACE_S:
                raise
        except BaseException:
            conn.abandon()
            raise
        self.stale_resends += 1
        conn, _ = await self._acquire(fresh=True)
        try:
            return await conn.start(head, body)
        except BaseException:
            conn.abandon()
            raise

    def _take_idle(self) -> _Conn | None:
        """The warmest idle connection still fit for reuse; stale ones are closed."""
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                return conn
            conn._abort()
            self._open.discard(conn)
        return None

    async def _acquire(self, *, fresh: bool = False) -> tuple[_Conn, bool]:
        """A connection, and whether it served before (``fresh``: never an idle one)."""
        while True:
            if not fresh:
                conn = self._take_idle()
                if conn is not None:
                    return conn, True
            if len(self._open) < self.max_connections:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            await waiter
        conn = _Conn(self)
        self._open.add(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn, self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )  # fmt: skip
        except TimeoutError as exc:
            self.discard(conn)
            raise ConnectFailed("connect_timeout", f"connect to {self.host}:{self.port}") from exc
        except OSError as exc:  # ssl.SSLError and socket.gaierror are OSErrors too
            self.discard(conn)
            kind = connect_kind(exc)
            raise ConnectFailed(kind, f"connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self.discard(conn)
            raise
        return conn, False

    def put_back(self, conn: _Conn) -> None:
        self._idle.append(conn)
        self._wake_one()

    def discard(self, conn: _Conn) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._wake_one()
        if conn in self._idle:
            self._idle.remove(conn)

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self._open):
            conn._abort()
        self._open.clear()
        self._idle.clear()
