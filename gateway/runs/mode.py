"""What differs between one implicit run and several named runs, as one object chosen at
construction (``mode_for``), so that no caller outside ``gateway/runs/`` asks which mode
it is in.

Single-run mode (``SingleRun``) is the identity: one run homed on every replica, the
fleet's pause, any client key (or the admin key, if set) for control calls, adapter
names as TRL sends them. Multi-run mode (``MultiRun``) places runs on home replicas,
sweeps replicas of what no run homed there owns, and shows a run only itself. What a
single request sees of its run (its homes, its names, its scoped pause) is the run's own
scope: ``gateway.runs.tenancy.Tenant``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol

from prometheus_client.registry import Collector

from gateway.adapters.placement import Change
from gateway.config import config_stamp, reread_runs
from gateway.errors import BadRequest, GatewayError
from gateway.runs.lifecycle import RunPlan, run_table_of
from gateway.runs.metrics import RunCollector
from gateway.runs.placing import RunFleet, place_runs, sweep, unload_run
from gateway.runs.table import RunTable
from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["MultiRun", "RunMode", "SingleRun", "WorkerRuns", "mode_for"]

log = logging.getLogger("gateway.runs")


class RunMode(Protocol):
    reloads_runs: bool
    """Whether its run set is reloaded live (SIGHUP, the config file, the admin POST)."""

    def viewer(self, admin: bool, client: Callable[[], object], run: Callable[[], Tenant]
               ) -> Tenant | None:  # fmt: skip
        """``/gateway/status``: who asks (``admin``: the admin key was presented); None
        is the whole gateway's view, a tenant its own."""
        ...

    def controller(self, admin_set: bool, check_admin: Callable[[], object],
                   run: Callable[[], Tenant]) -> Tenant:  # fmt: skip
        """Control calls: whose key they need, and the run they act on."""
        ...

    async def start(self, fleet: RunFleet) -> None:
        """At start, once replicas were probed, before adapters are rebuilt."""
        ...

    async def sweep(self, fleet: RunFleet, replica: int) -> None:
        """Before a replica is admitted (again), or after it lost runs: unload what no
        run homed there owns."""
        ...

    def collectors(self) -> list[Collector]:
        """Its own metrics, registered once."""
        ...

    def member_added(self, replica: int) -> None: ...
    def member_removed(self, replica: int) -> None: ...

    def members_changed(self, indices: Sequence[int]) -> list[int]:
        """Discovery changed the members; returns replicas to sweep."""
        ...

    def rehome(self, fleet: RunFleet) -> None:
        """After a health round changed who is in rotation: runs whose homes are all out
        are re-placed on replicas that are up (or left unplaced); their new homes are
        reconciled by the round's adapter sync, replicas that lost runs swept in the
        background."""
        ...

    def adapter_status(self, viewer: Tenant | None) -> dict[str, Any]:
        """The adapter part of ``/gateway/status``."""
        ...

    async def reload(self, fleet: RunFleet, why: str) -> dict[str, Any]:
        """Re-read the run set from the config file and apply it live (multi-run mode;
        docs/many-runs.md, "Runs join and leave live"); an error answer otherwise."""
        ...

    async def watch(self, fleet: RunFleet) -> None:
        """Reload when the config file changes, until cancelled (SIGHUP reloads through
        ``reload``: ``app.Reloads``)."""
        ...

    async def aclose(self) -> None:
        """Stop what reloads started (removals still draining)."""
        ...


class NeedsRestart(GatewayError):
    """A reload this gateway cannot apply live: 409, naming why."""

    status = 409
    err_type = "Conflict"


class Departures:
    """What a reload leaves behind in one process, in the owner and in every data-plane
    worker alike: rotated keys that expire after their overlap, and removed runs whose
    rollouts here finish, or are aborted after the run's ``remove_grace_s``."""

    def __init__(self, tenancy: Tenancy, drain_s: float) -> None:
        self.tenancy = tenancy
        self.drain_s = drain_s
        """How long aborted rollouts get to answer their 503 (``broadcast_timeout_s``)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._expiries: list[asyncio.TimerHandle] = []

    def follow(self, plan: RunPlan, old_keys: dict[str, bytes | None],
               then: Callable[[Tenant], Awaitable[None]]) -> None:  # fmt: skip
        """After ``plan`` was applied: schedule its rotated keys' expiry, and drain each
        removed run, then ``then`` (what else its leaving needs here)."""
        loop = asyncio.get_running_loop()
        tenancy = self.tenancy
        for name in plan.rotated:
            key, overlap = old_keys[name], tenancy.tenants[name].run.key_overlap_s
            if key is not None and overlap > 0:
                self._expiries.append(loop.call_later(overlap, tenancy.expire_key, name, key))
        for name in plan.removed:
            tenant = tenancy.leaving[name]
            task = loop.create_task(self._leave(tenant, then), name=f"gateway-run-remove-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _leave(self, tenant: Tenant, then: Callable[[Tenant], Awaitable[None]]) -> None:
        name, grace = tenant.name, tenant.run.remove_grace_s
        if not await tenant.drained(grace):
            aborted = tenant.abort_removed()
            log.warning("run %s removed: %d rollouts still in flight after %.0f s, aborted",
                        name, aborted, grace,
                        extra={"event": "run_removed", "run": name})  # fmt: skip
            await tenant.drained(self.drain_s)
        await then(tenant)

    async def aclose(self) -> None:
        for handle in self._expiries:
            handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class SingleRun:
    """One implicit run, homed everywhere: every method is the identity or the run's."""

    reloads_runs = False

    def __init__(self, tenancy: Tenancy) -> None:
        self.run = tenancy.single()

    def viewer(self, admin: bool, client: Callable[[], object], run: Callable[[], Tenant]
               ) -> Tenant | None:  # fmt: skip
        client()
        return None

    def controller(self, admin_set: bool, check_admin: Callable[[], object],
                   run: Callable[[], Tenant]) -> Tenant:  # fmt: skip
        if admin_set:
            check_admin()
            return self.run
        return run()

    async def start(self, fleet: RunFleet) -> None:
        return None

    async def sweep(self, fleet: RunFleet, replica: int) -> None:
        return None  # every adapter on every replica is the one run's

    def collectors(self) -> list[Collector]:
        return []

    def member_added(self, replica: int) -> None:
        self.run.manager.add_replica(replica)

    def member_removed(self, replica: int) -> None:
        self.run.manager.remove_replica(replica)

    def members_changed(self, indices: Sequence[int]) -> list[int]:
        return []

    def rehome(self, fleet: RunFleet) -> None:
        return None  # the one run is homed on every replica

    def adapter_status(self, viewer: Tenant | None) -> dict[str, Any]:
        return {"adapters": self.run.manager.status()}

    async def reload(self, fleet: RunFleet, why: str) -> dict[str, Any]:
        raise NeedsRestart("This gateway runs in single-run mode (no runs: configured): "
                           "switching to runs needs a restart.")  # fmt: skip

    async def watch(self, fleet: RunFleet) -> None:
        return None

    async def aclose(self) -> None:
        return None


class MultiRun:
    """Named runs, each on its home replicas (``Tenancy.place``), each seeing itself."""

    reloads_runs = True

    def __init__(self, tenancy: Tenancy, drain_s: float) -> None:
        self.tenancy = tenancy
        self._lock = asyncio.Lock()
        self._departures = Departures(tenancy, drain_s)
        self._rehoming: set[asyncio.Task[None]] = set()
        self._stamp: object = None
        """The config file's stamp when it was last read, by whichever reload read it (the
        watch, SIGHUP or the admin's POST): the watch reloads only a file it has not seen."""

    def viewer(self, admin: bool, client: Callable[[], object], run: Callable[[], Tenant]
               ) -> Tenant | None:  # fmt: skip
        return None if admin else run()

    def controller(self, admin_set: bool, check_admin: Callable[[], object],
                   run: Callable[[], Tenant]) -> Tenant:  # fmt: skip
        return run()  # each run controls only itself, with its own key

    async def start(self, fleet: RunFleet) -> None:
        await place_runs(fleet)

    async def sweep(self, fleet: RunFleet, replica: int) -> None:
        # Not placed yet (the start's first health round admits replicas before the
        # placement): no run is homed anywhere, so every adapter would look foreign and a
        # restarted gateway would unload the very adapters it is about to adopt. The
        # placement sweeps every replica itself once the homes are known.
        if self.tenancy.budget is None:
            return
        await sweep(fleet, replica)

    def collectors(self) -> list[Collector]:
        return [RunCollector(self.tenancy)]

    def member_added(self, replica: int) -> None:
        return None  # placement gives replicas to runs

    def member_removed(self, replica: int) -> None:
        return None

    def members_changed(self, indices: Sequence[int]) -> list[int]:
        tenancy = self.tenancy
        if tenancy.budget is None:  # not placed yet: the start's placement will
            return []
        moves = tenancy.place(indices, tenancy.budget)
        return sorted({r for change, _, r in moves if change is Change.LOSE} & set(indices))

    def rehome(self, fleet: RunFleet) -> None:
        pool = fleet.pool
        healthy = set(pool.healthy_indices())
        moves = self.tenancy.rehome([r for r in pool.indices() if r not in healthy])
        if not moves:
            return
        for change, run, replica in moves:
            log.warning("run %s %s home replica %d (replicas out of rotation: %s)", run,
                        "lost" if change is Change.LOSE else "gained", replica,
                        sorted(self.tenancy.down))  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._rehomed(fleet, moves))
        self._rehoming.add(task)
        task.add_done_callback(self._rehoming.discard)

    async def _rehomed(self, fleet: RunFleet, moves: Sequence[tuple[Change, str, int]]) -> None:
        """The moves of a re-placement after a health round, done as a reload's are: the
        replicas up that lost a run drained of its rollouts and swept, then the gained
        homes reconciled (the round's adapter sync may have done it already)."""
        async with self._lock:
            try:
                await self._moved(fleet, moves, set())
            except Exception:  # best effort: the next rejoin sweeps, the next round syncs
                log.exception("re-placing runs after a health round failed")

    def adapter_status(self, viewer: Tenant | None) -> dict[str, Any]:
        tenancy = self.tenancy
        if viewer is not None:
            return {
                "runs": tenancy.status(only=viewer.name),
                "lora_slots_per_replica": tenancy.budget,
                "adapters": viewer.own_status(),
            }
        return {
            "runs": tenancy.status(),
            "lora_slots_per_replica": tenancy.budget,
            "adapters": {t.name: t.manager.status() for t in tenancy},
        }

    # -- runs join and leave live

    async def reload(self, fleet: RunFleet, why: str) -> dict[str, Any]:
        settings = fleet.settings
        async with self._lock:
            self._stamp = config_stamp(settings)
            try:
                found = reread_runs(settings)
            except ValueError as exc:
                raise self._refuse(str(exc), why) from None
            tenancy = self.tenancy
            old_keys = {t.name: t.run.key for t in tenancy}
            plan, added, moves = tenancy.apply(
                run_table_of(found.runs), found.lora_slots_per_replica
            )
            if plan.refused is not None:
                raise self._refuse(plan.refused, why)
            for name in found.ignored:
                log.warning("runs reload (%s): %s changed in the config file; a reload applies "
                            "only runs and lora_slots_per_replica: restart to apply it",
                            why, name)  # fmt: skip
            for tenant in added:
                tenancy.start_chores(tenant, settings.adapter_audit_interval_s)
            await asyncio.gather(*(t.manager.rebuild() for t in added))
            await self._moved(fleet, moves, {t.name for t in added})
            self._departures.follow(plan, old_keys, partial(self._unload, fleet))
            outcome = "applied" if plan or moves else "unchanged"
            self._count(outcome)
            log.info("runs reload (%s): %s: added %s, removed %s, key rotated %s, "
                     "max_in_flight or weight changed %s, max_staleness changed %s", why,
                     outcome, list(plan.added), list(plan.removed), list(plan.rotated),
                     list(plan.limited), list(plan.windowed))  # fmt: skip
            unplaced = {t.name: t.unplaced for t in tenancy if t.unplaced is not None}
            return {"outcome": outcome, **plan.summary(), "unplaced": unplaced}

    async def _moved(self, fleet: RunFleet, moves: Sequence[tuple[Change, str, int]],
                     skip: set[str]) -> None:  # fmt: skip
        """After a re-placement: replicas where runs lost homes are swept first, then each
        home a kept run gained is reconciled (its live versions loaded) at once, so that
        it serves the run now rather than after the next health round."""
        healthy = set(fleet.pool.healthy_indices())
        # a replica out of rotation is swept when it rejoins (``Health``), not waited on now
        lost = {r for change, _, r in moves if change is Change.LOSE} & healthy
        await self._drained_off(fleet, moves)
        await asyncio.gather(*(sweep(fleet, r) for r in sorted(lost)))
        tenants = self.tenancy.tenants
        gained = [(tenants[run], r) for change, run, r in moves
                  if change is Change.GAIN and run in tenants and run not in skip
                  and r in healthy]  # fmt: skip
        await asyncio.gather(*(t.manager.reconcile(r) for t, r in gained))

    async def _drained_off(self, fleet: RunFleet, moves: Sequence[tuple[Change, str, int]]) -> None:
        """Before a lost home is swept: the rollouts the run already sent there (routed
        before the move, maybe still on their way) may finish, for up to
        ``adapter_unload_grace_s`` as a retired version's copy may; an unload under them
        would answer them 404."""
        tenants = self.tenancy.tenants
        lost = [(tenants[run].manager, r) for change, run, r in moves
                if change is Change.LOSE and run in tenants]  # fmt: skip
        deadline = time.monotonic() + fleet.settings.adapter_unload_grace_s
        # The counts live in each run's pure adapter core, which signals nothing: a bounded
        # poll (moves are rare: a reload that re-places runs).
        while any(m.in_flight_on(r) for m, r in lost) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for m, r in lost:
            if m.in_flight_on(r):
                log.warning("replica %d left a run's homes with %d of its rollouts still in "
                            "flight after adapter_unload_grace_s; sweeping it anyway",
                            r, m.in_flight_on(r))  # fmt: skip

    def _count(self, outcome: str) -> None:
        reloads = self.tenancy.reloads
        reloads[outcome] = reloads.get(outcome, 0) + 1

    def _refuse(self, problem: str, why: str) -> GatewayError:
        self._count("refused")
        log.error("runs reload (%s) refused, the old run set keeps serving: %s", why, problem)
        return BadRequest(f"Run set not reloaded, the old one keeps serving: {problem}")

    async def _unload(self, fleet: RunFleet, tenant: Tenant) -> None:
        """A removed run drained here (``Departures``): once the data-plane workers' own
        rollouts of it ended too (they abort theirs after its grace), its adapters are
        unloaded from its homes, then its slots are freed."""
        name = tenant.name
        await tenant.peers.run_drained(
            name, tenant.run.remove_grace_s + fleet.settings.broadcast_timeout_s
        )
        await self.tenancy.stop_chores([tenant])
        await tenant.manager.aclose()
        homes = sorted(tenant.homes)
        unloaded = await asyncio.gather(*(unload_run(fleet, r, name) for r in homes))
        moves = self.tenancy.gone(name)
        await self._moved(fleet, moves, {name})
        gained = sorted({(run, r) for change, run, r in moves if change is Change.GAIN})
        log.info("run %s removed: %d adapters unloaded from replicas %s; its slots went to %s",
                 name, sum(unloaded), homes, gained,
                 extra={"event": "run_removed", "run": name})  # fmt: skip

    async def watch(self, fleet: RunFleet) -> None:
        settings = fleet.settings
        if self._stamp is None:
            self._stamp = await asyncio.to_thread(config_stamp, settings)
        while True:
            await asyncio.sleep(settings.discovery_interval_s)
            now = await asyncio.to_thread(config_stamp, settings)
            if now == self._stamp:
                continue  # unchanged, or already read by a POST or SIGHUP reload
            self._stamp = now
            try:
                await self.reload(fleet, "config file changed")
            except GatewayError as exc:
                if exc.status != 400:  # a refused set was logged as such
                    log.error("runs reload: %s", exc.message)
            except Exception:  # the watch must outlive any one bad reload
                log.exception("runs reload failed")

    async def aclose(self) -> None:
        for task in list(self._rehoming):
            task.cancel()
        await asyncio.gather(*self._rehoming, return_exceptions=True)
        await self._departures.aclose()


class WorkerRuns:
    """A data-plane worker's run set (``serve --workers N``): the owner reloads the runs
    and sends each worker the new set (``gateway.workers``); the worker adopts it as the
    owner did, but for what only the owner does (placement, adapters): removed runs stop
    being identified at once and their rollouts here drain or are aborted after their
    grace, rotated keys keep working for their overlap, added runs are served at once
    (their homes and adapters come with the next snapshot, on the same stream)."""

    def __init__(self, tenancy: Tenancy, drain_s: float) -> None:
        self.tenancy = tenancy
        self._departures = Departures(tenancy, drain_s)

    def adopt(self, table: RunTable) -> None:
        tenancy = self.tenancy
        for run in table.runs:  # back after the owner saw it gone (its rollouts here
            if run.name in tenancy.leaving:  # ended), before this worker's drain noticed
                tenancy.gone(run.name)
        old_keys = {t.name: t.run.key for t in tenancy}
        plan, _, _ = tenancy.apply(table, None)
        if plan.refused is not None:  # the owner applied it: only a bug gets here
            log.error("worker: the owner's run set was refused here: %s", plan.refused)
            return
        self._departures.follow(plan, old_keys, self._gone)

    async def _gone(self, tenant: Tenant) -> None:
        if self.tenancy.leaving.get(tenant.name) is tenant:  # not gone already (above)
            self.tenancy.gone(tenant.name)

    async def aclose(self) -> None:
        await self._departures.aclose()


def mode_for(table: RunTable, tenancy: Tenancy, drain_s: float) -> RunMode:
    """The one place the mode is decided: by whether the configured runs have names."""
    return MultiRun(tenancy, drain_s) if table.multi else SingleRun(tenancy)
