"""``Ledger``: every book a request touches, driven without sockets or an event loop.

Each test walks one request's life (enter, attempts, finished, exit) on a gateway built
the way ``serve`` builds it, and checks that every book is back where it started, or
counted where it must be: admission, the run's cap and usage, the pool's in-flight
counts, the abort registry, the breakers, the retry budget and the metrics.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.errors import TooManyRequests, Unauthorized, UpstreamError, UpstreamUnavailable
from gateway.fleet.ledger import Entry
from gateway.fleet.outliers import BreakerState
from gateway.fleet.selection import Plan
from gateway.http.upstream import ReplicaConnectError
from gateway.metrics import RouteKind


class FakeTask:
    """The request's task, as the abort registry sees it: something to cancel, and to
    uncancel once the abort was taken for a retry."""

    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def uncancel(self) -> None:
        self.cancelled = False


@dataclass
class FakeInbound:
    """What the ledger reads of a request: its headers, its peer, its task."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    peer: bytes = b"10.0.0.1"
    task: Any = field(default_factory=FakeTask)

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


def forwarded(gw: Gateway) -> Plan:
    """A FORWARDED request's plan in single-run mode: every routable replica."""
    return gw.selection.forwarded(b"{}", gw.tenancy.single(), orjson.loads)


def gateway(replicas: int = 2, **overrides: object) -> Gateway:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    gw = build_gateway(load_settings({"replicas": urls, **overrides}, environ={}))
    for i in range(replicas):
        gw.pool.admit(i)
    return gw


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def enter(gw: Gateway, inbound: FakeInbound | None = None) -> Entry:
    return gw.ledger.enter(inbound or FakeInbound(), RouteKind.ROUTED)  # type: ignore[arg-type]


def books_closed(gw: Gateway) -> bool:
    return gw.ledger.admission.in_flight == 0 and all(
        r.in_flight == 0 and gw.rotation.tasks.count(r.index) == 0 for r in gw.pool.replicas
    )


def test_one_answered_rollout_opens_and_closes_every_book() -> None:
    gw = gateway()
    entry = enter(gw)
    assert gw.ledger.admission.in_flight == 1 and entry.tenant is not None
    index = gw.ledger.attempt(entry, forwarded(gw))
    assert gw.pool[index].in_flight == 1 and gw.rotation.tasks.count(index) == 1
    gw.ledger.answered(entry, 200)
    gw.ledger.finished(entry, completed=True)
    assert gw.pool[index].in_flight == 0 and gw.pool[index].served == 1
    gw.ledger.exit(entry, 200)
    assert books_closed(gw)
    assert sample(gw, "gateway_requests_total", route="routed", status_class="2xx") == 1
    assert sample(gw, "gateway_replica_routed_requests_total", replica=str(index)) == 1
    assert sample(gw, "gateway_upstream_retries_total") == 0


def test_over_the_limit_is_refused_before_anything_is_counted() -> None:
    gw = gateway(max_in_flight=1)
    first = enter(gw)
    with pytest.raises(TooManyRequests):
        enter(gw)
    assert gw.ledger.admission.in_flight == 1
    assert sample(gw, "gateway_rejected_requests_total", reason="in_flight") == 1
    gw.ledger.exit(first)
    assert books_closed(gw)


def test_a_wrong_key_gives_the_admission_slot_back() -> None:
    gw = gateway(api_key="secret")
    with pytest.raises(Unauthorized):
        enter(gw, FakeInbound({b"authorization": b"Bearer wrong"}))
    assert books_closed(gw)
    entry = enter(gw, FakeInbound({b"authorization": b"Bearer secret"}))
    gw.ledger.exit(entry)
    assert books_closed(gw)


def test_a_refused_connection_retries_elsewhere_within_the_budget() -> None:
    gw = gateway()
    entry = enter(gw)
    plan = forwarded(gw)
    first = gw.ledger.attempt(entry, plan)
    assert gw.ledger.failed(entry, ReplicaConnectError(first, "connect")) is True
    assert gw.pool[first].in_flight == 0 and gw.rotation.tasks.count(first) == 0
    assert sample(gw, "gateway_upstream_errors_total", replica=str(first), kind="connect") == 1
    second = gw.ledger.attempt(entry, plan)
    assert second != first
    assert sample(gw, "gateway_upstream_retries_total") == 1
    gw.ledger.answered(entry, 200)
    gw.ledger.finished(entry, completed=True)
    gw.ledger.exit(entry, 200)
    assert books_closed(gw)
    with pytest.raises(UpstreamUnavailable, match="No healthy replica could take"):
        gw.ledger.attempt(entry, plan)  # both tried: none left


def test_a_spent_retry_budget_ends_the_request() -> None:
    gw = gateway(retry_budget_ratio=0.0, retry_budget_min_per_s=0.0)
    entry = enter(gw)
    plan = forwarded(gw)
    first = gw.ledger.attempt(entry, plan)
    assert gw.ledger.failed(entry, ReplicaConnectError(first, "reset"))
    with pytest.raises(UpstreamUnavailable, match="retry budget is spent"):
        gw.ledger.attempt(entry, plan)
    assert sample(gw, "gateway_retry_budget_exhausted_total") == 1
    gw.ledger.exit(entry)
    assert books_closed(gw)


def test_a_broken_answer_is_not_retried_and_feeds_the_breaker() -> None:
    gw = gateway(outlier_consecutive_errors=1)
    entry = enter(gw)
    index = gw.ledger.attempt(entry, forwarded(gw))
    assert gw.ledger.failed(entry, UpstreamError("broken mid-body")) is False
    assert gw.rotation.outliers.states()[index] is BreakerState.OPEN
    gw.ledger.exit(entry)
    assert books_closed(gw)


def test_an_ejection_aborts_the_attempt_and_a_client_cancel_does_not_retry() -> None:
    gw = gateway()
    entry = enter(gw)
    plan = forwarded(gw)
    index = gw.ledger.attempt(entry, plan)
    assert gw.rotation.tasks.abort(index) == 1  # the health checker ejected it
    assert entry.task.cancelled
    assert gw.ledger.failed(entry, asyncio.CancelledError()) is True
    assert sample(gw, "gateway_ejection_aborted_requests_total") == 1
    gw.ledger.attempt(entry, plan)
    assert gw.ledger.failed(entry, asyncio.CancelledError()) is False  # the client left
    gw.ledger.exit(entry)
    assert books_closed(gw)


def test_a_stream_cut_short_counts_a_disconnect() -> None:
    gw = gateway()
    entry = enter(gw)
    gw.ledger.attempt(entry, forwarded(gw))
    gw.ledger.answered(entry, 200)
    assert entry.ejected() is None  # neither ejected nor aborted: a client that left
    entry.closed(False)  # what the relay calls when the client went away
    gw.ledger.exit(entry)
    assert books_closed(gw)
    assert sample(gw, "gateway_client_disconnects_total") == 1


def test_a_named_runs_cap_usage_and_in_flight(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    run = {"name": "run-a", "key": "key-a", "adapter_root": str(tmp_path / "a"),
           "max_staleness": 1, "max_in_flight": 1}  # fmt: skip
    gw = gateway(runs=[run])
    key = FakeInbound({b"authorization": b"Bearer key-a"})
    entry = enter(gw, key)
    tenant = gw.tenancy.tenants["run-a"]
    assert entry.counted is tenant and tenant.in_flight == 1
    with pytest.raises(TooManyRequests, match="run-a"):
        enter(gw, FakeInbound({b"authorization": b"Bearer key-a"}))
    assert gw.ledger.admission.in_flight == 1  # the refused one gave its slot back
    gw.ledger.exit(entry, 200)
    assert tenant.in_flight == 0 and tenant.usage.rollouts["2xx"] == 1
    assert books_closed(gw)


def test_the_choice_skips_a_replica_whose_adapter_copy_refuses() -> None:
    gw = gateway()

    class Retiring:
        """An adapter copy on replica 0 being retired: it refuses new requests."""

        started: list[int] = []
        finished: list[int] = []

        def request_started(self, name: str, replica: int) -> bool:
            self.started.append(replica)
            return replica != 0

        def request_finished(self, name: str, replica: int) -> None:
            self.finished.append(replica)

        def salt(self, name: str, replica: int) -> str | None:
            return None

    routes = Retiring()
    plan = Plan([0, 1], b"{}", None, routes, "a-v1", {})  # type: ignore[arg-type]
    entry = enter(gw)
    assert gw.ledger.attempt(entry, plan) == 1
    assert routes.started == [0, 1]  # least loaded first: 0, refused
    gw.ledger.answered(entry, 200)
    gw.ledger.finished(entry, completed=True)
    gw.ledger.exit(entry, 200)
    assert routes.finished == [1]
    assert books_closed(gw)
