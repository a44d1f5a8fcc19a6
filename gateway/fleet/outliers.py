"""Passive outlier detection: a per-replica circuit breaker driven by response statuses.

Active health checks only see ``/health``; a replica whose engine answers every rollout
with 500 (or a struggling one that sheds load with slow 429s) still passes them. So every
routed response is also a health observation:

* ``consecutive_errors`` responses in a row with status 5xx or 429 **open** the breaker:
  the replica gets no routed traffic for an ejection time that starts at ``base_ejection_s``
  and doubles on each consecutive ejection, up to ``max_ejection_s`` (Envoy's outlier
  detection, simplified).
* When the time is up the breaker is **half-open**: one trial request at a time may go to
  the replica. A good answer closes the breaker (and resets the backoff); a bad one
  re-opens it for twice as long.
* At most ``max_ejected_fraction`` of the replicas are ejected this way at once (at least
  one replica always stays routable), so a fleet-wide failure -- a bad adapter, an
  upstream outage -- is reported to the client instead of emptying the pool.

Sans-I/O: the caller passes ``now`` (monotonic seconds) and acts on the returned events.
Where the breakers live is the constructor's ``store``: this process's memory
(``LocalBreakers``), or cells every worker of ``--workers N`` maps
(``gateway.fleet.shared``), so one set of decisions serves both.
Broadcasts (adapter loads, pause/resume) still reach an open replica: it is alive, and it
must stay in sync for when it comes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Protocol

__all__ = [
    "Breaker",
    "BreakerState",
    "BreakerStore",
    "LocalBreakers",
    "OutlierDetector",
    "OutlierEvent",
    "is_failure",
]


class BreakerState(IntEnum):
    """Values are the ``gateway_replica_breaker_state`` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class OutlierEvent(StrEnum):
    EJECTED = "ejected"
    RESTORED = "restored"


def is_failure(status: int) -> bool:
    """Statuses that say "this replica is in trouble", as opposed to "bad request"."""
    return status >= 500 or status == 429


@dataclass(slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_errors: int = 0
    ejections: int = 0
    """Consecutive ejections (the backoff exponent); reset when a trial succeeds."""
    reopen_at: float = 0.0
    trial_in_flight: bool = False


class BreakerStore(Protocol):
    """Where an ``OutlierDetector`` keeps its breakers, and how many are not CLOSED.

    Why a seam: the decisions are the same whether one process or N workers judge the
    replicas; only the storage differs. A store hands out ``Breaker`` objects whose fields
    the detector reads and writes; ``open`` lets the common all-closed case cost one
    comparison."""

    open: int

    def get(self, index: int) -> Breaker | None:
        """``index``'s breaker, or None if it has none (it is then closed)."""

    def create(self, index: int) -> Breaker:
        """``index``'s breaker, a closed one made if it had none."""

    def pop(self, index: int) -> Breaker | None:
        """Drop ``index``'s breaker (it starts afresh); what it was, if it had one."""

    def items(self) -> Iterable[tuple[int, Breaker]]:
        """Every breaker, by replica index."""


class LocalBreakers:
    """Breakers in this process's memory, made on first use."""

    __slots__ = ("_breakers", "open")

    def __init__(self) -> None:
        self._breakers: dict[int, Breaker] = {}
        self.open = 0

    def get(self, index: int) -> Breaker | None:
        return self._breakers.get(index)

    def create(self, index: int) -> Breaker:
        found = self._breakers.get(index)
        if found is None:
            found = self._breakers[index] = Breaker()
        return found

    def pop(self, index: int) -> Breaker | None:
        return self._breakers.pop(index, None)

    def items(self) -> Iterable[tuple[int, Breaker]]:
        return self._breakers.items()


class OutlierDetector:
    def __init__(
        self,
        *,
        consecutive_errors: int = 5,
        base_ejection_s: float = 10.0,
        max_ejection_s: float = 300.0,
        max_ejected_fraction: float = 0.5,
        store: BreakerStore | None = None,
    ) -> None:
        self.consecutive_errors = consecutive_errors
        """0 disables detection."""
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.max_ejected_fraction = max_ejected_fraction
        self.store: BreakerStore = LocalBreakers() if store is None else store

    def breaker(self, index: int) -> Breaker:
        return self.store.create(index)

    def routable(self, indices: list[int], now: float) -> list[int]:
        """The replicas of ``indices`` that may take a routed request now."""
        if not self.store.open:
            return indices
        return [i for i in indices if self._allows(i, now)]

    def _allows(self, index: int, now: float) -> bool:
        b = self.store.get(index)
        if b is None or b.state is BreakerState.CLOSED:
            return True
        if b.state is BreakerState.OPEN:
            if now < b.reopen_at:
                return False
            b.state = BreakerState.HALF_OPEN
        return not b.trial_in_flight

    def dispatched(self, index: int) -> bool:
        """A request is going to ``index``; in half-open state it is the one trial.
        False: the trial is taken (by another process: ``shared``); pick again."""
        if self.store.open:
            b = self.store.get(index)
            if b is not None and b.state is BreakerState.HALF_OPEN:
                b.trial_in_flight = True
        return True

    def abandoned(self, index: int) -> None:
        """The request to ``index`` ended without a status (client gone, connect error):
        free the trial slot without judging the replica."""
        if self.store.open:
            b = self.store.get(index)
            if b is not None:
                b.trial_in_flight = False

    def record(self, index: int, status: int, now: float, members: int) -> OutlierEvent | None:
        """The response status ``index`` answered; ``members`` = replicas in the pool."""
        if not self.consecutive_errors:
            return None
        if not is_failure(status):
            # Every answer comes here: a replica that never failed has no breaker, and
            # none is made for it (one call to the store, not two).
            b = self.store.get(index)
            if b is None:
                return None
            b.consecutive_errors = 0
            if b.state is not BreakerState.HALF_OPEN:
                return None  # an answer to a request sent before the ejection proves little
            b.state, b.ejections, b.trial_in_flight = BreakerState.CLOSED, 0, False
            self.store.open -= 1
            return OutlierEvent.RESTORED
        b = self.breaker(index)
        b.consecutive_errors += 1
        if b.state is BreakerState.HALF_OPEN:  # the trial failed: open again, longer
            b.trial_in_flight = False
            self._open_breaker(b, now)
            return OutlierEvent.EJECTED
        if b.state is BreakerState.CLOSED and b.consecutive_errors >= self.consecutive_errors:
            if self.store.open + 1 > int(members * self.max_ejected_fraction):
                return None  # would eject too much of the fleet: let the errors through
            self.store.open += 1
            self._open_breaker(b, now)
            return OutlierEvent.EJECTED
        return None

    def _open_breaker(self, b: Breaker, now: float) -> None:
        duration = min(self.base_ejection_s * 2**b.ejections, self.max_ejection_s)
        b.state, b.reopen_at = BreakerState.OPEN, now + duration
        b.ejections += 1

    def forget(self, index: int) -> None:
        """The replica left the pool or restarted: judge it afresh."""
        b = self.store.pop(index)
        if b is not None and b.state is not BreakerState.CLOSED:
            self.store.open -= 1

    def states(self) -> dict[int, BreakerState]:
        return {i: b.state for i, b in self.store.items()}
