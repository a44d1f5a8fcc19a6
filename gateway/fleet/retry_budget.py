"""A retry budget: retries may add at most a fixed share to the load (Linkerd/Envoy style).

Retrying a refused connection on another replica is what makes a replica kill invisible to
the trainer. During a fleet-wide outage, though, every request would fail, retry, fail
again, and the retries would multiply the load on whatever is still alive. The budget caps
retries over a sliding window at ``min_per_s * window_s + ratio * requests``: a trickle of
retries is always allowed (so one dead replica on a quiet gateway is still masked), and
beyond it retries grow with traffic, never faster.

Sans-I/O: the caller passes ``now`` (monotonic seconds). The window is kept in whole-second
buckets, so both calls are O(1).
"""

from __future__ import annotations

__all__ = ["RetryBudget"]


class RetryBudget:
    def __init__(self, *, ratio: float = 0.2, min_per_s: float = 10.0, window_s: int = 10) -> None:
        if ratio < 0 or min_per_s < 0 or window_s < 1:
            raise ValueError("ratio and min_per_s must be >= 0 and window_s >= 1")
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self._requests = [0] * window_s
        self._retries = [0] * window_s
        self._second = 0  # the absolute second the newest bucket stands for

    def _advance(self, now: float) -> int:
        second = int(now)
        gap = second - self._second
        if gap > 0:
            for k in range(1, min(gap, self.window_s) + 1):
                slot = (self._second + k) % self.window_s
                self._requests[slot] = self._retries[slot] = 0
            self._second = second
        return second % self.window_s

    def record_request(self, now: float) -> None:
        """A first attempt (not a retry) went out."""
        self._requests[self._advance(now)] += 1

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget allows it."""
        slot = self._advance(now)
        allowed = self.min_per_s * self.window_s + self.ratio * sum(self._requests)
        if sum(self._retries) + 1 > allowed:
            return False
        self._retries[slot] += 1
        return True
