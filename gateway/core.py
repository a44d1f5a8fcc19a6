"""``Gateway``: the parts of one gateway process, held together for the handlers
(``request.app.state.gateway``), and its ``/gateway/status``.

Each part has one job and gets what it needs when it is built (``gateway.app`` builds
them, bottom up); none is patched in later:

==============  ===============================================================
``rotation``    which replicas are in rotation: breakers, ejections, quorum
``selection``   the routing decision: the candidate set and the choice
``ledger``      one request's books, on entry, per attempt, on exit
``fleet``       the same call on several replicas (control calls, fan-in)
``control``     the fleet's pause state and the broadcasts that change it
``health``      health rounds and membership (the owner's loops)
``credentials`` client and admin keys, and the run a key names
``peers``       the other processes of ``serve --workers N`` (``gateway.roles``)
==============  ===============================================================

A data-plane worker and the owner differ only by the role parts they were given
(``gateway.roles``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import __version__
from gateway.adapters.manager import AdapterManager
from gateway.config import Settings
from gateway.fleet.control import FleetControl
from gateway.fleet.outliers import BreakerState
from gateway.fleet.replicas import ReplicaPool
from gateway.http.upstream import Upstream
from gateway.metrics import Metrics
from gateway.parts.credentials import Credentials
from gateway.parts.fanout import FanOut
from gateway.parts.health import Health
from gateway.parts.ledger import Ledger
from gateway.parts.rotation import Rotation
from gateway.parts.selection import Selection
from gateway.roles import Peers
from gateway.routing.policy import Router
from gateway.runs.mode import RunMode
from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["Gateway"]


@dataclass(frozen=True, slots=True, eq=False)
class Gateway:
    settings: Settings
    pool: ReplicaPool
    upstream: Upstream
    router: Router
    metrics: Metrics
    tenancy: Tenancy
    mode: RunMode
    """Single-run or multi-run mode (``gateway.runs.mode``): what differs between them."""
    rotation: Rotation
    selection: Selection
    ledger: Ledger
    fleet: FanOut
    control: FleetControl
    health: Health
    credentials: Credentials
    peers: Peers

    @property
    def adapters(self) -> AdapterManager:
        """Single-run mode's adapter manager (multi-run: ``tenancy``, one per run)."""
        return self.tenancy.single().manager

    def status(self, viewer: Tenant | None = None) -> dict[str, Any]:
        """``/gateway/status``; ``viewer``: a run's own view (multi-run mode: its entry
        and its adapters by its names, nothing of the other runs)."""
        breakers = self.rotation.outliers.states()
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
            "in_flight": self.ledger.admission.in_flight,
            "paused": self.control.paused is not None,
            "routing": self.metrics.routing_counts(),
            **self.mode.adapter_status(viewer),
        }
