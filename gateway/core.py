"""``Gateway``: the one object the handlers see (``request.app.state.gateway``).

It owns the replica pool, the upstream session, the router, the adapter manager, the
fleet's control state and the metrics, plus the I/O helpers several handlers share
(fan-out, health rounds, membership changes). ``gateway.app`` builds it and runs its
loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway import __version__
from gateway.adapters.manager import AdapterManager
from gateway.config import ReplicaSpec, Settings
from gateway.errors import GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.fleet.aborts import ReplicaTasks
from gateway.fleet.admission import Admission
from gateway.fleet.control import FleetControl
from gateway.fleet.discovery import diff_membership
from gateway.fleet.outliers import BreakerState, OutlierDetector, OutlierEvent
from gateway.fleet.replicas import ReplicaPool, Transition
from gateway.fleet.retry_budget import RetryBudget
from gateway.fleet.shared import SharedOutlierDetector, SharedRetryBudget, SharedState
from gateway.http.upstream import BufferedResponse, ReplicaConnectError, Upstream
from gateway.metrics import Metrics
from gateway.routing.policy import Router
from gateway.runs.mode import RunMode
from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["Gateway"]

log = logging.getLogger("gateway")


class Peers(Protocol):
    """The other processes of one gateway (``gateway.workers.owner.Hub``): what the
    owner's ``/metrics`` and ``/gateway/status`` add of theirs."""

    async def ask(self, op: str, **args: Any) -> list[Any]: ...
    async def merged_metrics(self, own: bytes) -> bytes: ...
    async def add_status(self, own: dict[str, Any]) -> None: ...


@dataclass
class Gateway:
    settings: Settings
    pool: ReplicaPool
    upstream: Upstream
    router: Router
    metrics: Metrics
    tenancy: Tenancy
    mode: RunMode
    """Single-run or multi-run mode (``gateway.runs.mode``): what differs between them."""
    shared: SharedState | None = None
    """``serve --workers N``: the breakers and retry budget every process shares."""
    client_keys: tuple[bytes, ...] = field(default=(), init=False)
    admin_keys: tuple[bytes, ...] = field(default=(), init=False)
    outliers: OutlierDetector = field(init=False)
    retry_budget: RetryBudget = field(init=False)
    admission: Admission = field(init=False)
    tasks: ReplicaTasks = field(default_factory=ReplicaTasks, init=False)
    control: FleetControl = field(init=False)
    _rejoining: dict[int, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _background: set[asyncio.Task[Any]] = field(default_factory=set, init=False)
    clock: Callable[[], float] = field(default=time.monotonic, init=False)
    """``now`` for the pure cores that take it (breakers, retry budget): tests set it."""
    cache_resets: Counter[int] = field(default_factory=Counter, init=False)
    """Replica -> prefix caches forgotten (a worker's snapshot carries it)."""
    report: Callable[[dict[str, Any]], None] | None = field(default=None, init=False)
    """A data-plane worker: tells the owner what only it saw (an ejection)."""
    before_route: Callable[[], None] | None = field(default=None, init=False)
    """A data-plane worker: refreshes the router's fleet-wide loads before a decision."""
    peers: Peers | None = field(default=None, init=False)
    """The owner of data-plane workers: their metrics and status."""

    def __post_init__(self) -> None:
        s = self.settings
        self.control = FleetControl(self.fan_out, lambda: self.control_quorum)
        for manager in self.tenancy.managers():
            manager.on_lost = self.lose
            manager.quorum = lambda: self.control_quorum
        limits: dict[str, Any] = {
            "consecutive_errors": s.outlier_consecutive_errors,
            "base_ejection_s": s.outlier_ejection_s,
            "max_ejection_s": s.outlier_max_ejection_s,
            "max_ejected_fraction": s.outlier_max_ejected_fraction,
        }
        self.outliers = (
            OutlierDetector(**limits)
            if self.shared is None
            else SharedOutlierDetector(self.shared, **limits)
        )
        ratio, floor = s.retry_budget_ratio, s.retry_budget_min_per_s
        self.retry_budget = (
            RetryBudget(ratio=ratio, min_per_s=floor)
            if self.shared is None
            else SharedRetryBudget(self.shared, ratio=ratio, min_per_s=floor)
        )
        self.admission = Admission(s.max_in_flight, s.max_in_flight_per_client)
        self.metrics.watch_breakers(self.outliers)
        admin = s.admin_key.get_secret_value().encode() if s.admin_key else None
        client = s.api_key.get_secret_value().encode() if s.api_key else None
        self.admin_keys = (admin,) if admin else ()
        # The admin key also opens client routes; the client key never opens admin ones.
        self.client_keys = tuple(k for k in (client, admin) if k) if client else ()

    @property
    def adapters(self) -> AdapterManager:
        """Single-run mode's adapter manager (multi-run: ``tenancy``, one per run)."""
        return self.tenancy.single().manager

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
        routable = self.outliers.routable(self.healthy_or_503(), self.clock())
        if not routable:
            raise UpstreamUnavailable(
                "Every healthy replica is ejected for errors.", headers={"Retry-After": "1"}
            )
        return routable

    def record_status(self, index: int, status: int) -> None:
        """Feed one routed answer to outlier detection."""
        event = self.outliers.record(index, status, self.clock(), len(self.pool))
        if event is OutlierEvent.EJECTED:
            self.metrics.ejections.labels(str(index), "outlier").inc()
            reopen_at = self.outliers.breaker(index).reopen_at
            log.warning("replica %d (%s) ejected for %.1f s: HTTP %d errors in a row",
                        index, self.pool[index].display, reopen_at - self.clock(),
                        status)  # fmt: skip
        elif event is OutlierEvent.RESTORED:
            log.info("replica %d (%s) answered its trial request; breaker closed",
                     index, self.pool[index].display)  # fmt: skip

    def on_connect_failure(self, index: int, kind: str) -> None:
        self.metrics.upstream_errors.labels(str(index), kind).inc()
        if self.pool.record_connect_failure(index) is Transition.EJECTED:
            self.metrics.ejections.labels(str(index), "passive").inc()
            log.warning("replica %d (%s) ejected: %s", index, self.pool[index].display, kind)
            self.out_of_rotation(index)
            if self.report is not None:
                self.report({"op": "connect_failure", "replica": index, "kind": kind})

    def lose(self, index: int, kind: str) -> None:
        """A control call got no answer from ``index`` (``gateway.fleet.quorum``'s "lost"):
        eject it at once; it is reconciled before it serves again."""
        if index in self.pool.indices() and self.pool[index].up:
            self.on_connect_failure(index, kind)
        for tenant in self.tenancy:
            if tenant.serves(index):
                tenant.manager.replica_down(index)

    def out_of_rotation(self, index: int) -> None:
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
        self.cache_resets[index] += 1

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
                self.out_of_rotation(index)
                log.warning("replica %d (%s) failed health checks; ejected",
                            index, self.pool[index].display)  # fmt: skip
            elif change is Transition.READY:
                rejoins.append(self._rejoin(index))
        if rejoins:
            # Bounded: a control call in progress holds the fleet lock, and this round must
            # not stall ejections behind it. The rejoin goes on in its task.
            await asyncio.wait(rejoins, timeout=self.settings.health_timeout_s)
        if sync_adapters:
            await self.sync_adapters()

    async def sync_adapters(self) -> None:
        """Every run's adapter manager reconciles its healthy home replicas."""
        healthy = self.pool.healthy_indices()
        await asyncio.gather(*(t.manager.sync_replicas(t.among(healthy)) for t in self.tenancy))

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
        await self.mode.sweep(self, index)
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
            self.mode.member_removed(index)
            self.forget_cache(index)
            self.outliers.forget(index)
        added = []
        for spec in change.added:
            token = spec.token or self.settings.upstream_token
            index = self.pool.add(spec, token.get_secret_value() if token else None)
            self.mode.member_added(index)
            added.append(index)
            log.info("replica %d (%s) added by discovery", index, self.pool[index].display)
        if change:
            self.router.set_members(self.pool.indices())
            for r in self.mode.members_changed(self.pool.indices()):
                self._spawn(self.mode.sweep(self, r))
        return added

    # --- introspection ---------------------------------------------------------------

    def status(self, viewer: Tenant | None = None) -> dict[str, Any]:
        """``/gateway/status``; ``viewer``: a run's own view (multi-run mode: its entry
        and its adapters by its names, nothing of the other runs)."""
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
            **self.mode.adapter_status(viewer),
        }

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
