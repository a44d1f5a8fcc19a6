"""Every Prometheus metric the gateway exports, defined once.

Conventions: ``gateway_`` prefix, units in the name, ``_total`` only on counters, labels
only from closed sets (route kind, status class, replica *index*, enum reasons), never
from prompts, adapter versions or URLs. Each app owns its own ``CollectorRegistry`` so
several gateways can live in one process (tests) without colliding.

Per-replica gauges (in-flight, health) are read from the pool at scrape time by a custom
collector instead of being ``inc()``/``dec()``-ed on the hot path; so are the fleet's
pause and the replica addresses (``gateway.fleet.metrics`` holds the fleet's collectors,
``gateway.runs.metrics`` the per-run ones). Those collectors are handed in (``watch``) by
whoever builds the gateway, so that this module, which the fleet's parts record into,
imports none of them. The registry also holds prometheus-client's
process and platform collectors (``process_*``, ``python_info``), read at scrape time.
"""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway import __version__, build_commit
from gateway.adapters.state import Failure, Outcome

if TYPE_CHECKING:
    from gateway.adapters.manager import AdapterManager
    from gateway.adapters.state import Action, Result, Settlement
    from gateway.routing.policy import Decision, Router

__all__ = [
    "ADMISSION_REFUSALS",
    "CONTENT_TYPE",
    "CONTROL_CALLS",
    "STATUS_CLASSES",
    "UPSTREAM_ERROR_KINDS",
    "Metrics",
    "ProbeResult",
    "RouteKind",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ``*_created`` series double the scrape size and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Latency buckets from 0.5 ms (gateway overhead) up to 10 min (long generations).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
_DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3)


class RouteKind(StrEnum):
    ROUTED = "routed"
    BROADCAST = "broadcast"
    FAN_IN = "fan_in"
    FORWARDED = "forwarded"
    GATEWAY = "gateway"


class ProbeResult(StrEnum):
    """One health probe's result (``gateway_health_probes_total``)."""

    OK = "ok"  # /health answered 200
    UNHEALTHY = "unhealthy"  # another status (the engine died, still loading), or broken off
    TIMEOUT = "timeout"  # no answer within health_timeout_s (a hung replica)
    UNREACHABLE = "unreachable"  # no connection (refused, DNS, TLS, reset: the log says)


# Born at zero. Prometheus' increase() and rate() see a counter rise only from a sample it
# has already scraped: a series whose first sample is 1 (the first failure) is invisible
# to them, and an alert on "any failure in 10 minutes" never fires for the only failure a
# trainer makes before it stops. So every series that an alert of
# deploy/prometheus/alerts.yml selects is exported at 0 from the start, for every value of
# its labels: the closed sets below (and the enums they come from), each replica of the
# pool, each configured run (``gateway.runs.metrics``). tests/deploy/test_prometheus.py
# scrapes a started gateway for each alert's series (docs/alerts.md, "Born at zero").
STATUS_CLASSES = ("2xx", "4xx", "5xx")
CONTROL_CALLS = ("pause", "resume", "reset_prefix_cache")  # gateway_broadcasts_total endpoints
ADMISSION_REFUSALS = ("in_flight", "client_in_flight")  # gateway.fleet.admission.Refusal
# ``gateway.http.failures`` names them: the connection failures, and ``timeout`` and
# ``ejected`` of a control call that got no answer (``Rotation.lost``). A kind not listed
# is still counted, from its first failure on.
UPSTREAM_ERROR_KINDS = (
    "dns", "refused", "unreachable", "tls", "connect_timeout", "reset", "connect", "timeout",
    "ejected",
)  # fmt: skip


class _LoopCounter:
    """One label set's count, updated from the event loop thread only."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _LoopHistogram:
    """One label set's histogram: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value ("le")


class _LoopMetrics(Collector):
    """The per-request metrics as plain numbers, rendered at scrape time.

    prometheus-client takes a lock per ``inc`` and per histogram bucket walk (five such
    updates per routed request); the event loop is the only writer here, so plain
    attributes do, and the exported series (names, labels, buckets) are unchanged."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], _LoopCounter] = {}
        self.request_seconds: dict[str, _LoopHistogram] = {}
        self.routed: dict[str, _LoopCounter] = {}
        self.decisions: dict[str, _LoopCounter] = {}
        self.decision_seconds = _LoopHistogram(_DECISION_BUCKETS)

    @staticmethod
    def _histogram(family: HistogramMetricFamily, labels: list[str], h: _LoopHistogram) -> None:
        running, buckets = 0.0, []
        for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
            running += count
            buckets.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
        family.add_metric(labels, buckets, h.sum)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "gateway_requests",
            "Client requests answered, by route kind and status class.",
            labels=["route", "status_class"],
        )
        for (route, status_class), counter in self.requests.items():
            requests.add_metric([route, status_class], counter.value)
        seconds = HistogramMetricFamily(
            "gateway_request_duration_seconds",
            "Time from request start until the response (or stream) ended.",
            labels=["route"],
        )
        for route, histogram in self.request_seconds.items():
            self._histogram(seconds, [route], histogram)
        routed = CounterMetricFamily(
            "gateway_replica_routed_requests",
            "Routed requests sent to each replica (including retries).",
            labels=["replica"],
        )
        for replica, counter in self.routed.items():
            routed.add_metric([replica], counter.value)
        decisions = CounterMetricFamily(
            "gateway_routing_decisions", "Routing decisions by reason.", labels=["reason"]
        )
        for reason, counter in self.decisions.items():
            decisions.add_metric([reason], counter.value)
        decision_seconds = HistogramMetricFamily(
            "gateway_routing_decision_seconds", "Time spent choosing a replica for one request."
        )
        self._histogram(decision_seconds, [], self.decision_seconds)
        yield from (requests, seconds, routed, decisions, decision_seconds)


class _ReplicaCounter:
    """A counter per replica and one more label, each series at 0 from the start for every
    member of the pool and every value of ``values`` (see "Born at zero"); rendered by
    ``_ReplicaCounters`` at scrape time, updated from the event loop only. A removed
    replica's series stay: its last counts are part of every window that saw them."""

    def __init__(self, name: str, doc: str, label: str, values: Sequence[str]) -> None:
        self.name, self.doc, self.label, self.values = name, doc, label, tuple(values)
        self._counts: dict[tuple[str, str], _LoopCounter] = {}

    def labels(self, replica: str, value: str) -> _LoopCounter:
        counter = self._counts.get((replica, value))
        if counter is None:
            counter = self._counts[(replica, value)] = _LoopCounter()
        return counter

    def family(self, members: Iterable[int]) -> CounterMetricFamily:
        for index in members:
            for value in self.values:
                self.labels(str(index), value)
        family = CounterMetricFamily(self.name, self.doc, labels=["replica", self.label])
        for (replica, value), counter in sorted(self._counts.items()):
            family.add_metric([replica, value], counter.value)
        return family


class _ReplicaCounters(Collector):
    """The per-replica counters, over the pool's members at each scrape (so a replica
    that discovery adds is at 0 from the first scrape that knows it)."""

    def __init__(
        self, members: Callable[[], Iterable[int]], counters: Sequence[_ReplicaCounter]
    ) -> None:
        self._members = members
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        members = list(self._members())
        for counter in self._counters:
            yield counter.family(members)


class _BuildCollector(Collector):
    """``gateway_build_info``: what is running (the version and commit ``rollout-gateway
    --version`` prints, and the Python), constant for the process's life."""

    def __init__(self) -> None:
        self._labels = [__version__, platform.python_version(), build_commit()]

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gateway_build_info",
            "1, labelled with the gateway's version, the Python it runs on and the commit "
            "it was built from.",
            labels=["version", "python", "commit"],
        )
        info.add_metric(self._labels, 1.0)
        yield info


class _AdapterCollector(Collector):
    """Scrape-time view of the adapter registry: live versions per family (families are
    few and operator-chosen), version lag and state per replica, evictions."""

    def __init__(self, managers: Callable[[], Sequence[AdapterManager]]) -> None:
        self._managers = managers

    def collect(self) -> Iterator[Metric]:
        snaps = [m.snapshot() for m in self._managers()]
        live = GaugeMetricFamily(
            "gateway_adapter_live_versions",
            "Adapter versions live on every replica, per family.",
            labels=["family"],
        )
        for family, count in sorted(f for snap in snaps for f in snap.live_versions.items()):
            live.add_metric([family], count)
        lag = GaugeMetricFamily(
            "gateway_adapter_version_lag",
            "Newest live version minus the newest version a replica holds.",
            labels=["replica"],
        )
        synced = GaugeMetricFamily(
            "gateway_adapter_replica_synced",
            "1 if the replica holds every live adapter (adapter traffic allowed).",
            labels=["replica"],
        )
        # Multi-run: a replica is in every registry of a run homed there; the worst counts.
        lags: dict[int, int] = {}
        up: dict[int, bool] = {}
        for snap in snaps:
            for replica in snap.replicas:
                i = replica.index
                lags[i] = max(lags.get(i, 0), replica.version_lag)
                up[i] = up.get(i, True) and replica.state == "up"
        for i in sorted(lags):
            lag.add_metric([str(i)], lags[i])
            synced.add_metric([str(i)], 1.0 if up[i] else 0.0)
        evictions = CounterMetricFamily(
            "gateway_adapter_evictions",
            "Adapter versions evicted by the gateway's staleness window.",
        )
        evictions.add_metric([], sum(snap.counts.get("evict.stale", 0) for snap in snaps))
        drift = CounterMetricFamily(
            "gateway_adapter_drift",
            "Adapters found by the periodic audit to differ from the registry on a healthy "
            "replica (stray, missing, moved), each then reconciled.",
            labels=["kind"],
        )
        for kind in ("stray", "missing", "moved"):
            drift.add_metric([kind], sum(snap.counts.get(f"audit.{kind}", 0) for snap in snaps))
        yield from (live, lag, synced, evictions, drift)


class _RouterCollector(Collector):
    """Size of the prefix router's learned index (bounded by its configured capacity)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        stats = self._router.stats()
        if stats is None:  # a policy with no index
            return
        entries = GaugeMetricFamily(
            "gateway_routing_index_entries",
            "Entries in the prefix router's index, by kind.",
            labels=["kind"],
        )
        entries.add_metric(["served"], stats.served)
        entries.add_metric(["nodes"], stats.nodes)
        entries.add_metric(["templates"], stats.templates)
        size = GaugeMetricFamily(
            "gateway_routing_index_bytes", "Approximate memory held by the prefix index."
        )
        size.add_metric([], stats.approx_bytes)
        yield entries
        yield size


class Metrics:
    """The gateway's metrics plus ``record_*`` helpers used by the I/O shell."""

    def __init__(self, members: Callable[[], Iterable[int]]) -> None:
        """``members``: the pool's replica indices now, read at each scrape: every
        per-replica counter has a series at 0 for each of them ("Born at zero")."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._loop = _LoopMetrics()
        r.register(self._loop)
        self.upstream_errors = _ReplicaCounter(
            "gateway_upstream_errors",
            "Failed requests and control calls to a replica, by kind (refused, dns, tls, "
            "connect_timeout, reset, timeout, ...); health probes count in "
            "gateway_health_probes_total instead.",
            "kind",
            UPSTREAM_ERROR_KINDS,
        )
        self.health_probes = _ReplicaCounter(
            "gateway_health_probes",
            "Active /health probes of each replica, by result (ok, unhealthy, timeout, "
            "unreachable).",
            "result",
            tuple(ProbeResult),
        )
        r.register(_ReplicaCounters(members, (self.upstream_errors, self.health_probes)))
        self.retries = Counter(
            "gateway_upstream_retries_total",
            "Requests re-sent to another replica before any response byte arrived.",
            registry=r,
        )
        self.ejections = Counter(
            "gateway_replica_ejections_total",
            "Times a replica was taken out of rotation, by cause (probe, passive, outlier).",
            ["replica", "cause"],
            registry=r,
        )
        self.broadcasts = Counter(
            "gateway_broadcasts_total",
            "Fan-out calls by endpoint and outcome (ok, failed).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.routing_moved = Counter(
            "gateway_routing_new_key_moved_total",
            "New prompts placed past their ring home because it was over the load bound.",
            registry=r,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects_total",
            "Client disconnects that cancelled an upstream request.",
            registry=r,
        )
        self.adapter_loads = Counter(
            "gateway_adapter_loads_total",
            "Adapter load transactions by outcome (ok, rejected, not_found_timeout, ...).",
            ["outcome"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "gateway_adapter_load_seconds",
            "Time from a load request until the adapter was live everywhere (or failed).",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_load_retries = Counter(
            "gateway_adapter_load_retries_total",
            "Per-replica load retries because the adapter was not visible yet (mount lag).",
            registry=r,
        )
        self.adapter_unloads = Counter(
            "gateway_adapter_unloads_total",
            "Per-replica adapter unloads by outcome.",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "gateway_rejected_requests_total",
            "Requests refused before reaching a replica, by limit (in_flight, "
            "client_in_flight, header_bytes, header_count, json_depth, n, max_tokens, body).",
            ["reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "gateway_retry_budget_exhausted_total",
            "Retryable failures answered to the client because the retry budget was spent.",
            registry=r,
        )
        self.aborted = Counter(
            "gateway_ejection_aborted_requests_total",
            "Requests in flight to a replica when it was ejected (retried or stream ended).",
            registry=r,
        )
        self.retired_rollouts = Counter(
            "gateway_retired_version_rollouts_total",
            "Rollouts that named a version older than every live one of its family, served "
            "by the oldest live one (docs/adapters.md, 'Retired versions').",
            registry=r,
        )
        r.register(_BuildCollector())
        # process_* (CPU, memory, fds, start time) and python_info, read from /proc at
        # scrape time only; with ``--workers N`` the merged /metrics keeps the owner's.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self._request_children: dict[
            tuple[RouteKind, int], tuple[_LoopCounter, _LoopHistogram]
        ] = {}
        self._routed_children: dict[int, _LoopCounter] = {}
        self._decision_children: dict[str, _LoopCounter] = {}
        self._born_at_zero()

    def _born_at_zero(self) -> None:
        """Every series an alert selects, at 0 before its first event ("Born at zero")."""
        for route in RouteKind:
            for status_class in STATUS_CLASSES:
                self._loop.requests.setdefault((route.value, status_class), _LoopCounter())
        for outcome in ("ok", *Failure):
            self.adapter_loads.labels(outcome)
        self.adapter_load_seconds.labels("ok")
        for result in Outcome:
            self.adapter_unloads.labels(result.value)
        for endpoint in CONTROL_CALLS:
            for outcome in ("ok", "failed"):
                self.broadcasts.labels(endpoint, outcome)
        for reason in ADMISSION_REFUSALS:
            self.rejected.labels(reason)

    def watch(self, collector: Collector) -> None:
        """Read ``collector`` at every scrape (the pool's, the breakers', the fleet's
        control, each run's: parts above this module, made by the app)."""
        self.registry.register(collector)

    def watch_router(self, router: Router) -> None:
        self.registry.register(_RouterCollector(router))

    def record_decision(self, decision: Decision, seconds: float) -> None:
        child = self._decision_children.get(decision.reason)
        if child is None:
            reason = decision.reason.value
            child = self._loop.decisions.setdefault(reason, _LoopCounter())
            self._decision_children[decision.reason] = child
        child.inc()
        self._loop.decision_seconds.observe(seconds)
        if decision.moved_by_load:
            self.routing_moved.inc()

    def watch_adapters(self, managers: Callable[[], Sequence[AdapterManager]]) -> None:
        self.registry.register(_AdapterCollector(managers))

    def record_adapter_settlement(self, settled: Settlement) -> None:
        # A failure without a cause is a refusal, as the registry counts it (``_settle``).
        outcome = "ok" if settled.ok else (settled.failure or Failure.REJECTED).value
        self.adapter_loads.labels(outcome).inc()
        self.adapter_load_seconds.labels(outcome).observe(settled.seconds)

    def record_adapter_action(self, action: Action, result: Result) -> None:
        from gateway.adapters.state import LoadOnReplica, Outcome

        if isinstance(action, LoadOnReplica):
            if result.outcome is Outcome.NOT_FOUND:
                self.adapter_load_retries.inc()
        else:
            self.adapter_unloads.labels(result.outcome.value).inc()

    def routing_counts(self) -> dict[str, float]:
        return {reason: counter.value for reason, counter in self._loop.decisions.items()}

    def record_request(self, route: RouteKind, status: int, seconds: float) -> None:
        key = (route, status // 100)
        children = self._request_children.get(key)
        if children is None:  # one dict lookup per request, not one per metric
            loop = self._loop
            children = self._request_children[key] = (
                loop.requests.setdefault((route.value, f"{status // 100}xx"), _LoopCounter()),
                loop.request_seconds.setdefault(route.value, _LoopHistogram(_LATENCY_BUCKETS)),
            )
        children[0].inc()
        children[1].observe(seconds)

    def record_routed(self, replica: int) -> None:
        child = self._routed_children.get(replica)
        if child is None:
            child = self._loop.routed.setdefault(str(replica), _LoopCounter())
            self._routed_children[replica] = child
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
