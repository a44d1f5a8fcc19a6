"""Run any ASGI app (the gateway, a sim replica) on a real 127.0.0.1 socket, in-process.

Used by the test suite and the benchmarks: a real uvicorn server with a real TCP socket,
so tests exercise the same HTTP stack users get, without subprocess start-up costs.

    async with serve_asgi(app) as url:
        ...  # url == "http://127.0.0.1:<ephemeral port>"
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn
from starlette.types import ASGIApp

from gateway.api import FastPath
from gateway.http.server.h1server import lean_protocol
from gateway.http.server.serving import CLIENT_IDLE_S, listen_socket
from rollout_testbed.sim.server import VLLM_IDLE_S

__all__ = ["serve_asgi"]


class _Server(uvicorn.Server):
    """No signal capture: several servers share one test process and its handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_asgi(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 10.0,
    http: type[asyncio.Protocol] | None = None,
    tls: tuple[str, str] | None = None,
    idle_s: int | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` until the block exits; yields its base URL. Lifespan runs as usual.
    The gateway's app gets its lean protocol, as ``rollout-gateway serve`` gives it.
    ``host``: a loopback address (several may share one port); ``tls``: (certificate
    file, key file) to serve https instead; ``idle_s``: how long an idle keep-alive
    connection stays open (default: the gateway's ``CLIENT_IDLE_S`` for the gateway's app,
    uvicorn's 5 s, as vLLM has it, for any other)."""
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    if http is None and isinstance(app, FastPath):
        http = lean_protocol(app.serve)
    if idle_s is None:
        idle_s = CLIENT_IDLE_S if isinstance(app, FastPath) else VLLM_IDLE_S
    cert, key = tls or (None, None)
    config = uvicorn.Config(
        app, http=http or "httptools", log_config=None, access_log=False, lifespan="on",
        ws="none", ssl_certfile=cert, ssl_keyfile=key, timeout_keep_alive=idle_s,
    )  # fmt: skip
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(startup_timeout):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("server exited during start-up")
                await asyncio.sleep(0.01)
        yield f"{'https' if tls else 'http'}://{host}:{bound}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)
        sock.close()
