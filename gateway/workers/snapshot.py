"""The control state a data-plane worker routes by, as one immutable value.

The owner process applies every control call and every health change; a worker only
ever reads the last ``ControlSnapshot`` it was sent. What a rollout needs is small: which
replicas are in rotation, and per run its homes, its pause, and which replicas serve each
adapter name. (Outlier breakers are not control state: every process reads and writes
the same ones, ``gateway.fleet.shared``.) ``capture`` reads it off the
owner's ``Gateway``; ``SnapshotRoutes`` answers a rollout's adapter questions from it the
way ``AdapterManager`` does, so a rollout takes the same path in both: a worker's runs are
built with them (``SnapshotFeed``, its ``RoutesSource``), and each snapshot moves them on.

Sans-I/O: no sockets, no clock; the wire form is plain JSON.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gateway.adapters.state import RequestCounts

if TYPE_CHECKING:
    from gateway.adapters.manager import AdapterManager
    from gateway.core import Gateway

__all__ = ["ControlSnapshot", "RunView", "SnapshotFeed", "SnapshotRoutes", "capture"]

_EMPTY: Mapping[str, frozenset[int]] = MappingProxyType({})
_NO_RESETS: Mapping[int, int] = MappingProxyType({})
_NO_SALTS: Mapping[str, Mapping[int, str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RunView:
    """One run as the data path sees it (single-run mode: the run named ``""``)."""

    name: str
    homes: frozenset[int] = frozenset()
    unplaced: str | None = None
    paused: str | None = None
    adapters: Mapping[str, frozenset[int]] = field(default_factory=lambda: _EMPTY)
    """Every registered adapter name -> replicas that may serve it (empty: not now)."""
    live: frozenset[str] = frozenset()
    base_models: frozenset[str] = frozenset()
    salts: Mapping[str, Mapping[int, str]] = field(default_factory=lambda: _NO_SALTS)
    """Adapter name -> replica -> the cache_salt of that copy's load generation."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "homes": sorted(self.homes),
            "unplaced": self.unplaced,
            "paused": self.paused,
            "adapters": {n: sorted(r) for n, r in self.adapters.items()},
            "live": sorted(self.live),
            "base_models": sorted(self.base_models),
            "salts": {n: {str(r): s for r, s in by.items()} for n, by in self.salts.items()},
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RunView:
        return cls(
            name=data["name"],
            homes=frozenset(data["homes"]),
            unplaced=data["unplaced"],
            paused=data["paused"],
            adapters=MappingProxyType({n: frozenset(r) for n, r in data["adapters"].items()}),
            live=frozenset(data["live"]),
            base_models=frozenset(data["base_models"]),
            salts=MappingProxyType(
                {n: {int(r): s for r, s in by.items()} for n, by in data["salts"].items()}
            ),
        )


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    """Everything the data path may read of the control plane, at one ``epoch``."""

    epoch: int
    healthy: frozenset[int]
    """Replicas in rotation (admitted, reconciled, in the fleet's pause state)."""
    runs: tuple[RunView, ...]
    cache_resets: Mapping[int, int] = field(default_factory=lambda: _NO_RESETS)
    """Replica -> how often its prefix cache was emptied (a change: forget what the
    router learned about it)."""
    runs_generation: int = 0
    """The owner's run set (``Tenancy.generation``): a worker that has not been sent this
    one is sent it (keys and limits, op ``runs``) before the snapshot."""

    def same_state(self, other: ControlSnapshot | None) -> bool:
        """Equal but for the epoch: nothing to publish."""
        return other is not None and replace(other, epoch=self.epoch) == self

    def run(self, name: str) -> RunView | None:
        return next((r for r in self.runs if r.name == name), None)

    def to_wire(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "healthy": sorted(self.healthy),
            "runs": [r.to_wire() for r in self.runs],
            "cache_resets": {str(i): n for i, n in self.cache_resets.items()},
            "runs_generation": self.runs_generation,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ControlSnapshot:
        return cls(
            epoch=data["epoch"],
            healthy=frozenset(data["healthy"]),
            runs=tuple(RunView.from_wire(r) for r in data["runs"]),
            cache_resets=MappingProxyType({int(i): n for i, n in data["cache_resets"].items()}),
            runs_generation=data["runs_generation"],
        )


def capture(gw: Gateway, epoch: int) -> ControlSnapshot:
    """The owner's control state now."""
    runs = []
    for tenant in gw.tenancy:
        adapters, live, bases, salts = tenant.manager.core.routing_view()
        runs.append(
            RunView(
                name=tenant.name,
                homes=frozenset(tenant.homes),
                unplaced=tenant.unplaced,
                paused=tenant.paused,
                adapters=MappingProxyType(adapters),
                live=live,
                base_models=bases,
                salts=MappingProxyType(salts),
            )
        )
    return ControlSnapshot(
        epoch=epoch,
        healthy=frozenset(gw.pool.healthy_indices()),
        runs=tuple(runs),
        cache_resets=MappingProxyType(dict(gw.rotation.cache_resets)),
        runs_generation=gw.tenancy.generation,
    )


class SnapshotRoutes(RequestCounts):
    """A run's adapters as the latest snapshot says, with ``AdapterManager``'s answers.

    ``in_flight`` is the worker's own count per (name, replica); it outlives snapshots,
    so the owner can ask whether a copy it retires still has requests here before it
    unloads it."""

    __slots__ = ("_inflight", "_view")

    def __init__(self, view: RunView, in_flight: Counter[tuple[str, int]]) -> None:
        self._view = view
        self._inflight = in_flight

    @property
    def in_flight(self) -> Counter[tuple[str, int]]:
        return self._inflight

    def follow(self, view: RunView) -> None:
        """Answer by ``view`` from now on (one assignment: no rollout sees half of it)."""
        self._view = view

    def candidates(self, model: str | None) -> frozenset[int] | None:
        if model is None:
            return None
        found = self._view.adapters.get(model)
        if found is not None:
            return found
        bases = self._view.base_models
        return None if not bases or model in bases else frozenset()

    def is_live(self, name: str) -> bool:
        return name in self._view.live

    def live_names(self) -> frozenset[str]:
        return self._view.live

    def salt(self, name: str, replica: int) -> str | None:
        by = self._view.salts.get(name)
        return None if by is None else by.get(replica)


class SnapshotFeed:
    """A data-plane worker's ``RoutesSource`` (``gateway.runs.tenancy``): each run reads
    its adapters from its ``SnapshotRoutes``, which ``follow`` moves to every new
    snapshot's view. One request counter for all of them (``in_flight``)."""

    __slots__ = ("_routes", "in_flight")

    def __init__(self) -> None:
        self.in_flight: Counter[tuple[str, int]] = Counter()
        """(adapter, replica) -> this worker's requests on that copy."""
        self._routes: dict[str, SnapshotRoutes] = {}

    def routes(self, run: str, manager: AdapterManager) -> SnapshotRoutes:
        routes = self._routes[run] = SnapshotRoutes(RunView(run), self.in_flight)
        return routes

    def follow(self, snapshot: ControlSnapshot) -> None:
        for name, routes in self._routes.items():
            routes.follow(snapshot.run(name) or RunView(name))
