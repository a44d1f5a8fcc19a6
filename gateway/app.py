"""The ASGI app factory and its lifespan: session, pool, router, adapters, health loop.

``Gateway`` is the one object the handlers see (``request.app.state.gateway``): it owns
the pool, the upstream session, the router, the adapter manager and the metrics, plus the
few I/O helpers several handlers share (fan-out, health rounds).

The app is a plain Starlette app: FastAPI's extra middleware layers (telemetry, body
limit, exit stacks) cost measurable CPU per proxied request and the gateway uses none of
its validation (it forwards bodies byte for byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from gateway import __version__
from gateway.adapters.manager import AdapterManager
from gateway.adapters.naming import NamePattern
from gateway.adapters.state import AdapterPolicy
from gateway.api import FastPath, build_routes, error_response
from gateway.config import ReplicaSpec, Settings
from gateway.errors import GatewayError, NotFound, UpstreamTimeout, UpstreamUnavailable, error_body
from gateway.fleet.aborts import ReplicaTasks
from gateway.fleet.admission import Admission
from gateway.fleet.control import FleetControl
from gateway.fleet.discovery import Discovery, diff_membership
from gateway.fleet.outliers import BreakerState, OutlierDetector, OutlierEvent
from gateway.fleet.replicas import ReplicaPool, Transition
from gateway.fleet.retry_budget import RetryBudget
from gateway.http.disconnect import ClientDisconnected
from gateway.http.upstream import (
    BufferedResponse,
    ReplicaConnectError,
    Upstream,
    make_session,
    upstream_tls,
)
from gateway.metrics import Metrics
from gateway.routing.config import RoutingConfig
from gateway.routing.policy import Router, make_router

__all__ = ["Gateway", "build_gateway", "create_app"]

log = logging.getLogger("gateway")


@dataclass
class Gateway:
    settings: Settings
    pool: ReplicaPool
    upstream: Upstream
    router: Router
    metrics: Metrics
    adapters: AdapterManager
    client_keys: tuple[bytes, ...] = field(default=(), init=False)
    admin_keys: tuple[bytes, ...] = field(default=(), init=False)
    outliers: OutlierDetector = field(init=False)
    retry_budget: RetryBudget = field(init=False)
    admission: Admission = field(init=False)
    tasks: ReplicaTasks = field(default_factory=ReplicaTasks, init=False)
    control: FleetControl = field(init=False)
    _rejoining: dict[int, asyncio.Task[None]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.control = FleetControl(self.fan_out, lambda: self.control_quorum)
        self.adapters.on_lost = self.lose
        self.adapters.quorum = lambda: self.control_quorum
        self.outliers = OutlierDetector(
            consecutive_errors=s.outlier_consecutive_errors,
            base_ejection_s=s.outlier_ejection_s,
            max_ejection_s=s.outlier_max_ejection_s,
            max_ejected_fraction=s.outlier_max_ejected_fraction,
        )
        self.retry_budget = RetryBudget(
            ratio=s.retry_budget_ratio, min_per_s=s.retry_budget_min_per_s
        )
        self.admission = Admission(s.max_in_flight, s.max_in_flight_per_client)
        self.metrics.watch_breakers(self.outliers)
        admin = s.admin_key.get_secret_value().encode() if s.admin_key else None
        client = s.api_key.get_secret_value().encode() if s.api_key else None
        self.admin_keys = (admin,) if admin else ()
        # The admin key also opens client routes; the client key never opens admin ones.
        self.client_keys = tuple(k for k in (client, admin) if k) if client else ()

    @property
    def min_healthy(self) -> int:
        """Replicas that must be up for ``/health`` to answer 200."""
        wanted = self.settings.health_min_replicas
        return len(self.pool) if wanted is None else min(wanted, len(self.pool))

    @property
    def control_quorum(self) -> int:
        """Replicas that must apply a control call (``gateway.fleet.quorum``): the degraded
        mode's ``health_min_replicas`` when set, else one -- a lost replica is left out."""
        wanted = self.settings.health_min_replicas or 1
        return max(1, min(wanted, len(self.pool)))

    # --- replica selection ---------------------------------------------------------

    def healthy_or_503(self) -> list[int]:
        healthy = self.pool.healthy_indices()
        if not healthy:
            raise UpstreamUnavailable("No healthy replica.", headers={"Retry-After": "2"})
        return healthy

    def routable_or_503(self) -> list[int]:
        """Healthy replicas whose outlier breaker lets a routed request through."""
        routable = self.outliers.routable(self.healthy_or_503(), time.monotonic())
        if not routable:
            raise UpstreamUnavailable(
                "Every healthy replica is ejected for errors.", headers={"Retry-After": "1"}
            )
        return routable

    def record_status(self, index: int, status: int) -> None:
        """Feed one routed answer to outlier detection."""
        event = self.outliers.record(index, status, time.monotonic(), len(self.pool))
        if event is OutlierEvent.EJECTED:
            self.metrics.ejections.labels(str(index), "outlier").inc()
            until = self.outliers.breaker(index).reopen_at - time.monotonic()
            log.warning("replica %d (%s) ejected for %.1f s: HTTP %d errors in a row",
                        index, self.pool[index].display, until, status)  # fmt: skip
        elif event is OutlierEvent.RESTORED:
            log.info("replica %d (%s) answered its trial request; breaker closed",
                     index, self.pool[index].display)  # fmt: skip

    def on_connect_failure(self, index: int, kind: str) -> None:
        self.metrics.upstream_errors.labels(str(index), kind).inc()
        if self.pool.record_connect_failure(index) is Transition.EJECTED:
            self.metrics.ejections.labels(str(index), "passive").inc()
            log.warning("replica %d (%s) ejected: %s", index, self.pool[index].display, kind)
            self._ejected(index)

    def lose(self, index: int, kind: str) -> None:
        """A control call got no answer from ``index`` (``gateway.fleet.quorum``'s "lost"):
        eject it at once; it is reconciled before it serves again."""
        if index in self.pool.indices() and self.pool[index].up:
            self.on_connect_failure(index, kind)
        self.adapters.replica_down(index)

    def _ejected(self, index: int) -> None:
        """The replica is out: forget its cache, abort what still waits on it."""
        self.forget_cache(index)
        self.outliers.forget(index)
        aborted = self.tasks.abort(index)
        if aborted:
            log.warning("replica %d: aborted %d requests in flight (retried elsewhere when "
                        "no byte had arrived)", index, aborted)  # fmt: skip

    def forget_cache(self, index: int) -> None:
        """The replica's prefix cache is gone (restart, reset): stop steering by it."""
        self.router.forget_replica(index)

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
        A replica that gives no HTTP answer is lost (``lose``) and yields a status-0
        result instead of raising."""
        targets = list(replicas) if replicas is not None else self.healthy_or_503()
        timeout = self.settings.broadcast_timeout_s

        async def one(index: int) -> BufferedResponse:
            try:
                return await self.call_abortable(
                    index, method, path, body=body, query=query, headers=headers, timeout=timeout
                )
            except ReplicaConnectError as exc:
                kind = exc.kind
            except UpstreamTimeout:
                kind = "timeout"
            except GatewayError:
                kind = "reset"
            self.lose(index, kind)
            return BufferedResponse(0, [], f"unreachable ({kind})".encode(), index)

        return list(await asyncio.gather(*(one(i) for i in targets)))

    async def call_abortable(
        self, index: int, method: str, path: str, **kwargs: Any
    ) -> BufferedResponse:
        """``upstream.call`` that ends with ``ReplicaConnectError(kind="ejected")`` as soon
        as the health checker ejects the replica: a hung replica must not hold a control
        call for the whole ``broadcast_timeout_s``."""
        task = asyncio.ensure_future(self.upstream.call(index, method, path, **kwargs))
        self.tasks.enter(index, task)
        try:
            return await task
        except asyncio.CancelledError:
            if self.tasks.take(task):
                raise ReplicaConnectError(index, "ejected") from None
            task.cancel()
            raise
        finally:
            self.tasks.leave(index, task)

    # --- health --------------------------------------------------------------------

    async def probe(self, index: int) -> bool:
        try:
            result = await self.upstream.call(
                index, "GET", "/health", timeout=self.settings.health_timeout_s
            )
        except ReplicaConnectError as exc:
            if exc.kind == "connect":  # refused: as conclusive as on a request
                self.on_connect_failure(index, exc.kind)
            return False
        except GatewayError:
            return False
        return result.status == 200

    async def health_round(
        self, *, sync_adapters: bool = True, only: Sequence[int] | None = None
    ) -> None:
        """Probe every replica, apply ejections/admissions, then let the adapter manager
        reconcile newly healthy replicas (they get adapter traffic only once it has)."""
        indices = self.pool.indices() if only is None else list(only)
        outcomes = await asyncio.gather(*(self.probe(i) for i in indices))
        rejoins = []
        for index, ok in zip(indices, outcomes, strict=True):
            change = self.pool.record_probe(index, ok)
            if change is Transition.EJECTED:
                self.metrics.ejections.labels(str(index), "probe").inc()
                self._ejected(index)
                log.warning("replica %d (%s) failed health checks; ejected",
                            index, self.pool[index].display)  # fmt: skip
            elif change is Transition.READY:
                rejoins.append(self._rejoin(index))
        if rejoins:
            # Bounded: a control call in progress holds the fleet lock, and this round must
            # not stall ejections behind it. The rejoin goes on in its task.
            await asyncio.wait(rejoins, timeout=self.settings.health_timeout_s)
        if sync_adapters:
            await self.adapters.sync_replicas(self.pool.healthy_indices())

    def _rejoin(self, index: int) -> asyncio.Task[None]:
        """Admit a READY replica once it is in the fleet's pause state (one task each)."""
        task = self._rejoining.get(index)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._admit(index))
            self._rejoining[index] = task
            task.add_done_callback(lambda _: self._rejoining.pop(index, None))
        return task

    async def _admit(self, index: int) -> None:
        if not await self.control.rejoin(index):
            return
        self.pool.admit(index)
        log.info("replica %d (%s) is healthy; admitted", index, self.pool[index].display)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.health_round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("health round failed")

    # --- membership (discovery) -----------------------------------------------------

    async def apply_membership(self, desired: Sequence[ReplicaSpec]) -> None:
        """Discovery's callback: change the members, then probe the new ones at once."""
        added = self.change_members(desired)
        if added:
            await self.health_round(only=added)

    def change_members(self, desired: Sequence[ReplicaSpec]) -> list[int]:
        """Make the pool's members ``desired``; returns the indices added.

        Removed replicas leave the pool, the ring and the adapter registry (requests in
        flight to them finish). Added ones join DOWN: they get traffic once a probe admits
        them, and adapter traffic only after the adapter manager reconciled them.
        """
        change = diff_membership(self.pool.membership(), desired)
        for index in change.removed:
            log.info("replica %d (%s) removed by discovery", index, self.pool[index].display)
            self.pool.remove(index)
            self.adapters.remove_replica(index)
            self.forget_cache(index)
            self.outliers.forget(index)
        added = []
        for spec in change.added:
            token = spec.token or self.settings.upstream_token
            index = self.pool.add(spec, token.get_secret_value() if token else None)
            self.adapters.add_replica(index)
            added.append(index)
            log.info("replica %d (%s) added by discovery", index, self.pool[index].display)
        if change:
            self.router.set_members(self.pool.indices())
        return added

    # --- introspection ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        breakers = self.outliers.states()
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
                    "breaker": breakers.get(r.index, BreakerState.CLOSED).name.lower(),
                }
                for r in self.pool.replicas
            ],
            "in_flight": self.admission.in_flight,
            "paused": self.control.paused is not None,
            "routing": self.metrics.routing_counts(),
            "adapters": self.adapters.status(),
        }


def adapter_policy(settings: Settings) -> AdapterPolicy:
    return AdapterPolicy(
        max_staleness=settings.max_staleness,
        load_deadline_s=settings.adapter_load_deadline_s,
        retry_initial_s=settings.adapter_retry_initial_s,
        retry_max_s=settings.adapter_retry_max_s,
        unload_grace_s=settings.adapter_unload_grace_s,
        name_pattern=NamePattern(settings.adapter_name_pattern),
    )


def build_gateway(settings: Settings) -> Gateway:
    """Everything but the event-loop-bound session, which the lifespan creates."""
    pool = ReplicaPool.from_settings(settings)
    metrics = Metrics(pool)
    upstream = Upstream(
        pool,
        lambda: make_session(settings),
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_connections=settings.max_connections,
        tls=upstream_tls(settings),
    )
    adapters = AdapterManager(
        upstream,
        pool.indices(),
        policy=adapter_policy(settings),
        call_timeout_s=settings.broadcast_timeout_s,
        adapter_roots=[Path(p) for p in settings.adapter_roots],
        on_settled=metrics.record_adapter_settlement,
        on_action=metrics.record_adapter_action,
    )
    metrics.watch_adapters(adapters)
    router = make_router(settings.router, RoutingConfig(**settings.routing))
    # The ring spans every configured replica; unhealthy ones are skipped at lookup, so a
    # flapping replica never reshuffles everyone else's keys.
    router.set_members(pool.indices())
    metrics.watch_router(router)
    return Gateway(
        settings=settings,
        pool=pool,
        upstream=upstream,
        router=router,
        metrics=metrics,
        adapters=adapters,
    )


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    if exc.limit is not None:
        gateway: Gateway = request.app.state.gateway
        gateway.metrics.rejected.labels(exc.limit).inc()
    return error_response(exc)


async def _not_found(request: Request, exc: Exception) -> Response:
    """Paths no route matches (e.g. an encoded newline): still an OpenAI-style 404."""
    return error_response(NotFound(f"No route for {request.method} {request.url.path!r}."))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody is listening; nothing is sent


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(error_body("Internal gateway error.", 500), status_code=500,
                    media_type="application/json")  # fmt: skip


def create_app(settings: Settings) -> FastPath:
    """Build the ASGI app; start-up probes replicas and rebuilds adapter state."""
    gateway = build_gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Adopt what the replicas already hold *before* any reconciliation, so a
        # restarted gateway never unloads adapters it simply did not know about yet.
        discovery = Discovery(settings, gateway.apply_membership)
        if discovery.dynamic:
            # Members first, so the rebuild below adopts what every replica holds.
            gateway.change_members(await discovery.desired())
        await gateway.health_round(sync_adapters=False)
        await gateway.adapters.rebuild()
        tasks = [
            asyncio.create_task(gateway.health_loop(), name="gateway-health"),
            asyncio.create_task(gateway.adapters.run_ticks(), name="gateway-adapter-ticks"),
        ]
        hup = False
        if discovery.dynamic:
            tasks.append(asyncio.create_task(discovery.run(), name="gateway-discovery"))
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, discovery.wake)
                hup = True
        healthy = gateway.pool.healthy_indices()
        for r in gateway.pool.replicas:
            if r.index not in healthy:
                log.warning("replica %d (%s) is down at start; it joins when a probe passes",
                            r.index, r.display)  # fmt: skip
        log.info(
            "gateway up on http://%s:%d: %d/%d replicas healthy, router %s, max_staleness %s",
            settings.host, settings.port, len(healthy), len(gateway.pool),
            gateway.router.name, settings.max_staleness,
        )  # fmt: skip
        try:
            yield
        finally:
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            await gateway.adapters.aclose()
            await gateway.upstream.aclose()

    app = Starlette(
        routes=build_routes(),
        lifespan=lifespan,
        exception_handlers={
            GatewayError: _gateway_error,
            404: _not_found,
            ClientDisconnected: _client_gone,
            Exception: _unexpected_error,
        },
    )
    app.state.gateway = gateway
    return FastPath(app)
