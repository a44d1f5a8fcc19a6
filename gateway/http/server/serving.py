"""The socket layer's uvicorn glue: listening sockets with ``TCP_NODELAY``, a server
that exits 0 after draining on SIGTERM, and ``serve``, the one way every gateway process
(one process, the owner, each worker) runs its app.

uvicorn does not set ``TCP_NODELAY`` on accepted connections, and it writes a response's
headers and body in two ``send`` calls. When the request carried no body (``POST /pause``,
``POST /resume``), the client has nothing to piggy-back its ACK on and delays it (40 ms on
Linux), while Nagle's algorithm holds the body until that ACK: every such call took
~44 ms instead of ~0.5 ms (measured against the sim replica). Accepted sockets inherit the
option from the listening socket, so setting it here fixes every connection.
"""

from __future__ import annotations

import gc
import socket
from typing import Any

import uvicorn

from gateway.http.server.exchange import Handler
from gateway.http.server.h1server import lean_protocol
from gateway.http.server.uvicorn_private import DrainingServer

__all__ = ["listen_socket", "serve"]


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


def serve(app: Any, sock: socket.socket, *, lean: Handler | None, shutdown_timeout_s: int) -> bool:
    """Run ``app`` on ``sock`` until SIGTERM/SIGINT and the drain; False if it never
    started. ``lean``: the handler ROUTED requests go to on the lean server
    (``FastPath.serve``); None serves every connection with uvicorn's httptools."""
    # Fewer, cheaper collections on the hot path: take everything built so far out of the
    # GC's reach and collect the young generation less often (per-request garbage is
    # short-lived and mostly freed by reference counting).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=lean_protocol(lean) if lean is not None else "httptools",
        access_log=False,
        proxy_headers=False,  # the gateway is the edge of its pod; no X-Forwarded-* trust
        log_config=None,
        timeout_graceful_shutdown=shutdown_timeout_s,
    )
    server = DrainingServer(config)
    server.run(sockets=[sock])
    return bool(server.started)
