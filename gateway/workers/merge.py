"""One ``/metrics`` for the whole gateway: the owner's scrape plus every worker's.

Why not prometheus-client's multiprocess mode: most of the gateway's series are custom
collectors read at scrape time (pool, adapters, breakers, runs), which that mode does not
aggregate, and it needs an environment variable set before the library is imported.
Instead the owner asks each worker for its own exposition and adds them up here:

* counters and histograms (every bucket, ``_sum`` and ``_count``) are summed;
* gauges that count things in flight or held in memory are summed;
* every other gauge is the owner's (health, adapters, placement, the fleet's pause,
  replica addresses, build info: control state the owner alone decides and the workers
  only copy; breakers, which every process shares);
* ``process_*`` and ``python_*`` are the owner's too, counters included: they describe
  the process that answered, and a sum over processes means nothing for some (start
  time, fd limit) and overstates others (forked processes share pages, so their RSS
  does not add up). The whole gateway's CPU and memory are the container's metrics.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["add_workers", "merge_expositions"]

_SUMMED_GAUGES = frozenset({
    "gateway_replica_in_flight_requests",
    "gateway_run_in_flight",
    "gateway_run_fair_slots",
    "gateway_run_fair_waiting",
    "gateway_routing_index_entries",
    "gateway_routing_index_bytes",
})  # fmt: skip

_Key = tuple[str, tuple[tuple[str, str], ...]]


_OWNERS_PREFIXES = ("process_", "python_")


def _rule(family: Metric) -> str:
    if family.name.startswith(_OWNERS_PREFIXES):
        return "owner"
    if family.type == "gauge":
        return "sum" if family.name in _SUMMED_GAUGES else "owner"
    return "sum"


def merge_expositions(owner: str, workers: Sequence[str]) -> bytes:
    """The owner's exposition text with every worker's folded in (the rules above)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[_Key, float]] = {}
    for position, text in enumerate((owner, *workers)):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type)  # fmt: skip
                values[family.name] = {}
            rule = _rule(merged)
            if rule == "owner" and position:
                continue
            into = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                into[key] = into.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families.values()))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def add_workers(status: dict[str, Any], workers: Sequence[Mapping[str, Any]]) -> None:
    """``/gateway/status`` of the whole gateway: the workers' rollouts counted in, and
    each worker listed (its pid, its control snapshot, its requests in flight and routed
    so far), and the owner's pid."""
    by_index = {r["index"]: r for r in status["replicas"]}
    routing: dict[str, float] = dict(status.get("routing", {}))
    for worker in workers:
        status["in_flight"] += worker["in_flight"]
        for index, (in_flight, served) in worker["replicas"].items():
            if (entry := by_index.get(int(index))) is not None:
                entry["in_flight"] += in_flight
                entry["served"] += served
        for reason, count in worker["routing"].items():
            routing[reason] = routing.get(reason, 0) + count
    status["routing"] = routing
    status["owner_pid"] = os.getpid()
    status["workers"] = sorted(
        ({k: w[k] for k in ("worker", "pid", "snapshot", "in_flight", "routed")} for w in workers),
        key=lambda w: w["worker"],
    )
