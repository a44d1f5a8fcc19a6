"""One ``/metrics`` and one ``/gateway/status`` for the owner and its workers."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.metrics import RouteKind
from gateway.routing.policy import Decision, Reason
from gateway.runs.mode import WorkerRuns
from gateway.workers.merge import add_workers, merge_expositions
from gateway.workers.snapshot import SnapshotFeed
from gateway.workers.worker import Follower, OwnerLink

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str | bytes) -> Samples:
    """Every sample of an exposition, by name and labels (parsing it is the check that it
    is well-formed)."""
    if isinstance(text, bytes):
        text = text.decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"{key} twice"
            out[key] = s.value
    return out


def types(text: str | bytes) -> dict[str, str]:
    if isinstance(text, bytes):
        text = text.decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def gateway(tmp_path: Path | None = None) -> Gateway:
    overrides: dict[str, Any] = {"replicas": ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]}
    if tmp_path is not None:
        runs = []
        for name in ("run-a", "run-b"):
            (tmp_path / name).mkdir(exist_ok=True)
            runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                         "max_staleness": 1})  # fmt: skip
        overrides["runs"] = runs
    return build_gateway(load_settings(overrides, environ={}))


def rollouts(gw: Gateway, seconds: list[float], replica: int, status: int = 200) -> None:
    for s in seconds:
        gw.metrics.record_request(RouteKind.ROUTED, status, s)
        gw.metrics.record_routed(replica)
        gw.metrics.record_decision(Decision(replica, Reason.RING), 2e-5)


# --------------------------------------------------------------- real expositions


@pytest.fixture
def three() -> tuple[Gateway, Gateway, Gateway]:
    """An owner (which saw one rollout, and knows replica 0 is healthy) and two workers."""
    owner, w1, w2 = gateway(), gateway(), gateway()
    owner.pool.admit(0)
    rollouts(owner, [0.003], replica=0)
    rollouts(w1, [0.2, 0.2, 7.0], replica=1)
    rollouts(w1, [0.04], replica=1, status=503)
    rollouts(w2, [0.0004], replica=0)
    owner.pool.acquire(0)
    w1.pool.acquire(1)
    w1.pool.acquire(1)
    w2.pool.acquire(0)
    w2.pool.acquire(1)
    owner.metrics.retries.inc()
    w2.metrics.retries.inc(2)
    return owner, w1, w2


def merged(owner: Gateway, *workers: Gateway) -> Samples:
    out = merge_expositions(owner.metrics.render().decode(),
                            [w.metrics.render().decode() for w in workers])  # fmt: skip
    return samples(out)


def test_counters_are_summed(three: tuple[Gateway, Gateway, Gateway]) -> None:
    m = merged(*three)
    route = (("route", "routed"),)
    assert m[("gateway_requests_total", (*route, ("status_class", "2xx")))] == 1 + 3 + 1
    assert m[("gateway_requests_total", (*route, ("status_class", "5xx")))] == 1
    assert m[("gateway_replica_routed_requests_total", (("replica", "0"),))] == 1 + 1
    assert m[("gateway_replica_routed_requests_total", (("replica", "1"),))] == 4
    assert m[("gateway_routing_decisions_total", (("reason", "ring"),))] == 6
    assert m[("gateway_upstream_retries_total", ())] == 3


def test_histograms_are_summed_bucket_by_bucket(three: tuple[Gateway, Gateway, Gateway]) -> None:
    m = merged(*three)
    parts = [samples(g.metrics.render()) for g in three]
    name = "gateway_request_duration_seconds"
    buckets = [k for k in m if k[0] == f"{name}_bucket"]
    assert len(buckets) == 20  # 19 bounds and +Inf, for route="routed"
    for key in buckets:
        assert m[key] == sum(p.get(key, 0.0) for p in parts), key
    route = (("route", "routed"),)
    assert m[(f"{name}_bucket", (("le", "0.0005"), *route))] == 1  # w2's 0.4 ms
    assert m[(f"{name}_bucket", (("le", "0.005"), *route))] == 2  # + the owner's 3 ms
    assert m[(f"{name}_bucket", (("le", "5.0"), *route))] == 5  # + w1's 40 ms, 200 ms x 2
    assert m[(f"{name}_bucket", (("le", "+Inf"), *route))] == 6
    assert m[(f"{name}_count", route)] == 6
    assert m[(f"{name}_sum", route)] == pytest.approx(0.003 + 0.4 + 7.0 + 0.04 + 0.0004)
    assert m[("gateway_routing_decision_seconds_count", ())] == 6
    # still cumulative: every bucket holds the ones below it
    ordered = sorted(buckets, key=lambda k: float(dict(k[1])["le"]))
    values = [m[k] for k in ordered]
    assert values == sorted(values)


def test_in_flight_gauges_are_summed_other_gauges_are_the_owners(
    three: tuple[Gateway, Gateway, Gateway],
) -> None:
    m = merged(*three)
    assert m[("gateway_replica_in_flight_requests", (("replica", "0"),))] == 1 + 1
    assert m[("gateway_replica_in_flight_requests", (("replica", "1"),))] == 2 + 1
    # Health is the owner's (the workers have not followed any snapshot here: all down)
    assert m[("gateway_replica_healthy", (("replica", "0"),))] == 1.0
    assert m[("gateway_replica_healthy", (("replica", "1"),))] == 0.0
    types_out = types(merge_expositions(three[0].metrics.render().decode(), []))
    assert types_out["gateway_replica_healthy"] == "gauge"
    assert types_out["gateway_requests"] == "counter"
    assert types_out["gateway_request_duration_seconds"] == "histogram"


def test_owner_alone_is_unchanged(three: tuple[Gateway, Gateway, Gateway]) -> None:
    owner = three[0].metrics.render()
    out = merge_expositions(owner.decode(), [])
    assert samples(out) == samples(owner)
    assert types(out) == types(owner)


def test_worker_with_nothing_to_add_changes_nothing(
    three: tuple[Gateway, Gateway, Gateway],
) -> None:
    owner = three[0].metrics.render().decode()
    idle = gateway().metrics.render().decode()
    assert samples(merge_expositions(owner, [idle, idle])) == samples(owner)


def test_multi_run_gauges(tmp_path: Path) -> None:
    owner, w1, w2 = (gateway(tmp_path) for _ in range(3))
    for gw in (owner, w1, w2):
        gw.tenancy.place(gw.pool.indices(), 3)
    owner.tenancy.tenants["run-a"].hold("mode=keep")  # the owner decides pauses
    w1.tenancy.tenants["run-a"].in_flight = 2
    w1.tenancy.tenants["run-a"].requests = 5
    w2.tenancy.tenants["run-a"].in_flight = 1
    w2.tenancy.tenants["run-b"].in_flight = 4
    w2.tenancy.tenants["run-b"].requests = 9
    m = merged(owner, w1, w2)
    a, b = (("run", "run-a"),), (("run", "run-b"),)
    assert m[("gateway_run_in_flight", a)] == 3
    assert m[("gateway_run_in_flight", b)] == 4
    assert m[("gateway_run_requests_total", a)] == 5
    assert m[("gateway_run_requests_total", b)] == 9
    assert m[("gateway_run_paused", a)] == 1.0  # the owner's, not summed, not a worker's 0
    assert m[("gateway_run_paused", b)] == 0.0
    homes = {r: m[("gateway_run_home_replicas", k)] for r, k in (("a", a), ("b", b))}
    assert homes == {"a": 1.0, "b": 1.0}  # the owner's placement, not 3x


# ------------------------------------------------------------- hand-written edges

OWNER = """\
# HELP x_total Things.
# TYPE x_total counter
x_total{reason="a\\"b\\\\c\\nd"} 1.0
x_total{reason="plain"} 2.0
# HELP lat_seconds Latency.
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 1.0
lat_seconds_bucket{le="1.0"} 2.0
lat_seconds_bucket{le="+Inf"} 2.0
lat_seconds_sum 0.6
lat_seconds_count 2.0
# HELP gateway_replica_healthy 1 if in rotation.
# TYPE gateway_replica_healthy gauge
gateway_replica_healthy{replica="0"} 1.0
# HELP gateway_replica_breaker_state Breaker.
# TYPE gateway_replica_breaker_state gauge
gateway_replica_breaker_state{replica="0"} 2.0
# HELP gateway_routing_index_bytes Index size.
# TYPE gateway_routing_index_bytes gauge
gateway_routing_index_bytes 100.0
"""

WORKER = """\
# HELP x_total Things.
# TYPE x_total counter
x_total{reason="a\\"b\\\\c\\nd"} 10.0
x_total{reason="worker-only"} 4.0
# HELP lat_seconds Latency.
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 0.0
lat_seconds_bucket{le="1.0"} 3.0
lat_seconds_bucket{le="+Inf"} 4.0
lat_seconds_sum 5.5
lat_seconds_count 4.0
# HELP gateway_replica_healthy 1 if in rotation.
# TYPE gateway_replica_healthy gauge
gateway_replica_healthy{replica="0"} 0.0
gateway_replica_healthy{replica="1"} 1.0
# HELP gateway_replica_breaker_state Breaker.
# TYPE gateway_replica_breaker_state gauge
gateway_replica_breaker_state{replica="0"} 0.0
# HELP gateway_routing_index_bytes Index size.
# TYPE gateway_routing_index_bytes gauge
gateway_routing_index_bytes 50.0
# HELP only_workers_total Counted in workers alone.
# TYPE only_workers_total counter
only_workers_total{replica="1"} 3.0
# HELP only_workers_seconds A histogram only workers have.
# TYPE only_workers_seconds histogram
only_workers_seconds_bucket{le="1.0"} 1.0
only_workers_seconds_bucket{le="+Inf"} 1.0
only_workers_seconds_sum 0.5
only_workers_seconds_count 1.0
# HELP gateway_run_in_flight Rollouts in flight.
# TYPE gateway_run_in_flight gauge
gateway_run_in_flight{run="r"} 2.0
"""


def test_hand_written_edges() -> None:
    m = samples(merge_expositions(OWNER, [WORKER, WORKER]))
    assert m[("x_total", (("reason", 'a"b\\c\nd'),))] == 21  # escaped label value survives
    assert m[("x_total", (("reason", "plain"),))] == 2
    assert m[("x_total", (("reason", "worker-only"),))] == 8
    assert m[("lat_seconds_bucket", (("le", "0.1"),))] == 1
    assert m[("lat_seconds_bucket", (("le", "1.0"),))] == 8
    assert m[("lat_seconds_bucket", (("le", "+Inf"),))] == 10
    assert m[("lat_seconds_count", ())] == 10
    assert m[("lat_seconds_sum", ())] == pytest.approx(11.6)
    # the owner's gauges: a worker's other value or extra label set is not taken
    assert m[("gateway_replica_healthy", (("replica", "0"),))] == 1.0
    assert ("gateway_replica_healthy", (("replica", "1"),)) not in m
    assert m[("gateway_replica_breaker_state", (("replica", "0"),))] == 2.0
    assert m[("gateway_routing_index_bytes", ())] == 200  # held in memory: summed
    # families only workers export
    assert m[("only_workers_total", (("replica", "1"),))] == 6
    assert m[("only_workers_seconds_count", ())] == 2
    assert m[("only_workers_seconds_bucket", (("le", "+Inf"),))] == 2
    assert m[("gateway_run_in_flight", (("run", "r"),))] == 4


def test_help_and_type_survive() -> None:
    out = merge_expositions(OWNER, [WORKER]).decode()
    assert "# HELP x_total Things.\n# TYPE x_total counter\n" in out
    assert "# TYPE lat_seconds histogram\n" in out
    assert "# TYPE only_workers_total counter\n" in out
    kinds = types(out)
    assert kinds["gateway_replica_healthy"] == "gauge"
    assert kinds["only_workers_seconds"] == "histogram"


def test_special_values() -> None:
    owner = "# TYPE g gauge\ng NaN\n# TYPE c_total counter\nc_total 1.0\n"
    worker = "# TYPE g gauge\ng 3.0\n# TYPE c_total counter\nc_total +Inf\n"
    m = samples(merge_expositions(owner, [worker]))
    assert math.isnan(m[("g", ())])  # the owner's, even NaN
    assert m[("c_total", ())] == math.inf


# ----------------------------------------------------------------------- status


def test_add_workers_sums_per_replica_and_routing() -> None:
    owner, w3, w1 = gateway(), gateway(), gateway()
    owner.pool.acquire(0)
    rollouts(owner, [0.01], replica=0)
    w1.pool.acquire(0)
    w1.pool.acquire(1)
    w1.pool.release(1)  # served 1, none in flight
    w1.ledger.admission.in_flight = 1
    rollouts(w1, [0.01, 0.02], replica=1)
    w3.pool.acquire(1)
    w3.pool.acquire(1)
    w3.ledger.admission.in_flight = 2
    w3.metrics.record_decision(Decision(0, Reason.SPILL), 1e-5)
    owner.ledger.admission.in_flight = 1

    status = owner.status()
    before = {r["index"]: (r["in_flight"], r["served"]) for r in status["replicas"]}
    assert before == {0: (1, 1), 1: (0, 0)}
    # what a worker answers, as it arrives over the channel
    followers = [Follower(gw, k, "/nonexistent", OwnerLink(), SnapshotFeed(),
                          WorkerRuns(gw.tenancy, 1.0)) for k, gw in ((3, w3), (1, w1))]  # fmt: skip
    workers = [orjson.loads(orjson.dumps(f.status())) for f in followers]
    add_workers(status, workers)
    after = {r["index"]: (r["in_flight"], r["served"]) for r in status["replicas"]}
    assert after == {0: (1 + 1, 1 + 1), 1: (0 + 0 + 2, 0 + 1 + 2)}
    assert status["in_flight"] == 1 + 1 + 2
    assert status["routing"] == {"ring": 1 + 2, "spill": 1}
    assert [w["worker"] for w in status["workers"]] == [1, 3]
    assert set(status["workers"][0]) == {"worker", "pid", "snapshot", "in_flight", "routed"}
    assert [w["routed"] for w in status["workers"]] == [2, 2]  # acquired: served
    assert status["workers"][0]["in_flight"] == 1 and status["workers"][1]["in_flight"] == 2
    assert status["workers"][0]["snapshot"] is None  # it never followed a snapshot
    assert orjson.loads(orjson.dumps(status))["workers"] == status["workers"]


def test_add_workers_ignores_replicas_the_owner_does_not_list() -> None:
    status: dict[str, Any] = {
        "replicas": [{"index": 0, "in_flight": 1, "served": 5}],
        "in_flight": 1,
        "routing": {},
    }
    add_workers(status, [{
        "worker": 0, "pid": 10, "snapshot": 4, "in_flight": 3, "routed": 8,
        "replicas": {"0": [2, 7], "9": [1, 1]}, "routing": {"fallback": 3},
    }])  # fmt: skip
    assert status["replicas"] == [{"index": 0, "in_flight": 3, "served": 12}]
    assert status["routing"] == {"fallback": 3}
    assert status["workers"] == [
        {"worker": 0, "pid": 10, "snapshot": 4, "in_flight": 3, "routed": 8}
    ]


def test_add_workers_with_no_workers() -> None:
    status: dict[str, Any] = {"replicas": [{"index": 0, "in_flight": 1, "served": 5}],
                              "in_flight": 1, "routing": {"ring": 2}}  # fmt: skip
    add_workers(status, [])
    assert status == {"replicas": [{"index": 0, "in_flight": 1, "served": 5}],
                      "in_flight": 1, "routing": {"ring": 2}, "workers": [],
                      "owner_pid": os.getpid()}  # fmt: skip
