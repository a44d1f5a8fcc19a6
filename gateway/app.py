"""The ASGI app factory and its lifespan: session, pool, router, adapters, health loop.

The app is a plain Starlette app: FastAPI's extra middleware layers (telemetry, body
limit, exit stacks) cost measurable CPU per proxied request and the gateway uses none of
its validation (it forwards bodies byte for byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
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
from gateway.config import Settings
from gateway.core import Gateway
from gateway.errors import GatewayError, NotFound
from gateway.fleet.aborts import ReplicaTasks
from gateway.fleet.admission import Admission
from gateway.fleet.control import FleetControl
from gateway.fleet.discovery import Discovery
from gateway.fleet.fanout import FanOut
from gateway.fleet.health import Health
from gateway.fleet.ledger import Ledger
from gateway.fleet.metrics import BreakerCollector, ControlCollector, PoolCollector
from gateway.fleet.outliers import OutlierDetector
from gateway.fleet.preflight import check_replica, exposure_warning, replica_warning, source
from gateway.fleet.replicas import ReplicaPool
from gateway.fleet.retry_budget import RetryBudget
from gateway.fleet.rotation import Rotation
from gateway.fleet.selection import Selection
from gateway.fleet.shared import SharedOutlierDetector, SharedRetryBudget, SharedState
from gateway.http.server.disconnect import ClientDisconnected
from gateway.http.server.signals import on_hangup
from gateway.http.upstream import Upstream, make_session, upstream_tls
from gateway.metrics import Metrics
from gateway.roles import ALONE, LoadsFeed, Peers, Reporter
from gateway.routing.config import RoutingConfig
from gateway.routing.policy import make_router
from gateway.runs.credentials import Credentials
from gateway.runs.fairness import FairGate
from gateway.runs.fairshare import FairShare
from gateway.runs.lifecycle import run_table_of
from gateway.runs.mode import mode_for
from gateway.runs.table import Run, RunTable
from gateway.runs.tenancy import OWN_ROUTES, RoutesSource, Tenancy

__all__ = ["build_gateway", "create_app"]

log = logging.getLogger("gateway")


def adapter_policy(settings: Settings, max_staleness: int | None = None) -> AdapterPolicy:
    return AdapterPolicy(
        max_staleness=settings.max_staleness if max_staleness is None else max_staleness,
        load_deadline_s=settings.adapter_load_deadline_s,
        retry_initial_s=settings.adapter_retry_initial_s,
        retry_max_s=settings.adapter_retry_max_s,
        unload_grace_s=settings.adapter_unload_grace_s,
        name_pattern=NamePattern(settings.adapter_name_pattern),
    )


def build_gateway(
    settings: Settings,
    shared: SharedState | None = None,
    *,
    reporter: Reporter = ALONE,
    feed: LoadsFeed = ALONE,
    peers: Peers = ALONE,
    routes: RoutesSource = OWN_ROUTES,
) -> Gateway:
    """Everything but the event-loop-bound session, which the lifespan creates, built
    bottom up so that each part gets its collaborators when it is made.

    ``shared``: the fleet state the processes of ``serve --workers N`` share; the role
    parts (``gateway.roles``) are what a data-plane worker or the owner is given instead
    of a lone process's (``ALONE``): ``reporter`` and ``feed`` a worker's, ``peers`` the
    owner's, ``routes`` where rollouts read a run's adapters (a worker: the owner's
    snapshots)."""
    pool = ReplicaPool.from_settings(settings)
    metrics = Metrics(pool.indices)
    metrics.watch(PoolCollector(pool))
    upstream = Upstream(
        pool,
        lambda: make_session(settings),
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_connections=settings.max_connections,
        tls=upstream_tls(settings),
    )
    router = make_router(settings.router, RoutingConfig(**settings.routing))
    # The ring spans every configured replica; unhealthy ones are skipped at lookup, so a
    # flapping replica never reshuffles everyone else's keys.
    router.set_members(pool.indices())
    limits: dict[str, Any] = {
        "consecutive_errors": settings.outlier_consecutive_errors,
        "base_ejection_s": settings.outlier_ejection_s,
        "max_ejection_s": settings.outlier_max_ejection_s,
        "max_ejected_fraction": settings.outlier_max_ejected_fraction,
    }
    ratio, floor = settings.retry_budget_ratio, settings.retry_budget_min_per_s
    if shared is None:
        outliers = OutlierDetector(**limits)
        retry_budget = RetryBudget(ratio=ratio, min_per_s=floor)
    else:
        outliers = SharedOutlierDetector(shared, **limits)
        retry_budget = SharedRetryBudget(shared, ratio=ratio, min_per_s=floor)
    rotation = Rotation(
        pool, router, metrics, outliers, ReplicaTasks(), reporter, settings.health_min_replicas
    )

    def manager(run: Run, lost: Callable[[int, str], None]) -> AdapterManager:
        return AdapterManager(
            upstream,
            run.homes_at_start(pool.indices()),
            policy=adapter_policy(settings, run.max_staleness),
            call_timeout_s=settings.broadcast_timeout_s,
            adapter_roots=run.roots,
            owns=run.owns(),
            on_settled=metrics.record_adapter_settlement,
            on_action=metrics.record_adapter_action,
            lost=lost,
            quorum=rotation.quorum,
            peers=peers,
        )

    # Each process of ``serve --workers N`` keeps books over its 1/N of every replica.
    capacity = max(1, settings.replica_capacity // settings.worker_count())
    fair = FairGate(FairShare(capacity, settings.fair_idle_s), settings.fair_wait_s)
    tenancy = Tenancy(run_table(settings), manager, rotation, peers=peers, routes=routes, fair=fair)
    mode = mode_for(tenancy.table, tenancy, settings.broadcast_timeout_s)
    metrics.watch_adapters(tenancy.managers)
    for collector in mode.collectors():
        metrics.watch(collector)
    metrics.watch_router(router)
    metrics.watch(BreakerCollector(outliers, pool))
    fleet = FanOut(settings, upstream, rotation, tenancy)
    control = FleetControl(fleet.fan_out, rotation.quorum)
    metrics.watch(ControlCollector(control))
    selection = Selection(rotation, router, metrics, feed)
    credentials = Credentials(settings, tenancy)
    return Gateway(
        settings=settings,
        pool=pool,
        upstream=upstream,
        router=router,
        metrics=metrics,
        tenancy=tenancy,
        mode=mode,
        rotation=rotation,
        selection=selection,
        ledger=Ledger(
            credentials,
            Admission(settings.max_in_flight, settings.max_in_flight_per_client),
            retry_budget,
            rotation,
            selection,
            metrics,
        ),
        fleet=fleet,
        control=control,
        health=Health(settings, rotation, fleet, control, mode, router, metrics),
        credentials=credentials,
        peers=peers,
    )


def run_table(settings: Settings) -> RunTable:
    """The configured runs; none: single-run mode's one implicit run."""
    if not settings.runs:
        roots = tuple(Path(p) for p in settings.adapter_roots)
        return RunTable([Run("", None, settings.max_staleness, roots)])
    return run_table_of(settings.runs)


async def _first_minute(gateway: Gateway) -> list[int]:
    """Start-up warnings, each once: replicas down, replicas lacking what TRL needs (asked
    without side effects, ``fleet/preflight.py``), an open port with no key. Returns the
    healthy replicas."""
    settings = gateway.settings
    healthy = gateway.pool.healthy_indices()
    for r in gateway.pool.replicas:
        if r.index not in healthy:
            why = gateway.health.why(r.index) or "unhealthy"
            log.warning("replica %d (%s) is down at start (%s); it joins when a probe passes",
                        r.index, r.display, why, extra={"event": "replica_down_at_start",
                        "kind": why, "replica": r.index, "replica_url": r.display})  # fmt: skip
    up = [r for r in gateway.pool.replicas if r.index in healthy]
    found = await asyncio.gather(
        *(check_replica(gateway.upstream, r.index, settings.health_timeout_s) for r in up)
    )
    for r, caps in zip(up, found, strict=True):
        if warning := replica_warning(f"{r.index} ({r.display})", caps):
            log.warning("%s", warning)
    if warning := exposure_warning(settings):
        log.warning("%s", warning)
    return list(healthy)


def _auth(gateway: Gateway) -> str:
    """The start line's auth, read from the keys the checks enforce
    (``Credentials.summary``), so it cannot say "on" while requests pass without one."""
    credentials, settings = gateway.credentials, gateway.settings
    who = credentials.summary()
    admin = ", admin key" if credentials.admin_keys else ""
    if who["clients"] == "run keys":
        return f"on ({len(settings.runs)} run keys{admin})"
    if who["clients"] == "api key":
        return f"on (api key{admin})"
    why = "--no-auth" if settings.no_auth else "no key given"
    return f"off ({why}){', admin key on control calls' if admin else ''}"


def _windows(gateway: Gateway) -> str:
    """The start line's adapter window: single-run mode's ``max_staleness``; in multi-run
    mode each run's own settings, read from the runs the gateway serves (the top-level
    ``max_staleness`` is then used by no run: shown alone, it named a window no run had)."""
    runs = [t.run for t in gateway.tenancy]
    if len(runs) == 1 and not runs[0].name:
        return f"max_staleness {runs[0].max_staleness}"
    each = "; ".join(
        f"{r.name}: max_staleness {r.max_staleness}, weight {r.weight:g}"
        + (f", max_in_flight {r.max_in_flight}" if r.max_in_flight is not None else "")
        for r in runs
    )
    return f"{len(runs)} runs ({each})"


def _roots(gateway: Gateway) -> str:
    """Single-run mode: the roots; multi-run mode: each run's, by name."""
    runs = [t.run for t in gateway.tenancy]
    if not (len(runs) == 1 and not runs[0].name):
        return ", ".join(f"{r.name} {', '.join(map(str, r.roots))}" for r in runs)
    roots = list(map(str, gateway.settings.adapter_roots))
    return ", ".join(roots) if roots else "none (any lora_path)"


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
    return error_response(GatewayError("Internal gateway error."))  # with its request id


class Reloads:
    """What SIGHUP does in one gateway process (with ``serve --workers N``, in the owner:
    the supervisor passes the signal on): re-read what this gateway reads while it runs,
    then log one line saying what that was and what came of it, or that there is nothing
    to re-read in this mode. The replicas come from the replicas file or the DNS name
    (discovery), the run set from the config file (multi-run mode); every other setting
    applies at start only. The signal's default action, the end of the process (exit 129,
    no line), is never what an operator who sends it wants (``docs/operations.md``,
    "Signals"). Reloads run one at a time, in the order the signals came."""

    def __init__(self, settings: Settings, gateway: Gateway, discovery: Discovery) -> None:
        self.settings = settings
        self.gateway = gateway
        self.discovery = discovery
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued = False

    def hangup(self) -> None:
        """SIGHUP's loop callback (``on_hangup``): start a reload, unless one is queued that
        has not begun to read: that one reads what this signal asks for. (POSIX merges a
        signal sent while one is pending anyway; here a SIGHUP that the event loop reported
        twice in one instant, seen once in CI right after a SIGTERM, reloads once.)"""
        if self._queued:
            return
        self._queued = True
        task = asyncio.get_running_loop().create_task(self._logged(), name="gateway-sighup")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _logged(self) -> None:
        async with self._lock:
            self._queued = False  # a SIGHUP from now on may find what this one reads changed
            try:
                line, reloaded = await self.reload()
            except Exception:  # one bad reload must not end the gateway
                log.exception("SIGHUP: reload failed; the gateway serves on as before")
                return
        level = logging.INFO if reloaded else logging.WARNING
        log.log(level, "SIGHUP: %s", line, extra={"event": "sighup"})

    async def reload(self) -> tuple[str, bool]:
        """Re-read now; the line to log, and whether anything was re-read."""
        gateway, done = self.gateway, []
        if self.discovery.dynamic:
            await self.discovery.reread()
            pool = gateway.pool
            done.append(f"re-read {self._replica_sources()}: {len(pool)} replicas in the "
                        f"pool, {len(pool.healthy_indices())} healthy")  # fmt: skip
        if gateway.mode.reloads_runs:
            done.append(await self._runs())
        elif done:
            done.append("no run set to reload (single-run mode)")
        if not done:
            return ("nothing to reload in this mode (single-run mode has no run set; replicas "
                    "from --replica only, no --replicas-file or --discovery-dns; every other "
                    "setting, a --config file's included, applies at start only); "
                    "ignored"), False  # fmt: skip
        return "; ".join(done), True

    def _replica_sources(self) -> str:
        settings = self.settings
        found = [f"DNS name {settings.discovery_dns}"] if settings.discovery_dns else []
        if settings.replicas_file:
            found.append(f"replicas file {settings.replicas_file}")
        return " and ".join(found)

    async def _runs(self) -> str:
        gateway = self.gateway
        try:
            answer = await gateway.mode.reload(gateway.fleet, "SIGHUP")
        except GatewayError as exc:  # refused: logged, and counted, as such
            return f"run set: {exc.message}"
        changes = ", ".join(f"{k} {v}" for k, v in answer.items() if k != "outcome" and v)
        return (f"run set re-read from the config file: {answer['outcome']}"
                f"{f' ({changes})' if changes else ''}; {len(gateway.tenancy.tenants)} runs "
                "serving")  # fmt: skip

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def create_app(
    settings: Settings,
    attach: Callable[[], AbstractAsyncContextManager[None]] | None = None,
    shared: SharedState | None = None,
    peers: Peers = ALONE,
) -> FastPath:
    """Build the ASGI app; start-up probes replicas and rebuilds adapter state.
    ``attach``: entered once that is done, for as long as the app serves (the owner of
    data-plane workers starts its hub there); ``shared``, ``peers``: as
    ``build_gateway``'s."""
    gateway = build_gateway(settings, shared, peers=peers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Adopt what the replicas already hold *before* any reconciliation, so a
        # restarted gateway never unloads adapters it simply did not know about yet.
        health = gateway.health
        discovery = Discovery(settings, health.apply_membership)
        if discovery.dynamic:
            # Members first, so the rebuild below adopts what every replica holds.
            health.change_members(await discovery.desired())
        await health.round(sync_adapters=False)
        await gateway.mode.start(gateway.fleet)
        await asyncio.gather(*(m.rebuild() for m in gateway.tenancy.managers()))
        for tenant in gateway.tenancy:
            gateway.tenancy.start_chores(tenant, settings.adapter_audit_interval_s)
        tasks = [
            asyncio.create_task(health.loop(), name="gateway-health"),
            # multi-run mode: the run set is reloaded when the config file changes
            asyncio.create_task(gateway.mode.watch(gateway.fleet), name="gateway-runs-watch"),
        ]
        if discovery.dynamic:
            tasks.append(asyncio.create_task(discovery.run(), name="gateway-discovery"))

        # SIGHUP, in every mode: re-read what can be, or say there is nothing to.
        reloads = Reloads(settings, gateway, discovery)
        hangups = contextlib.ExitStack()  # closed first thing on the way out
        hangups.enter_context(on_hangup(reloads.hangup))
        healthy = await _first_minute(gateway)
        log.info(
            "gateway up on http://%s:%d: %d/%d replicas healthy, router %s, %s; "
            "version %s, auth %s, adapter roots %s, replicas from %s",
            settings.host, settings.port, len(healthy), len(gateway.pool),
            gateway.router.name, _windows(gateway), __version__, _auth(gateway),
            _roots(gateway), source(settings),
        )  # fmt: skip
        try:
            async with attach() if attach is not None else contextlib.nullcontext():
                yield
        finally:
            hangups.close()
            await reloads.aclose()
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            await gateway.mode.aclose()
            await gateway.tenancy.stop_chores()
            await asyncio.gather(*(m.aclose() for m in gateway.tenancy.managers()))
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
