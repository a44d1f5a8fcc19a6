"""``Selection``: the candidate set and the choice, on a gateway built as a data-plane
worker builds it (its runs read their adapters from snapshots, ``SnapshotFeed``), so that
each test states the adapter table it routes by."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.errors import NotFound, UpstreamUnavailable
from gateway.routing.policy import Reason
from gateway.workers.snapshot import ControlSnapshot, RunView, SnapshotFeed

BASE = frozenset({"base"})


def worker(
    adapters: dict[str, frozenset[int]], live: frozenset[str]
) -> tuple[Gateway, SnapshotFeed]:
    feed = SnapshotFeed()
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
    settings = load_settings({"replicas": urls, "router": "least_loaded"}, environ={})
    gw = build_gateway(settings, routes=feed)
    for i in range(3):
        gw.pool.admit(i)
    follow(feed, adapters, live)
    return gw, feed


def follow(feed: SnapshotFeed, adapters: dict[str, frozenset[int]], live: frozenset[str]) -> None:
    view = RunView("", adapters=adapters, live=live, base_models=BASE)
    feed.follow(ControlSnapshot(1, frozenset({0, 1, 2}), (view,)))


def plan(gw: Gateway, model: str) -> Any:
    payload = {"model": model, "prompt": [1, 2, 3]}
    return gw.selection.rollout("/v1/completions", payload, b"{}", None, gw.tenancy.single())


def test_an_adapter_goes_only_where_it_is_held() -> None:
    gw, _ = worker({"a-v1": frozenset({1, 2})}, frozenset({"a-v1"}))
    chosen = plan(gw, "a-v1")
    assert chosen.candidates == [1, 2] and chosen.routes is not None
    assert chosen.route.lacking_adapter == {0}
    everywhere = plan(gw, "base")
    assert everywhere.candidates == [0, 1, 2] and everywhere.routes is None


def test_no_holder_answers_as_vllm_would() -> None:
    gw, _ = worker({"a-v1": frozenset()}, frozenset({"a-v1"}))
    with pytest.raises(UpstreamUnavailable, match="holds `a-v1`"):
        plan(gw, "a-v1")  # live, but no healthy copy right now
    with pytest.raises(NotFound, match="`nope` does not exist"):
        plan(gw, "nope")


def test_an_open_breaker_and_no_healthy_replica_are_503() -> None:
    gw, _ = worker({}, frozenset())
    for _ in range(gw.settings.outlier_consecutive_errors):
        gw.rotation.record_status(1, 500)
    assert plan(gw, "base").candidates == [0, 2]
    for index in (0, 2):
        gw.rotation.on_connect_failure(index, "connect")
    gw.pool.follow(frozenset())
    with pytest.raises(UpstreamUnavailable, match="No healthy replica"):
        plan(gw, "base")


def test_the_choice_is_counted_and_a_retiring_copy_vetoes_it() -> None:
    gw, feed = worker({"a-v1": frozenset({1, 2})}, frozenset({"a-v1"}))
    chosen = plan(gw, "a-v1")
    remaining = list(chosen.candidates)
    follow(feed, {"a-v1": frozenset({2})}, frozenset({"a-v1"}))  # the copy on 1 retires
    assert gw.selection.take(chosen, remaining) is None  # least loaded: 1, refused
    assert remaining == [2]
    assert gw.selection.take(chosen, remaining) == 2
    assert feed.in_flight[("a-v1", 2)] == 1
    chosen.finished(2)
    assert feed.in_flight[("a-v1", 2)] == 0
    assert gw.metrics.routing_counts() == {Reason.FALLBACK.value: 2}
