"""A retry budget: retries may add at most a fixed share to the load (Linkerd/Envoy style).

Retrying a refused connection on another replica is what makes a replica kill invisible to
the trainer. During a fleet-wide outage, though, every request would fail, retry, fail
again, and the retries would multiply the load on whatever is still alive. The budget caps
retries over a sliding window at ``min_per_s * window_s + ratio * requests``: a trickle of
retries is always allowed (so one dead replica on a quiet gateway is still masked), and
beyond it retries grow with traffic, never faster.

Sans-I/O: the caller passes ``now`` (monotonic seconds). The window is kept in whole-second
buckets, so both calls are O(1). Where the buckets live is the constructor's ``buckets``:
this process's lists (``Buckets``), or cells every worker of ``--workers N`` maps
(``gateway.fleet.shared``), so one budget logic serves both.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from typing import Protocol

__all__ = ["BucketStore", "Buckets", "RetryBudget"]


class BucketStore(Protocol):
    """The window's counts: ``requests`` and ``retries`` hold one count per second of the
    window (slot ``second % window_s``), ``second`` is the absolute second the newest
    bucket stands for."""

    requests: MutableSequence[int]
    retries: MutableSequence[int]
    second: int


class Buckets:
    """A window's counts in this process's memory."""

    __slots__ = ("requests", "retries", "second")

    def __init__(self, window_s: int) -> None:
        self.requests: MutableSequence[int] = [0] * window_s
        self.retries: MutableSequence[int] = [0] * window_s
        self.second = 0


class RetryBudget:
    def __init__(
        self,
        *,
        ratio: float = 0.2,
        min_per_s: float = 10.0,
        window_s: int = 10,
        buckets: BucketStore | None = None,
    ) -> None:
        if ratio < 0 or min_per_s < 0 or window_s < 1:
            raise ValueError("ratio and min_per_s must be >= 0 and window_s >= 1")
        if buckets is not None and {len(buckets.requests), len(buckets.retries)} != {window_s}:
            raise ValueError("buckets must hold window_s counts of each")
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self.buckets: BucketStore = Buckets(window_s) if buckets is None else buckets

    def _advance(self, now: float) -> int:
        b = self.buckets
        second = int(now)
        newest = b.second
        gap = second - newest
        if gap > 0:
            for k in range(1, min(gap, self.window_s) + 1):
                slot = (newest + k) % self.window_s
                b.requests[slot] = b.retries[slot] = 0
            b.second = second
        return second % self.window_s

    def record_request(self, now: float) -> None:
        """A first attempt (not a retry) went out."""
        self.buckets.requests[self._advance(now)] += 1

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it."""
        b = self.buckets
        slot = self._advance(now)
        allowed = self.min_per_s * self.window_s + self.ratio * sum(b.requests)
        if sum(b.retries) + 1 > allowed:
            return False
        b.retries[slot] += 1
        return True
