"""The outlier breaker: ejection, doubling backoff, half-open trials, fleet-share cap."""

from __future__ import annotations

from gateway.fleet.outliers import (
    BreakerState,
    LocalBreakers,
    OutlierDetector,
    OutlierEvent,
    is_failure,
)


def detector(**kw: float) -> OutlierDetector:
    args: dict[str, float] = {
        "consecutive_errors": 3,
        "base_ejection_s": 10.0,
        "max_ejection_s": 35.0,
        "max_ejected_fraction": 0.5,
    }
    args.update(kw)
    return OutlierDetector(
        consecutive_errors=int(args["consecutive_errors"]),
        base_ejection_s=args["base_ejection_s"],
        max_ejection_s=args["max_ejection_s"],
        max_ejected_fraction=args["max_ejected_fraction"],
    )


def fail(d: OutlierDetector, index: int, times: int, now: float, members: int = 4) -> list[object]:
    return [d.record(index, 500, now, members) for _ in range(times)]


def test_failure_statuses() -> None:
    assert is_failure(500) and is_failure(503) and is_failure(429)
    assert not is_failure(200) and not is_failure(400) and not is_failure(404)


def test_consecutive_errors_eject_and_success_resets_the_count() -> None:
    d = detector()
    assert fail(d, 0, 2, 0.0) == [None, None]
    assert d.record(0, 200, 0.0, 4) is None  # the streak is broken
    assert fail(d, 0, 2, 0.0) == [None, None]
    assert d.routable([0, 1], 0.0) == [0, 1]
    assert d.record(0, 429, 0.0, 4) is OutlierEvent.EJECTED
    assert d.routable([0, 1], 1.0) == [1]
    assert d.states()[0] is BreakerState.OPEN


def test_half_open_allows_one_trial_and_success_closes() -> None:
    d = detector()
    fail(d, 0, 3, 0.0)
    assert d.routable([0, 1], 9.9) == [1]
    assert d.routable([0, 1], 10.0) == [0, 1]  # half-open now
    assert d.states()[0] is BreakerState.HALF_OPEN
    d.dispatched(0)
    assert d.routable([0, 1], 10.1) == [1]  # one trial at a time
    assert d.record(0, 200, 10.2, 4) is OutlierEvent.RESTORED
    assert d.routable([0, 1], 10.3) == [0, 1]
    assert d.states()[0] is BreakerState.CLOSED


def test_failed_trial_reopens_with_doubled_time_capped() -> None:
    d = detector()
    fail(d, 0, 3, 0.0)  # open until 10
    assert d.routable([0], 10.0) == [0]
    d.dispatched(0)
    assert d.record(0, 502, 10.0, 4) is OutlierEvent.EJECTED  # open until 30
    assert d.routable([0, 1], 29.9) == [1]
    assert d.routable([0, 1], 30.0) == [0, 1]
    d.dispatched(0)
    assert d.record(0, 502, 30.0, 4) is OutlierEvent.EJECTED  # 40 s, capped at 35
    assert d.routable([0, 1], 64.9) == [1]
    assert d.routable([0, 1], 65.0) == [0, 1]


def test_abandoned_trial_frees_the_slot_without_judging() -> None:
    d = detector()
    fail(d, 0, 3, 0.0)
    assert d.routable([0], 10.0) == [0]
    d.dispatched(0)
    assert d.routable([0], 10.0) == []
    d.abandoned(0)
    assert d.routable([0], 10.0) == [0]
    assert d.states()[0] is BreakerState.HALF_OPEN


def test_late_success_from_before_the_ejection_does_not_restore() -> None:
    d = detector()
    fail(d, 0, 3, 0.0)
    assert d.record(0, 200, 1.0, 4) is None
    assert d.routable([0, 1], 1.0) == [1]


def test_never_ejects_more_than_the_allowed_share() -> None:
    d = detector()
    assert fail(d, 0, 3, 0.0, members=2)[-1] is OutlierEvent.EJECTED
    assert fail(d, 1, 5, 0.0, members=2) == [None] * 5  # 1 of 2 is the cap
    assert d.routable([0, 1], 1.0) == [1]
    single = detector()
    assert fail(single, 0, 10, 0.0, members=1) == [None] * 10  # the last replica stays


def test_disabled_and_forget() -> None:
    off = detector(consecutive_errors=0)
    assert fail(off, 0, 20, 0.0) == [None] * 20
    d = detector()
    fail(d, 0, 3, 0.0)
    d.forget(0)
    assert d.routable([0, 1], 1.0) == [0, 1]
    assert fail(d, 1, 3, 2.0)[-1] is OutlierEvent.EJECTED  # the share counter was released


def test_the_breakers_live_in_the_store_it_is_given() -> None:
    """The storage is the constructor's (``fleet.shared`` passes shared cells)."""
    store = LocalBreakers()
    d = OutlierDetector(consecutive_errors=1, store=store)
    assert d.record(0, 500, 0.0, 4) is OutlierEvent.EJECTED
    b = store.get(0)
    assert store.open == 1 and b is not None and b.state is BreakerState.OPEN
    d.forget(0)
    assert store.open == 0 and store.get(0) is None
