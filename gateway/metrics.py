"""Every Prometheus metric the gateway exports, defined once.

Conventions: ``gateway_`` prefix, units in the name, ``_total`` only on counters, labels
only from closed sets (route kind, status class, replica *index*, enum reasons), never
from prompts, adapter versions or URLs. Each app owns its own ``CollectorRegistry`` so
several gateways can live in one process (tests) without colliding.

Per-replica gauges (in-flight, health) are read from the pool at scrape time by a custom
collector instead of being ``inc()``/``dec()``-ed on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.replicas import ReplicaPool

__all__ = ["CONTENT_TYPE", "Metrics", "RouteKind"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ``*_created`` series double the scrape size and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Latency buckets from 0.5 ms (gateway overhead) up to 10 min (long generations).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


class RouteKind(StrEnum):
    ROUTED = "routed"
    BROADCAST = "broadcast"
    FAN_IN = "fan_in"
    FORWARDED = "forwarded"
    GATEWAY = "gateway"


class _PoolCollector(Collector):
    """Scrape-time view of the pool: in-flight, health and served counts per replica."""

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
        for replica in self._pool.replicas:
            label = [str(replica.index)]
            in_flight.add_metric(label, replica.in_flight)
            healthy.add_metric(label, 1.0 if replica.up else 0.0)
        yield in_flight
        yield healthy


class Metrics:
    """The gateway's metrics plus ``record_*`` helpers used by the I/O shell."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests_total",
            "Client requests answered, by route kind and status class.",
            ["route", "status_class"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "gateway_request_duration_seconds",
            "Time from request start until the response (or stream) ended.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.routed = Counter(
            "gateway_replica_routed_requests_total",
            "Routed requests sent to each replica (including retries).",
            ["replica"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors_total",
            "Upstream failures by replica and kind (connect, timeout, protocol).",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "gateway_upstream_retries_total",
            "Requests re-sent to another replica before any response byte arrived.",
            registry=r,
        )
        self.ejections = Counter(
            "gateway_replica_ejections_total",
            "Times a replica was taken out of rotation, by cause (probe, passive).",
            ["replica", "cause"],
            registry=r,
        )
        self.broadcasts = Counter(
            "gateway_broadcasts_total",
            "Fan-out calls by endpoint and outcome (ok, failed).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "gateway_routing_decisions_total",
            "Routing decisions by reason.",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects_total",
            "Client disconnects that cancelled an upstream request.",
            registry=r,
        )
        r.register(_PoolCollector(pool))

    def record_request(self, route: RouteKind, status: int, seconds: float) -> None:
        self.requests.labels(route.value, f"{status // 100}xx").inc()
        self.request_seconds.labels(route.value).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
