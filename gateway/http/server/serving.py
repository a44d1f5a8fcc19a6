"""The socket layer's uvicorn glue: listening sockets with ``TCP_NODELAY``, a server
that exits 0 after draining on SIGTERM, and ``serve``, the one way every gateway process
(one process, the owner, each worker) runs its app.

SIGTERM, in two phases (``ReadinessDrain``), so that Kubernetes can take the pod out of its
Services before it goes: first the listener stays open, ``Stopping`` is set (``/readyz``
answers 503, ``/livez`` still 200, new work is refused with 503) until no request is in
flight; then uvicorn's own shutdown closes the listener with what is left of
``shutdown_timeout_s``. The two phases together never take longer than that timeout.

uvicorn does not set ``TCP_NODELAY`` on accepted connections, and it writes a response's
headers and body in two ``send`` calls. When the request carried no body (``POST /pause``,
``POST /resume``), the client has nothing to piggy-back its ACK on and delays it (40 ms on
Linux), while Nagle's algorithm holds the body until that ACK: every such call took
~44 ms instead of ~0.5 ms (measured against the sim replica). Accepted sockets inherit the
option from the listening socket, so setting it here fixes every connection.

An idle keep-alive connection is closed after ``CLIENT_IDLE_S`` (75 s, nginx's default),
not uvicorn's 5 s. Whichever side closes an idle connection first races the other side's
next request on it: a request sent as the close crosses it is lost with "server
disconnected" and no answer. The client can only avoid that race if it always gives up
first, so the server must wait longer than the clients' pools keep a connection: httpx
keeps one 5 s (exactly uvicorn's default), aiohttp 15 s; requests never expires one, but
checks it for a close before reuse, and a close 75 s into an idle spell is far rarer than
one every 5 s (``bench/keepalive_race.py`` measures the race).
"""

from __future__ import annotations

import asyncio
import gc
import math
import socket
import time
from typing import Any

import uvicorn

from gateway.http.server.exchange import Handler
from gateway.http.server.h1server import lean_protocol
from gateway.http.server.uvicorn_private import DrainingServer

__all__ = ["CLIENT_IDLE_S", "Stopping", "listen_socket", "serve", "server_config"]

CLIENT_IDLE_S = 75
"""How long an idle keep-alive connection is kept open (module docstring)."""


class Stopping:
    """Whether this process was told to stop (SIGTERM/SIGINT) and is draining: set by the
    server when the signal arrives, read by ``/readyz`` (503 from then on) and by
    admission (new work refused with 503 while in-flight requests finish). One per
    process; ``/livez`` does not read it: the process is alive until it exits."""

    def __init__(self) -> None:
        self.since: float | None = None
        """``time.monotonic()`` when the stop began; None while serving."""

    @property
    def stopping(self) -> bool:
        return self.since is not None

    def begin(self, now: float) -> None:
        if self.since is None:
            self.since = now


class ReadinessDrain(DrainingServer):
    """``DrainingServer`` whose drain begins with the listener still open (module
    docstring): a readiness probe that can no longer connect reads "not ready" too, but a
    liveness probe would read "dead", and a client that connects in the seconds before
    Kubernetes has removed the pod from its endpoints would get a refused connection
    instead of a 503 it can retry."""

    def __init__(self, config: uvicorn.Config, stopping: Stopping) -> None:
        super().__init__(config)
        self.stopping = stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.config.timeout_graceful_shutdown
        deadline = loop.time() + (math.inf if timeout is None else timeout)
        self.stopping.begin(time.monotonic())
        # Requests in flight (probes among them last a millisecond); idle kept-alive
        # connections are not waited for: uvicorn's shutdown closes them. Polled, as
        # uvicorn polls the same set: no event says it became empty.
        while loop.time() < deadline and not self.force_exit:
            if not self.server_state.tasks:
                break
            await asyncio.sleep(0.1)
        if timeout is not None:
            self.config.timeout_graceful_shutdown = max(0, math.ceil(deadline - loop.time()))
        await super().shutdown(sockets)


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6 by ``host``) ready to hand to ``uvicorn``.
    ``reuse_port``: several processes bind the port, and the kernel spreads new
    connections over their listening sockets (data-plane workers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def server_config(app: Any, lean: Handler | None, shutdown_timeout_s: int) -> uvicorn.Config:
    """The uvicorn configuration every gateway process serves with (``serve``)."""
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=lean_protocol(lean) if lean is not None else "httptools",
        access_log=False,
        proxy_headers=False,  # the gateway is the edge of its pod; no X-Forwarded-* trust
        log_config=None,
        timeout_graceful_shutdown=shutdown_timeout_s,
        timeout_keep_alive=CLIENT_IDLE_S,
    )


def serve(
    app: Any, sock: socket.socket, *, lean: Handler | None, shutdown_timeout_s: int,
    stopping: Stopping,
) -> bool:  # fmt: skip
    """Run ``app`` on ``sock`` until SIGTERM/SIGINT and the drain; False if it never
    started. ``lean``: the handler ROUTED requests go to on the lean server
    (``FastPath.serve``); None serves every connection with uvicorn's httptools.
    ``stopping``: set when the drain begins (the app's probes and admission read it)."""
    # Fewer, cheaper collections on the hot path: take everything built so far out of the
    # GC's reach and collect the young generation less often (per-request garbage is
    # short-lived and mostly freed by reference counting).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    server = ReadinessDrain(server_config(app, lean, shutdown_timeout_s), stopping)
    server.run(sockets=[sock])
    return bool(server.started)
