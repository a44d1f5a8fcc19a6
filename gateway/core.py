"""``Gateway``: the parts of one gateway process, held together for the handlers
(``request.app.state.gateway``), and its ``/gateway/status``.

Each part has one job and gets what it needs when it is built (``gateway.app`` builds
them, bottom up); none is patched in later (``tests/test_parts.py``). The table names every
field of ``Gateway``, in field order, and the module that defines its type
(``tests/test_docstrings.py`` holds it to the dataclass and the tree):

=================  ============================  ========================================
part               module                        its job
=================  ============================  ========================================
``settings``       ``config``                    every setting, validated once at start
``pool``           ``fleet.replicas``            the replicas: membership, health,
                                                 in-flight counts
``upstream``       ``http.upstream``             every call to a replica
``router``         ``routing.policy``            the routing policy: a replica, and why
``metrics``        ``metrics``                   every metric, defined once
``tenancy``        ``runs.tenancy``              the runs: each run's adapters, homes,
                                                 pause
``mode``           ``runs.mode``                 what differs between one implicit run
                                                 and several named ones
``rotation``       ``fleet.rotation``            which replicas are in: breakers,
                                                 ejections, what leaving undoes, quorum
``selection``      ``fleet.selection``           the routing decision: candidates, choice
``ledger``         ``fleet.ledger``              one request's books: entry, attempts, exit
``fleet``          ``fleet.fanout``              one call on several replicas
``control``        ``fleet.control``             the fleet's pause state and its broadcasts
``health``         ``fleet.health``              health rounds and membership
``credentials``    ``runs.credentials``          client and admin keys; the run a key names
``peers``          ``roles``                     the other processes (the owner's ``Hub``)
=================  ============================  ========================================

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
from gateway.fleet.fanout import FanOut
from gateway.fleet.health import Health
from gateway.fleet.ledger import Ledger
from gateway.fleet.outliers import BreakerState
from gateway.fleet.replicas import ReplicaPool
from gateway.fleet.rotation import Rotation
from gateway.fleet.selection import Selection
from gateway.http.upstream import Upstream
from gateway.metrics import Metrics
from gateway.roles import Peers
from gateway.routing.policy import Router
from gateway.runs.credentials import Credentials
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
            "auth": self.credentials.summary(),
            "routing": self.metrics.routing_counts(),
            **self.mode.adapter_status(viewer),
        }
