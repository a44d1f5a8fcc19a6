"""Admission: the global in-flight cap and the per-client cap."""

from __future__ import annotations

from gateway.fleet.admission import Admission, Refusal


def test_global_cap() -> None:
    a = Admission(max_in_flight=2, max_per_client=None)
    assert a.enter(b"x") is None and a.enter(b"y") is None
    assert a.enter(b"z") is Refusal.IN_FLIGHT
    a.leave(b"x")
    assert a.enter(b"z") is None
    assert a.in_flight == 2


def test_per_client_cap_and_table_cleanup() -> None:
    a = Admission(max_in_flight=None, max_per_client=1)
    assert a.enter(b"a") is None
    assert a.enter(b"a") is Refusal.CLIENT_IN_FLIGHT
    assert a.enter(b"b") is None
    assert a.clients() == 2
    a.leave(b"a")
    a.leave(b"b")
    assert a.clients() == 0 and a.in_flight == 0
    assert a.enter(b"a") is None


def test_refused_request_holds_nothing() -> None:
    a = Admission(max_in_flight=10, max_per_client=1)
    assert a.enter(b"a") is None
    for _ in range(5):
        assert a.enter(b"a") is Refusal.CLIENT_IN_FLIGHT
    assert a.in_flight == 1
