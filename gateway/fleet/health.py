"""Health rounds and membership: the owner's loops that admit and eject replicas.

A round probes every replica's ``/health``; the pool decides (``gateway.fleet.replicas``)
and this part acts: an ejected replica leaves rotation (``Rotation.out_of_rotation``), a
READY one is put in the fleet's pause state and swept before it is admitted
(``FleetControl.rejoin``, ``RunMode.sweep``), and each run's adapter manager then
reconciles it before it gets adapter traffic. Discovery changes the members the same way:
added replicas join DOWN and wait for a probe.

A data-plane worker has no health part: it follows the owner's snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway.config import ReplicaSpec, Settings
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.fleet.control import FleetControl
from gateway.fleet.discovery import diff_membership
from gateway.fleet.fanout import FanOut
from gateway.fleet.replicas import Transition
from gateway.fleet.rotation import Rotation
from gateway.http.upstream import ReplicaConnectError
from gateway.logs import Repeats
from gateway.metrics import Metrics, ProbeResult
from gateway.routing.policy import Router
from gateway.runs.mode import RunMode

__all__ = ["Health"]

log = logging.getLogger("gateway")


class Health:
    def __init__(
        self,
        settings: Settings,
        rotation: Rotation,
        fleet: FanOut,
        control: FleetControl,
        mode: RunMode,
        router: Router,
        metrics: Metrics,
    ) -> None:
        self._settings = settings
        self._rotation = rotation
        self._pool = rotation.pool
        self._fleet = fleet
        self._control = control
        self._mode = mode
        self._router = router
        self._metrics = metrics
        self._rejoining: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._down = Repeats(every_s=60.0)  # a down replica's failed probes: which to log
        self._why: dict[int, str] = {}  # a probe's connection failure, by kind

    async def probe(self, index: int) -> bool:
        result = await self._probe(index)
        self._metrics.health_probes.labels(str(index), result.value).inc()
        self._log_probe(index, result)
        return result is ProbeResult.OK

    def why(self, index: int) -> str | None:
        """What the replica's failing probes said last (a ``kind``), while they fail."""
        streak = self._down.peek(index)
        return streak.detail if streak is not None else None

    def _log_probe(self, index: int, result: ProbeResult) -> None:
        """A replica out of rotation that keeps failing its probes says why (``Repeats``:
        the first failure after the ejection, each change of kind, then every minute), at
        INFO: the ejection (or the start's "down at start") was the warning; and how long
        it was down once it passes again."""
        why = self._why.pop(index, result.value)
        replica = self._pool[index]
        fields = {"replica": index, "replica_url": replica.display}
        if result is ProbeResult.OK:
            streak = self._down.ended(index)
            if streak is not None and streak.count > 1:
                down_s = self._rotation.clock() - streak.since
                log.info("replica %d (%s) passed a probe after %d failed ones over %.0f s",
                         index, replica.display, streak.count, down_s,
                         extra={"event": "probe_passed", **fields})  # fmt: skip
            return
        streak = self._down.seen(index, why, self._rotation.clock())
        if streak is not None and not replica.up:  # while up: the ejection line says it
            log.info("replica %d (%s) fails its health checks: %s (%d failed in a row, "
                        "for %.0f s)", index, replica.display, why, streak.count,
                        self._rotation.clock() - streak.since,
                        extra={"event": "probe_failed", "kind": why, **fields})  # fmt: skip

    async def _probe(self, index: int) -> ProbeResult:
        try:
            result = await self._fleet.upstream.call(
                index, "GET", "/health", timeout=self._settings.health_timeout_s
            )
        except ReplicaConnectError as exc:
            self._why[index] = exc.kind  # dns, refused, tls, ... (``gateway.http.failures``)
            if exc.conclusive:  # refused, DNS, TLS: as conclusive as on a request
                self._rotation.unreachable(index, exc.kind)  # a probe: not an upstream error
            if exc.kind == "connect_timeout":
                return ProbeResult.TIMEOUT
            return ProbeResult.UNREACHABLE
        except UpstreamTimeout:
            return ProbeResult.TIMEOUT
        except GatewayError:
            return ProbeResult.UNHEALTHY
        return ProbeResult.OK if result.status == 200 else ProbeResult.UNHEALTHY

    async def round(self, *, sync_adapters: bool = True, only: Sequence[int] | None = None) -> None:
        """Probe every replica, apply ejections/admissions, then let the adapter manager
        reconcile newly healthy replicas (they get adapter traffic only once it has)."""
        pool = self._pool
        indices = pool.indices() if only is None else list(only)
        outcomes = await asyncio.gather(*(self.probe(i) for i in indices))
        rejoins = []
        for index, ok in zip(indices, outcomes, strict=True):
            change = pool.record_probe(index, ok)
            if change is Transition.EJECTED:
                self._metrics.ejections.labels(str(index), "probe").inc()
                self._rotation.out_of_rotation(index)
                streak = self._down.peek(index)
                why = streak.detail if streak is not None else "unhealthy"
                log.warning("replica %d (%s) failed health checks (%s); ejected",
                            index, pool[index].display, why,
                            extra={"event": "replica_ejected", "kind": why, "replica": index,
                                   "replica_url": pool[index].display})  # fmt: skip
            elif change is Transition.READY:
                rejoins.append(self._rejoin(index))
        if rejoins:
            # Bounded: a control call in progress holds the fleet lock, and this round must
            # not stall ejections behind it. The rejoin goes on in its task.
            await asyncio.wait(rejoins, timeout=self._settings.health_timeout_s)
        # runs whose homes all left rotation move now, so this round's sync loads them
        self._mode.rehome(self._fleet)
        if sync_adapters:
            await self.sync_adapters()

    async def sync_adapters(self) -> None:
        """Every run's adapter manager reconciles its healthy home replicas."""
        healthy = self._pool.healthy_indices()
        tenancy = self._fleet.tenancy
        await asyncio.gather(*(t.manager.sync_replicas(t.among(healthy)) for t in tenancy))

    def _rejoin(self, index: int) -> asyncio.Task[None]:
        """Admit a READY replica once it is in the fleet's pause state (one task each)."""
        task = self._rejoining.get(index)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._admit(index))
            self._rejoining[index] = task
            task.add_done_callback(lambda _: self._rejoining.pop(index, None))
        return task

    async def _admit(self, index: int) -> None:
        if not await self._control.rejoin(index):
            return
        await self._mode.sweep(self._fleet, index)
        self._pool.admit(index)
        log.info("replica %d (%s) is healthy; admitted", index, self._pool[index].display,
                 extra={"event": "replica_admitted", "replica": index,
                        "replica_url": self._pool[index].display})  # fmt: skip

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval_s)
            try:
                await self.round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("health round failed")

    # --- membership (discovery) -----------------------------------------------------

    async def apply_membership(self, desired: Sequence[ReplicaSpec]) -> None:
        """Discovery's callback: change the members, then probe the new ones at once."""
        added = self.change_members(desired)
        if added:
            await self.round(only=added)

    def change_members(self, desired: Sequence[ReplicaSpec]) -> list[int]:
        """Make the pool's members ``desired``; returns the indices added.

        Removed replicas leave the pool, the ring and the adapter registry (requests in
        flight to them finish). Added ones join DOWN: they get traffic once a probe admits
        them, and adapter traffic only after the adapter manager reconciled them.
        """
        pool, mode = self._pool, self._mode
        change = diff_membership(pool.membership(), desired)
        for index in change.removed:
            log.info("replica %d (%s) removed by discovery", index, pool[index].display)
            pool.remove(index)
            mode.member_removed(index)
            self._rotation.removed(index)
        added = []
        for spec in change.added:
            token = spec.token or self._settings.upstream_token
            index = pool.add(spec, token.get_secret_value() if token else None)
            mode.member_added(index)
            added.append(index)
            log.info("replica %d (%s) added by discovery", index, pool[index].display)
        if change:
            self._router.set_members(pool.indices())
            for r in mode.members_changed(pool.indices()):
                self._spawn(mode.sweep(self._fleet, r))
        return added

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
