"""The FastAPI app factory and its lifespan: client, pool, router, health loop.

``Gateway`` is the one object the handlers see (``request.app.state.gateway``): it owns
the pool, the upstream client, the router, the metrics and the adapter registry, plus
the few I/O helpers that several handlers share (fan-out, health probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from gateway import __version__
from gateway.adapter_proxy import BroadcastAdapters
from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamUnavailable, error_body
from gateway.metrics import Metrics
from gateway.replicas import ReplicaPool, Transition
from gateway.routes import build_routes, error_response
from gateway.routing.policy import LeastLoadedRouter, Router
from gateway.upstream import BufferedResponse, ReplicaConnectError, Upstream, make_client

__all__ = ["Gateway", "create_app"]

log = logging.getLogger("gateway")


@dataclass
class Gateway:
    settings: Settings
    pool: ReplicaPool
    upstream: Upstream
    router: Router
    metrics: Metrics
    adapters: BroadcastAdapters = field(init=False)
    client_keys: tuple[bytes, ...] = ()
    admin_keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        self.adapters = BroadcastAdapters(self)
        s = self.settings
        admin = s.admin_key.get_secret_value().encode() if s.admin_key else None
        client = s.api_key.get_secret_value().encode() if s.api_key else None
        self.admin_keys = (admin,) if admin else ()
        # The admin key also opens client routes; the client key never opens admin ones.
        self.client_keys = tuple(k for k in (client, admin) if k) if client else ()

    @property
    def min_healthy(self) -> int:
        return len(self.pool)

    # --- replica selection ---------------------------------------------------------

    def healthy_or_503(self) -> list[int]:
        healthy = self.pool.healthy_indices()
        if not healthy:
            raise UpstreamUnavailable("No healthy replica.", headers={"Retry-After": "2"})
        return healthy

    def candidates_for(self, model: str | None) -> list[int]:
        healthy = self.healthy_or_503()
        allowed = self.adapters.candidates(model)
        return healthy if allowed is None else [i for i in healthy if i in allowed]

    def on_connect_failure(self, index: int, kind: str) -> None:
        self.metrics.upstream_errors.labels(str(index), kind).inc()
        if self.pool.record_connect_failure(index) is Transition.EJECTED:
            self.metrics.ejections.labels(str(index), "passive").inc()
            log.warning("replica %d (%s) ejected: %s", index, self.pool[index].display, kind)

    # --- fan-out ---------------------------------------------------------------------

    async def fan_out(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        headers: list[tuple[str, str]] | None = None,
        replicas: Sequence[int] | None = None,
    ) -> list[BufferedResponse]:
        """The same call on several replicas (default: every healthy one), concurrently.
        An unreachable replica yields a status-0 result instead of an exception."""
        targets = list(replicas) if replicas is not None else self.healthy_or_503()
        timeout = self.settings.broadcast_timeout_s

        async def one(index: int) -> BufferedResponse:
            try:
                return await self.upstream.call(
                    index, method, path, body=body, query=query, headers=headers, timeout=timeout
                )
            except ReplicaConnectError as exc:
                self.on_connect_failure(index, exc.kind)
                return BufferedResponse(0, [], b"unreachable", index)
            except GatewayError as exc:
                return BufferedResponse(0, [], exc.message.encode(), index)

        return list(await asyncio.gather(*(one(i) for i in targets)))

    # --- health --------------------------------------------------------------------

    async def probe(self, index: int) -> bool:
        try:
            result = await self.upstream.call(
                index, "GET", "/health", timeout=self.settings.health_timeout_s
            )
        except GatewayError:
            return False
        return result.status == 200

    async def health_round(self) -> None:
        indices = range(len(self.pool))
        outcomes = await asyncio.gather(*(self.probe(i) for i in indices))
        for index, ok in zip(indices, outcomes, strict=True):
            change = self.pool.record_probe(index, ok)
            if change is Transition.EJECTED:
                self.metrics.ejections.labels(str(index), "probe").inc()
                log.warning("replica %d (%s) failed health checks; ejected",
                            index, self.pool[index].display)  # fmt: skip
            elif change is Transition.READY:
                self.pool.admit(index)
                log.info("replica %d (%s) is healthy; admitted", index, self.pool[index].display)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.health_round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("health round failed")

    # --- introspection ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "router": self.router.name,
            "replicas": [
                {
                    "index": r.index,
                    "address": r.display,
                    "healthy": r.up,
                    "in_flight": r.in_flight,
                    "served": r.served,
                    "ejections": r.ejections,
                }
                for r in self.pool.replicas
            ],
            "routing": {
                s.labels["reason"]: s.value
                for metric in self.metrics.routing_decisions.collect()
                for s in metric.samples
                if s.name.endswith("_total")
            },
        }


def build_gateway(settings: Settings, client: httpx.AsyncClient | None = None) -> Gateway:
    pool = ReplicaPool.from_settings(settings)
    return Gateway(
        settings=settings,
        pool=pool,
        upstream=Upstream(client or make_client(settings), pool),
        router=LeastLoadedRouter(),
        metrics=Metrics(pool),
    )


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(error_body("Internal gateway error.", 500), status_code=500,
                    media_type="application/json")  # fmt: skip


def create_app(settings: Settings, *, client: httpx.AsyncClient | None = None) -> FastAPI:
    """Build the ASGI app. ``client`` lets tests inject a transport."""
    gateway = build_gateway(settings, client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.health_round()
        task = asyncio.create_task(gateway.health_loop(), name="gateway-health")
        log.info("gateway up: %d replicas, %d healthy", len(gateway.pool),
                 len(gateway.pool.healthy_indices()))  # fmt: skip
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=5)
            await gateway.upstream.aclose()

    app = FastAPI(
        title="rollout-gateway",
        version=__version__,
        routes=build_routes(),
        lifespan=lifespan,
        exception_handlers={GatewayError: _gateway_error, Exception: _unexpected_error},
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    return app
