"""The fleet's scrape-time metrics: per replica (in flight, health, address, outlier
breaker) and the fleet's pause. Read from the pool, the breakers and ``FleetControl``
when Prometheus scrapes, never updated on the request path (``gateway.metrics`` registers
them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet.outliers import OutlierDetector
from gateway.fleet.replicas import Replica, ReplicaPool

if TYPE_CHECKING:
    from gateway.fleet.control import FleetControl

__all__ = ["BreakerCollector", "ControlCollector", "PoolCollector", "replica_address"]


def replica_address(replica: Replica) -> str:
    """The replica's URL as ``gateway_replica_info`` shows it: scheme, host, port and path.

    The one URL label the gateway exports, so it carries nothing secret: ``base_url``
    already lost any ``user:password@`` (that became the ``Authorization`` header, as a
    token does: neither is ever part of it), and a query string or fragment, which could
    hold a key, is dropped too."""
    url = replica.base_url.with_user(None).with_query(None).with_fragment(None)
    return str(url.with_path(url.raw_path.rstrip("/"), encoded=True))


class PoolCollector(Collector):
    """Scrape-time view of the pool: in-flight, health and address per member (so the
    series follow discovery: a replica added or removed shows up at the next scrape)."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "gateway_replica_in_flight_requests",
            "Requests the gateway has in flight to each replica.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "gateway_replica_healthy", "1 if the replica is in rotation.", labels=["replica"]
        )
        # The one exception to "no URL in a label": an info metric, 1 per member, mapping
        # the replica index every other family uses to the address Prometheus scrapes
        # vLLM's own metrics at (so a panel can join the two). The set is closed (the
        # configured or discovered members, never a client's input) and the value holds
        # no credentials (``replica_address``).
        info = GaugeMetricFamily(
            "gateway_replica_info",
            "1 per replica in the pool: its index and URL (no credentials, no query).",
            labels=["replica", "url"],
        )
        for replica in self._pool.replicas:
            label = [str(replica.index)]
            in_flight.add_metric(label, replica.in_flight)
            healthy.add_metric(label, 1.0 if replica.up else 0.0)
            info.add_metric([*label, replica_address(replica)], 1.0)
        yield in_flight
        yield healthy
        yield info


class ControlCollector(Collector):
    """The fleet's pause (``FleetControl``), read at scrape time: one gauge for "paused
    now" and one for when it began, so an alert can say how long it has been held."""

    def __init__(self, control: FleetControl) -> None:
        self._control = control

    def collect(self) -> Iterator[Metric]:
        control = self._control
        paused = GaugeMetricFamily(
            "gateway_fleet_paused",
            "1 while a fleet-wide /pause holds the replicas (until /resume).",
        )
        paused.add_metric([], 0.0 if control.paused is None else 1.0)
        since = GaugeMetricFamily(
            "gateway_fleet_paused_since_seconds",
            "Unix time the fleet-wide /pause in effect began; 0 while not paused.",
        )
        began = control.paused_since if control.paused is not None else None
        since.add_metric([], began or 0.0)
        yield paused
        yield since


class BreakerCollector(Collector):
    """Outlier breaker state per replica of the pool: 0 (closed) for one that has not
    answered yet, so the series RolloutGatewayReplicaOutlierEjected selects exists from the
    start (``gateway.metrics``, "Born at zero")."""

    def __init__(self, outliers: OutlierDetector, pool: ReplicaPool) -> None:
        self._outliers = outliers
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "gateway_replica_breaker_state",
            "Outlier circuit breaker: 0 closed, 1 open (ejected), 2 half-open (one trial).",
            labels=["replica"],
        )
        states = {index: int(value) for index, value in self._outliers.states().items()}
        for index in sorted(set(self._pool.indices()) | set(states)):
            state.add_metric([str(index)], states.get(index, 0))
        yield state
