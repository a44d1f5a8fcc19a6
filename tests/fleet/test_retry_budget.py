"""The retry budget: a floor per second, plus a share of the traffic, over a sliding window."""

from __future__ import annotations

import pytest

from gateway.fleet.retry_budget import Buckets, RetryBudget


def spend(budget: RetryBudget, now: float, limit: int = 10_000) -> int:
    granted = 0
    while granted < limit and budget.try_retry(now):
        granted += 1
    return granted


def test_floor_without_traffic() -> None:
    assert spend(RetryBudget(ratio=0.2, min_per_s=3, window_s=10), 100.0) == 30


def test_ratio_grows_with_requests() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=0, window_s=10)
    for _ in range(500):
        budget.record_request(100.0)
    assert spend(budget, 100.5) == 100


def test_window_slides() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=1, window_s=10)
    assert spend(budget, 100.0, limit=4) == 4
    assert spend(budget, 105.0) == 6  # the same window: 10 in all
    assert spend(budget, 109.9) == 0
    assert spend(budget, 110.0) == 4  # the 100 s bucket expired, the 105 s one did not
    assert spend(budget, 500.0) == 10  # a long gap clears everything


def test_outage_amplification_is_bounded() -> None:
    """Every request fails and wants a retry: retries stay at ratio x requests + floor."""
    budget = RetryBudget(ratio=0.2, min_per_s=1, window_s=10)
    granted = 0
    for k in range(10_000):
        now = 1000 + k / 1000  # 1,000 req/s for 10 s
        budget.record_request(now)
        granted += budget.try_retry(now)
    assert granted <= 0.2 * 10_000 + 10 + 1


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        RetryBudget(ratio=-1)
    with pytest.raises(ValueError):
        RetryBudget(window_s=0)


def test_the_window_lives_in_the_buckets_it_is_given() -> None:
    """The storage is the constructor's (``fleet.shared`` passes shared cells)."""
    buckets = Buckets(3)
    budget = RetryBudget(ratio=0.5, min_per_s=0.0, window_s=3, buckets=buckets)
    for _ in range(4):
        budget.record_request(7.0)
    assert budget.try_retry(8.0)
    assert (list(buckets.requests), list(buckets.retries), buckets.second) == (
        [0, 4, 0], [0, 0, 1], 8
    )  # fmt: skip
    with pytest.raises(ValueError):
        RetryBudget(window_s=10, buckets=Buckets(5))
