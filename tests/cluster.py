"""Test harness: N sim replicas + one gateway, each on a real 127.0.0.1 socket, in-process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.state import SimState

from gateway.api import FastPath
from gateway.app import create_app
from gateway.config import load_settings
from gateway.core import Gateway


@dataclass
class SimReplica:
    """One sim replica that a test can stop (port refuses connections) and restart."""

    app: FastPath
    url: str = ""
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def start(self) -> None:
        self._stack = contextlib.AsyncExitStack()
        self.url = await self._stack.enter_async_context(
            serve_asgi(self.app, port=self.port if self.url else 0)
        )

    async def stop(self) -> None:
        await self._stack.aclose()


@dataclass
class Cluster:
    url: str
    replicas: list[SimReplica]
    app: FastPath

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def gateway(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    def sim(self, index: int) -> SimState:
        state: SimState = self.replicas[index].app.state.sim
        return state


@contextlib.asynccontextmanager
async def sims(
    n: int, config: SimConfig | Sequence[SimConfig] | None = None
) -> AsyncIterator[list[SimReplica]]:
    """``n`` sim replicas; ``config`` is one config for all, or one per replica."""
    configs = list(config) if isinstance(config, Sequence) else [config or SimConfig()] * n
    replicas = [SimReplica(create_sim_app(configs[i])) for i in range(n)]
    try:
        for replica in replicas:
            await replica.start()
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()


@contextlib.asynccontextmanager
async def cluster(
    n: int = 2, sim_config: SimConfig | Sequence[SimConfig] | None = None, *,
    idle_s: int | None = None, **settings: Any,
) -> AsyncIterator[Cluster]:  # fmt: skip
    """``n`` sim replicas behind one gateway. ``settings`` override gateway settings;
    ``idle_s``: the gateway's keep-alive idle timeout (``serve_asgi``)."""
    async with sims(n, sim_config) as replicas:
        urls = [r.url for r in replicas]
        overrides: dict[str, Any] = {"replicas": urls, "health_interval_s": 0.2, **settings}
        app = create_app(load_settings(overrides, environ={}))
        async with serve_asgi(app, idle_s=idle_s) as url:
            yield Cluster(url, replicas, app)
