"""The runs sharing the fleet, at run time: each run's adapter manager, home replicas,
pause and in-flight count, and the placement that decides the homes.

Why one object: a run's identity (``table.Run``), its adapter lifecycle (its own
``AdapterManager``, whose registry spans only its home replicas, so "a live version is on
every serving home" is the registry's own invariant), its scoped pause and its fair
share are looked up once per request, by credential. Single-run mode is one implicit
run homed on every replica whose pause is the fleet's: the same code, no prefix.

A scoped pause (``run_pause: scoped``) never reaches a replica. The run's new rollouts
are held at the gateway until its ``/resume``; rollouts already running go on. That keeps
what TRL pauses for: versions have their own names, so nothing a held or running
rollout names changes while the sync loads the next version, and every rollout is
generated entirely by the version it names. ``mode=wait`` also waits until the run's
in-flight rollouts are done, and ``mode=abort`` cancels them, as vLLM's modes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.adapters.manager import AdapterManager
from gateway.adapters.placement import Change, Placement, diff
from gateway.errors import (
    BadRequest,
    GatewayError,
    InsufficientSlots,
    TooManyRequests,
    Unauthorized,
    UpstreamUnavailable,
)
from gateway.roles import ALONE, Peers
from gateway.runs.aborts import Aborts, paused_with_abort
from gateway.runs.fairness import FairGate, Slot
from gateway.runs.lifecycle import Departed, RunPlan, plan, replace
from gateway.runs.table import Run, RunTable
from gateway.runs.usage import RunUsage

__all__ = [
    "OWN_ROUTES",
    "AdapterRoutes",
    "Ejector",
    "ManagerFactory",
    "RoutesSource",
    "Tenancy",
    "Tenant",
]

log = logging.getLogger("gateway.runs")

_PAUSE_MODES = ("keep", "wait", "abort")


class AdapterRoutes(Protocol):
    """What a rollout reads of a run's adapters: its manager, or in a data-plane worker
    the owner's last snapshot (``gateway.workers.snapshot.SnapshotRoutes``)."""

    def candidates(self, model: str | None) -> frozenset[int] | None: ...
    def is_live(self, name: str) -> bool: ...
    def request_started(self, name: str, replica: int) -> bool: ...
    def request_finished(self, name: str, replica: int) -> None: ...
    def salt(self, name: str, replica: int) -> str | None: ...
    def live_names(self) -> Iterable[str]: ...


class RoutesSource(Protocol):
    """Where a run's rollouts read its adapters from: the run's own manager (one process,
    the owner: ``OWN_ROUTES``), or the owner's last snapshot (a data-plane worker,
    ``gateway.workers.worker.SnapshotFeed``)."""

    def routes(self, run: str, manager: AdapterManager) -> AdapterRoutes: ...


class _OwnRoutes:
    __slots__ = ()

    def routes(self, run: str, manager: AdapterManager) -> AdapterRoutes:
        return manager


OWN_ROUTES: RoutesSource = _OwnRoutes()


class Ejector(Protocol):
    """Takes a replica that gave no answer out of rotation
    (``gateway.fleet.rotation.Rotation``)."""

    def lost(self, index: int, kind: str) -> None: ...


ManagerFactory = Callable[[Run, Callable[[int, str], None]], AdapterManager]
"""Builds a run's adapter manager, given what it calls when a replica gave no answer."""


@dataclass(eq=False)
class Tenant:
    """One run at run time."""

    run: Run
    manager: AdapterManager
    routes: AdapterRoutes
    """What its rollouts read of its adapters (``RoutesSource``)."""
    peers: Peers = ALONE
    """The other processes, whose rollouts of this run a scoped ``/pause`` waits for too."""
    homes: frozenset[int] = frozenset()
    unplaced: str | None = None
    """Why the run has no homes (the placement error, naming the budget), if it has none."""
    paused: str | None = None
    """The query string of the scoped ``/pause`` in effect, or None."""
    in_flight: int = 0
    holding: int = 0
    """Its rollouts waiting at the gateway for the run's ``/resume`` (``held``)."""
    requests: int = 0
    usage: RunUsage = field(default_factory=RunUsage)
    """Tokens, answers and held time, for a cost split (``gateway.runs.usage``)."""
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    aborts: Aborts = field(default_factory=Aborts)
    """Its rollouts cancelled by its ``/pause?mode=abort``, each owing its client a 503."""
    chores: list[asyncio.Task[None]] = field(default_factory=list)
    """Its adapter manager's ticks and audits (``Tenancy.start_chores``)."""
    fair: FairGate | None = None
    """The replicas' slots it shares with the other runs (a named run's only)."""
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._resumed.set()
        self._idle.set()

    @property
    def name(self) -> str:
        return self.run.name

    def serves(self, replica: int) -> bool:
        """Whether ``replica`` is one of its homes (single-run mode: every replica is)."""
        return not self.run.prefix or replica in self.homes

    def among(self, replicas: Iterable[int]) -> list[int]:
        """Those of ``replicas`` that are its homes."""
        return [r for r in replicas if self.serves(r)]

    def check_placed(self) -> None:
        if self.unplaced is not None:
            raise InsufficientSlots(self.unplaced)

    def settle(self, homes: frozenset[int], failure: str | None) -> None:
        """Its homes after a placement (``Tenancy.place``); ``failure``: why it could not
        be placed this time. A run with homes is placed, whatever it was before."""
        self.homes = homes
        if failure is not None:
            self.unplaced = failure
        if homes:
            self.unplaced = None

    def renew(self, run: Run) -> None:
        """A reload changed its key, limits or window (same name and roots): the next
        request reads them; nothing running is touched, but a narrower window evicts the
        versions now outside it."""
        assert run.name == self.run.name and run.roots == self.run.roots
        if run.max_staleness != self.run.max_staleness:
            self.manager.set_max_staleness(run.max_staleness)
        self.run = run

    async def drained(self, timeout: float) -> bool:
        """Whether its rollouts in flight all ended within ``timeout``."""
        if self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)
        return not self.in_flight

    def abort_removed(self) -> int:
        """A reload removed the run and its grace is over: cancel its rollouts in flight,
        each answered with a 503 (``gateway.runs.aborts``); returns how many."""
        tasks = list(self.tasks)
        for task in tasks:
            self.aborts.abort(task, removed_run(self.name))
        return len(tasks)

    def follow(self, homes: frozenset[int], unplaced: str | None, paused: str | None) -> None:
        """Adopt the owner's view of the run (a data-plane worker, per snapshot): its
        homes, why it is unplaced, and its scoped pause."""
        self.homes, self.unplaced = homes, unplaced
        if paused is None and self.paused is not None:
            self.resume()
        elif paused is not None and paused != self.paused:
            self.hold(paused)

    # -- the run's scope: what a request of this run sees (the implicit run: the identity)

    def admit_rollout(self, task: asyncio.Task[Any]) -> Tenant | None:
        """Count a rollout against a named run's cap (``enter``); returns the tenant to
        ``leave`` once it ends. The implicit run has no cap of its own (the gateway's
        ``max_in_flight`` is it): None, nothing to leave."""
        if not self.run.prefix:
            return None
        self.enter(task)
        return self

    async def slot(self, candidates: Sequence[int], prefer: Callable[[], int | None]) -> Slot:
        """A slot on one of ``candidates`` for a rollout of this named run, in weighted fair
        order once they are saturated (``gateway.runs.fairshare``); ``prefer`` reads the
        replica its routing prefers, if it has to wait."""
        assert self.fair is not None, "the implicit run takes no slot"
        return await self.fair.admit(self.name, self.run.weight, candidates, self.usage, prefer)

    def rollout_replicas(self, healthy: list[int]) -> list[int]:
        """Where its rollouts may go: its healthy homes (507 while it has none)."""
        if not self.run.prefix:
            return healthy
        self.check_placed()
        return self.among(healthy)

    def scope_rollout(self, payload: dict[str, Any], body: bytes) -> bytes:
        """The rollout body its replicas must see: the adapter it names, under its prefix
        (re-serialized; the implicit run's body is sent as it came)."""
        if not self.run.prefix:
            return body
        payload["model"] = self.run.replica_name(payload["model"])
        return orjson.dumps(payload)

    def fan_in_replicas(self, healthy: list[int]) -> list[int] | None:
        """Where its fan-in calls (``/v1/models``, ``/server_info``) ask: its healthy homes
        (every healthy replica while it is unplaced); None: every healthy replica."""
        if not self.run.prefix:
            return None
        return self.among(healthy) if self.homes else healthy

    def adapter_call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A load or unload as its manager must see it: under its prefix, and a load only
        once it is placed."""
        if not self.run.prefix:
            return payload
        if path == "/v1/load_lora_adapter":
            self.check_placed()
        if isinstance(name := payload.get("lora_name"), str) and name:
            return {**payload, "lora_name": self.run.replica_name(name)}
        return payload

    def holds_pause(self, run_pause: str) -> bool:
        """Whether its ``/pause`` is held at the gateway (``run_pause: scoped``) rather
        than sent to the replicas (the implicit run's, and ``run_pause: fleet``)."""
        return bool(self.run.prefix) and run_pause == "scoped"

    def reset_replicas(self, healthy: list[int]) -> list[int] | None:
        """Where its ``/reset_prefix_cache`` goes: its homes; None: every replica."""
        return self.among(healthy) if self.run.prefix else None

    def own_status(self) -> Any:
        """Its adapters' status by the names it knows."""
        return orjson.loads(self.run.unscope(orjson.dumps(self.manager.status())))

    def enter(self, task: asyncio.Task[Any]) -> None:
        """Count a rollout against the run's cap (429 above it, so a burst of one run
        cannot take every slot of the gateway's ``max_in_flight``)."""
        cap = self.run.max_in_flight
        if cap is not None and self.in_flight >= cap:
            raise TooManyRequests(
                f"Run '{self.name}' has {cap} requests in flight, its max_in_flight; "
                "retry shortly.",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        self.requests += 1
        self.tasks.add(task)
        self._idle.clear()

    def leave(self, task: asyncio.Task[Any]) -> None:
        self.in_flight -= 1
        self.tasks.discard(task)
        if not self.in_flight:
            self._idle.set()

    async def held(self) -> None:
        """Returns once the run is not paused (at once, almost always); the wait counts
        as its held time."""
        if self.paused is None:
            return
        started = time.monotonic()
        self.holding += 1
        try:
            while self.paused is not None:
                await self._resumed.wait()
        finally:
            self.holding -= 1
            self.usage.held_s += time.monotonic() - started

    async def pause(self, query: str, timeout: float) -> None:
        mode = self.hold(query)
        if mode in ("wait", "abort") and self.in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                log.warning("run %s: %d rollouts still in flight %.0f s after /pause?%s",
                            self.name, self.in_flight, timeout, query)  # fmt: skip
        if mode in ("wait", "abort"):
            await self.peers.run_drained(self.name, timeout)

    def hold(self, query: str) -> str:
        """Hold the run's new rollouts from now on (``abort``: cancel its running ones
        too); returns the mode. A data-plane worker applies a snapshot's pause this way."""
        mode = _mode(query)
        self.paused = query
        self._resumed.clear()
        if mode == "abort":  # each answered, not dropped (``gateway.runs.aborts``)
            for task in list(self.tasks):
                self.aborts.abort(task, paused_with_abort(self.name))
        return mode

    def resume(self) -> None:
        self.paused = None
        self._resumed.set()


def removed_run(run: str) -> GatewayError:
    """The answer to a rollout of a run that a reload removed, once its grace ran out."""
    return UpstreamUnavailable(
        f"Run '{run}' was removed from the gateway by a reload, which cancelled this "
        "rollout once its grace ran out.",
        headers={"Retry-After": "1"},
    )


def _mode(query: str) -> str:
    mode = "abort"  # vLLM's default
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "mode":
            mode = value
    if mode not in _PAUSE_MODES:
        raise BadRequest(f"mode must be one of {list(_PAUSE_MODES)}, got {mode!r}.", param="mode")
    return mode


class Tenancy:
    """Every run, by credential; and where each one lives on the fleet."""

    def __init__(
        self,
        table: RunTable,
        manager: ManagerFactory,
        ejector: Ejector,
        *,
        peers: Peers = ALONE,
        routes: RoutesSource = OWN_ROUTES,
        fair: FairGate | None = None,
        departed: Departed | None = None,
    ) -> None:
        self.table = table
        self.fair = fair
        self.departed = departed if departed is not None else Departed()
        """Final counts of the runs that are gone, still exported (``runs.lifecycle``)."""
        self._ejector = ejector
        self._manager = manager
        self._routes = routes
        self._peers = peers
        self.tenants: dict[str, Tenant] = {}
        for run in table.runs:
            self.tenants[run.name] = self._tenant(run)
        self.leaving: dict[str, Tenant] = {}
        """Runs a reload removed that still drain or hold adapters: they keep their slots
        (and their homes' adapters are theirs) until ``gone``."""
        self._retired: dict[str, list[bytes]] = {}
        self.reloads: dict[str, int] = {}
        """Reloads of the run set by outcome (``gateway_run_reloads_total``)."""
        self.placement: Placement | None = None
        self.budget: int | None = None
        self.down: frozenset[int] = frozenset()
        """Replicas out of rotation at the last health round (``rehome``): every placement
        gives them no new home and re-places the runs homed only there."""
        self.generation = 0
        """Counts the run sets that changed a run (``apply``): a data-plane worker is sent
        the run set whenever it changes (``gateway.workers.owner``)."""
        self._single = None if table.multi else self.tenants[""]

    def _tenant(self, run: Run) -> Tenant:
        own = self._manager(run, self.lose)
        fair = self.fair if run.prefix else None
        return Tenant(run, own, self._routes.routes(run.name, own), self._peers, fair=fair)

    @property
    def multi(self) -> bool:
        return self.table.multi

    def apply(
        self, new: RunTable, budget: int | None
    ) -> tuple[RunPlan, list[Tenant], list[tuple[Change, str, int]]]:
        """A reload's new run set (``gateway.runs.lifecycle``): removed runs stop being
        identified at once and go to ``leaving`` (keeping their slots); added runs are
        built and placed; kept runs take their new key and limits (a rotated key keeps
        working until ``expire_key``). Returns the plan (``refused``: nothing changed) and
        the added tenants, whose adapters the caller rebuilds, and the placement's moves."""
        found = plan(self.table, new, self.leaving)
        if found.refused is None and found.windowed:
            found = self._fits(found, new)
        if found.refused is not None:
            return found, [], []
        if found:  # the workers need a run set only when runs or their settings changed
            self.generation += 1
        for name in found.removed:
            self.leaving[name] = self.tenants.pop(name)
            self._retired.pop(name, None)
        for name in found.added:  # back under its old name: a new run, counting from 0
            self.departed.back(name)
        added = [self._tenant(new[name]) for name in found.added]
        self.tenants.update((t.name, t) for t in added)
        for name in found.rotated:
            old = self.tenants[name].run
            if new[name].key_overlap_s > 0 and old.key is not None:
                self._retired.setdefault(name, []).append(old.key)
        for name, tenant in self.tenants.items():
            if tenant.run != new[name]:
                tenant.renew(new[name])
        self._retable(new.runs)
        moves: list[tuple[Change, str, int]] = []
        resized = found.added or found.windowed or budget not in (None, self.budget)
        if self.budget is not None and resized:
            replicas = self.placement.replicas if self.placement is not None else ()
            moves = self.place(sorted(replicas), budget if budget is not None else self.budget)
        return found, added, moves

    def _fits(self, found: RunPlan, new: RunTable) -> RunPlan:
        """A changed ``max_staleness`` changes the run's slots on each home: refuse the set
        when, re-placed with them, a run placed now would lose every home (its work would
        be dropped); a dry run of the placement, nothing applied."""
        if self.budget is None or self.placement is None:
            return found
        runs = {t.name: t.run.slots for t in self.leaving.values()}
        runs |= {r.name: r.slots for r in new.runs if r.name in self.tenants}
        trial, failed = replace(self.placement, runs, sorted(self.placement.replicas),
                                self.budget, self.down)  # fmt: skip
        lost = sorted(n for n in failed if self.placement.homes(n) and not trial.homes(n))
        if not lost:
            return found
        name = lost[0]
        return RunPlan(refused=f"run {name!r} would no longer fit with max_staleness changed "
                               f"for {list(found.windowed)}: {failed[name]}")  # fmt: skip

    def _retable(self, runs: Iterable[Run]) -> None:
        retired = [(name, key) for name, keys in self._retired.items() for key in keys]
        self.table = RunTable(runs, retired)

    def expire_key(self, name: str, key: bytes) -> None:
        """A rotated key's overlap is over: it names its run no more."""
        keys = self._retired.get(name, [])
        if key in keys:
            keys.remove(key)
            self._retable(self.table.runs)

    def gone(self, name: str) -> list[tuple[Change, str, int]]:
        """A removed run drained and its adapters were unloaded: its slots are freed, and
        runs that did not fit are placed if they now do. Returns the moves."""
        tenant = self.leaving.pop(name, None)
        if tenant is not None:
            overflows = 0 if self.fair is None else self.fair.overflowed(name)
            self.departed.left(name, tenant.requests, tenant.usage, overflows)
        if self.fair is not None:
            self.fair.forget(name)
        if self.budget is None or self.placement is None:
            return []
        return self.place(sorted(self.placement.replicas), self.budget)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.tenants.values())

    def every(self) -> list[Tenant]:
        """The runs serving, then those a reload removed that are still leaving (draining,
        their adapters being unloaded): status and metrics show both, a replica's owners and
        the chores to stop include both."""
        return [*self.tenants.values(), *self.leaving.values()]

    def find(self, name: str) -> Tenant | None:
        """The run of that name, live or still leaving."""
        return self.tenants.get(name) or self.leaving.get(name)

    def managers(self) -> list[AdapterManager]:
        return [t.manager for t in self.tenants.values()]

    def lose(self, index: int, kind: str) -> None:
        """A call got no answer from ``index`` (``gateway.fleet.quorum``'s "lost"): eject
        it at once, and every run homed there stops sending it adapter calls; it is
        reconciled before it serves again."""
        self._ejector.lost(index, kind)
        for tenant in self:
            if tenant.serves(index):
                tenant.manager.replica_down(index)

    def single(self) -> Tenant:
        assert self._single is not None, "multi-run mode has no single run"
        return self._single

    def for_request(self, authorization: bytes | None) -> Tenant:
        """The run a request belongs to; 401 in multi-run mode without a run's key."""
        if self._single is not None:
            return self._single
        run = self.table.identify(authorization)
        if run is None:
            raise Unauthorized(
                "Invalid or missing run key (use http://RUN:KEY@gateway or Bearer KEY).",
                headers={"WWW-Authenticate": 'Basic realm="rollout-gateway"'},
            )
        return self.tenants[run.name]

    def owners_of(self, replica: int) -> frozenset[str]:
        """Runs homed on ``replica`` (leaving ones too: their adapters are theirs until
        they are gone)."""
        return frozenset(t.name for t in self.every() if t.serves(replica))

    def start_chores(self, tenant: Tenant, audit_interval_s: float) -> None:
        """Its adapter manager's ticks and audits, until ``stop_chores``."""
        manager, name = tenant.manager, tenant.name
        tenant.chores.extend((
            asyncio.create_task(manager.run_ticks(), name=f"gateway-adapter-ticks{name}"),
            asyncio.create_task(manager.run_audits(audit_interval_s),
                                name=f"gateway-adapter-audits{name}"),
        ))  # fmt: skip

    async def stop_chores(self, tenants: Iterable[Tenant] | None = None) -> None:
        """Stop the chores of ``tenants`` (None: every run's, leaving ones included)."""
        chosen = list(tenants) if tenants is not None else self.every()
        tasks = [task for t in chosen for task in t.chores]
        for t in chosen:
            t.chores.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def rehome(self, down: Collection[int]) -> list[tuple[Change, str, int]]:
        """The health round's replicas out of rotation (ejected, unhealthy). When they
        changed, every run is re-placed with them (``down``): a run whose homes are all
        down moves to up replicas with room, or is unplaced (its ``home_replicas`` 0, for
        the alert) until room appears; a replica back up may take homes by spreading. A
        moved run does not move back. Returns the moves (none: nothing changed)."""
        now = frozenset(down)
        if now == self.down or self.budget is None or self.placement is None:
            return []  # not placed yet: the start's placement reads the members as they are
        self.down = now
        return self.place(sorted(self.placement.replicas), self.budget)

    def place(self, replicas: Sequence[int], budget: int) -> list[tuple[Change, str, int]]:
        """(Re)place every run on ``replicas`` (each with ``budget`` slots), moving as little
        as possible; apply the homes to each run's manager; returns the moves applied.
        The replicas ``down`` take no new home; a run homed only on them is re-placed on
        the others, or left unplaced (``placement``'s rules).

        Order (``placement``'s rule): lost homes first, so the registry stops routing
        there before anything is unloaded; gained homes join DOWN and get adapter
        traffic only once reconciled (their live versions loaded)."""
        self.budget = budget
        previous = self.placement or Placement.empty({})
        every = {**self.leaving, **self.tenants}
        runs = {t.name: t.run.slots for t in every.values()}
        new, failed = replace(previous, runs, replicas, budget, self.down)
        for name, why in failed.items():
            if every[name].unplaced != why:  # once per reason: re-placing repeats it
                log.error("run %s cannot be placed: %s", name, why)
        moves = []
        for move in diff(previous, new):
            tenant = every.get(move.run)
            if tenant is None:  # a removed run, gone: its adapters were unloaded
                pass
            elif move.change is Change.LOSE:
                tenant.manager.remove_replica(move.replica)
            else:
                tenant.manager.add_replica(move.replica)
            moves.append((move.change, move.run, move.replica))
        for tenant in every.values():
            tenant.settle(new.homes(tenant.name), failed.get(tenant.name))
        self.placement = new
        return moves

    def max_loras(self, tenant: Tenant) -> int | None:
        """What ``/server_info`` tells a run of its LoRA budget: its own slots once it is
        placed (so TRL's ``max_loras >= max_staleness + 2`` check means something)."""
        if not self.multi or self.placement is None:
            return None
        return self.placement.max_loras(tenant.name)

    def _fair_status(self, tenant: Tenant) -> dict[str, Any]:
        fair = tenant.fair
        if fair is None:
            return {"weight": tenant.run.weight}
        name = tenant.name
        return {"weight": tenant.run.weight, "slots": fair.slots(name),
                "waiting": fair.waiting(name), "overflows": fair.overflowed(name)}  # fmt: skip

    def status(self, only: str | None = None) -> list[dict[str, Any]]:
        return [
            {
                "name": t.name,
                "state": "serving" if t.name in self.tenants else "leaving",
                "home_replicas": sorted(t.homes),
                "slots": t.run.slots,
                "max_staleness": t.run.max_staleness,
                "paused": t.paused is not None,
                "in_flight": t.in_flight,
                "requests": t.requests,
                "live": [t.run.client_name(a.name) for a in t.manager.live_adapters()],
                "unplaced": t.unplaced,
                "usage": t.usage.status(),
                "fair": self._fair_status(t),
            }
            for t in self.every()
            if only is None or t.name == only
        ]
