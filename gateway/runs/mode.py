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

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector

from gateway.adapters.placement import Change
from gateway.runs.metrics import RunCollector
from gateway.runs.placing import RunFleet, place_runs, sweep
from gateway.runs.table import RunTable
from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["MultiRun", "RunMode", "SingleRun", "mode_for"]

log = logging.getLogger("gateway.runs")


class RunMode(Protocol):
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

    def adapter_status(self, viewer: Tenant | None) -> dict[str, Any]:
        """The adapter part of ``/gateway/status``."""
        ...


class SingleRun:
    """One implicit run, homed everywhere: every method is the identity or the run's."""

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

    def adapter_status(self, viewer: Tenant | None) -> dict[str, Any]:
        return {"adapters": self.run.manager.status()}


class MultiRun:
    """Named runs, each on its home replicas (``Tenancy.place``), each seeing itself."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy

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


def mode_for(table: RunTable, tenancy: Tenancy) -> RunMode:
    """The one place the mode is decided: by whether the configured runs have names."""
    return MultiRun(tenancy) if table.multi else SingleRun(tenancy)
