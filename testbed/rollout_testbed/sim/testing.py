"""Run simulated replicas on real sockets inside the test's event loop.

Usage (pytest-asyncio)::

    from rollout_testbed.sim.config import SimConfig
    from rollout_testbed.sim.testing import running_sim, running_sims

    async def test_something() -> None:
        async with running_sim(SimConfig(max_loras=4)) as url:
            url.sim.faults.load_not_found = 2      # SimState: faults, stats, adapters
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.get("/v1/models")

        async with running_sims(3) as urls:        # three independent replicas
            ...

``url`` is a ``SimURL``: a plain ``str`` (``http://127.0.0.1:<port>``) that also carries
``.sim`` (the replica's ``SimState``) and ``.app``. The server binds port 0, so tests never
collide; on exit it releases hung and paused requests, then shuts uvicorn down (no signal
handlers are installed, so several sims can nest).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import uvicorn
from fastapi import FastAPI

from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.state import SimState

__all__ = ["SimURL", "running_sim", "running_sims"]


class SimURL(str):
    """The replica's base URL, plus handles on its app and engine state."""

    sim: SimState
    app: FastAPI

    def __new__(cls, url: str, app: FastAPI) -> SimURL:
        self = super().__new__(cls, url)
        self.app = app
        self.sim = app.state.sim
        return self


@asynccontextmanager
async def running_sim(
    config: SimConfig | None = None, *, host: str = "127.0.0.1"
) -> AsyncIterator[SimURL]:
    """Serve ``create_sim_app(config)`` on ``host``:<free port> for the ``async with`` body."""
    app = create_sim_app(config)
    cfg = uvicorn.Config(
        app,
        host=host,
        port=0,
        http="httptools",
        ws="none",
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    cfg.load()
    server = uvicorn.Server(cfg)
    # startup() instead of serve(): no signal handlers and no 0.1 s main-loop tick.
    server.lifespan = cfg.lifespan_class(cfg)
    await server.startup()
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        yield SimURL(f"http://{host}:{port}", app)
    finally:
        state: SimState = app.state.sim
        state.clear_faults()
        state.resume()
        await _shutdown(server)


async def _shutdown(server: uvicorn.Server, timeout: float = 5.0) -> None:
    """``Server.shutdown`` minus its fixed 0.1 s sleep: close listeners, ask connections to
    close after their current response, poll until they are gone, then force the rest."""
    for listener in server.servers:
        listener.close()
    for conn in list(server.server_state.connections):
        conn.shutdown()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # uvicorn exposes no "connection closed" event to wait on, so poll briefly.
    while server.server_state.connections and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    for task in list(server.server_state.tasks):
        task.cancel()
    for listener in server.servers:
        await listener.wait_closed()


@asynccontextmanager
async def running_sims(
    count_or_configs: int | list[SimConfig], *, host: str = "127.0.0.1"
) -> AsyncIterator[list[SimURL]]:
    """Several independent replicas: ``running_sims(3)`` or ``running_sims([cfg_a, cfg_b])``."""
    configs = (
        [SimConfig()] * count_or_configs if isinstance(count_or_configs, int) else count_or_configs
    )
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_sim(c, host=host)) for c in configs]
