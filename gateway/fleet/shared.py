"""Passive fleet state in memory every process of one gateway shares (``--workers N``):
the outlier breakers, the retry budget, and each worker's in-flight counts (the
routers' fleet-wide load, ``gateway.routing.fleet``).

Why shared memory and not the owner's snapshots: both are judged on every routed
request, not decided by control calls. A breaker's half-open state lets exactly one
trial through, and the retry budget caps the gateway's retries, not each worker's.
Judged per worker, N workers would each need ``consecutive_errors`` failures to eject,
each send their own trial, and learn of another's ejection only a round trip later.
With one table in an anonymous ``MAP_SHARED`` mapping (made before the fork, so every
worker, a restarted one included, maps the same pages), every process reads and writes
the same breaker: an ejection holds for all of them at once and one trial at a time
goes out fleet-wide.

Each breaker is five float64 cells; the number of open breakers is cell 0; the retry
budget's buckets follow the breakers; then each worker's in-flight row, the fleet-load
table (a sequence number and the sum) and the time it was summed.

The fleet-load table is summed every ``FLEET_LOADS_S`` (2 ms) by whichever worker finds it
due (``publish_fleet_loads_due``), not only by the owner's 50 ms loop. Why (issue 28,
``bench/results/cores-saturated.md``): when the replicas are the bottleneck, a replica
over the bound in a table up to 100 ms old is avoided by every worker's new keys for
those 100 ms, while it drains its queue in a few (56 slots x 4 ms: ~5 ms); the walk's
next replicas take its share on top of theirs. The fleet herded from replica to replica:
with ``--workers 8`` over 4 saturating fakes, 33k req/s and p99 17 ms under prefix
routing against 52k and 7 ms under ``--router round_robin`` on the same plumbing.

Plain cell writes need no lock (a lost update of
an error count is harmless); every state change and the claim of a half-open trial take
the one process-shared lock, so two workers never both send the trial or both count one
breaker as closed.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from gateway.fleet.outliers import Breaker, BreakerState, OutlierDetector
from gateway.fleet.retry_budget import RetryBudget

__all__ = ["SharedOutlierDetector", "SharedRetryBudget", "SharedState"]

_FIELDS = 5  # state, consecutive_errors, ejections, reopen_at, trial's process
_LOCK_WAIT_S = 0.05
FLEET_LOADS_S = 0.002
"""How old the fleet-load table may get before a worker sums it again (module docstring)."""
_T = TypeVar("_T")


class SharedState:
    """The cells for ``replicas`` breakers and one retry budget of ``window_s`` buckets;
    create it before forking."""

    def __init__(self, replicas: int, window_s: int = 10, workers: int = 0) -> None:
        self.replicas = replicas
        self.window_s = window_s
        self.workers = workers
        budget = 1 + 2 * window_s  # the newest second, then requests and retries per bucket
        self.budget_at = 1 + _FIELDS * replicas
        self.loads_at = self.budget_at + budget  # then each worker's in flight per replica
        self.fleet_at = self.loads_at + workers * replicas  # then a sequence + their sum
        self.summed_at = self.fleet_at + 1 + replicas  # time.monotonic() of the last sum
        self._map = mmap.mmap(-1, 8 * (self.summed_at + 1))
        self.cells: Any = memoryview(self._map).cast("d")  # float64 cells
        self._lock = multiprocessing.get_context("fork").Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, held for microseconds by whoever has it. A worker killed while
        holding it would hold it forever: past ``_LOCK_WAIT_S`` the caller goes on
        without it (a rare miscount beats a gateway stuck on a dead process's lock)."""
        got = self._lock.acquire(timeout=_LOCK_WAIT_S)
        try:
            yield
        finally:
            if got:
                self._lock.release()

    def publish_loads(self, worker: int, loads: Sequence[int]) -> None:
        """``worker``'s requests in flight per replica (its row, written by it alone)."""
        row = self.loads_at + worker * self.replicas
        for index, count in enumerate(loads[: self.replicas]):
            self.cells[row + index] = float(count)

    def publish_fleet_loads(self, now: float | None = None) -> None:
        """The owner, every 50 ms: sum the workers' rows into one table, under a sequence
        number (odd while writing), so every worker routes by the same one. Workers sum it
        too (``publish_fleet_loads_due``): the lock keeps one writer at a time. A lock not
        had in ``_LOCK_WAIT_S`` is a dead worker's: the owner writes anyway (``_sum``
        mends the odd sequence such a worker may have left), so the table never freezes."""
        got = self._lock.acquire(timeout=_LOCK_WAIT_S)
        try:
            self._sum(time.monotonic() if now is None else now)
        finally:
            if got:
                self._lock.release()

    def publish_fleet_loads_due(self, period_s: float, now: float | None = None) -> bool:
        """``publish_fleet_loads`` if the table is ``period_s`` old, by whichever worker
        asks first: one table per period fleet-wide, whichever workers are alive.
        ``time.monotonic`` is the host's one clock (CLOCK_MONOTONIC), the same in every
        process. Never waits for the lock: whoever holds it is publishing, or soon done."""
        now = time.monotonic() if now is None else now
        if now - self.cells[self.summed_at] < period_s:
            return False
        if not self._lock.acquire(block=False):
            return False
        try:
            if now - self.cells[self.summed_at] < period_s:  # another worker just did
                return False
            self._sum(now)
        finally:
            self._lock.release()
        return True

    def _sum(self, now: float) -> None:
        """The table from the rows (lock held, or its holder dead)."""
        at, n, seq, cells = self.loads_at, self.replicas, self.fleet_at, self.cells
        writing = cells[seq] + (2.0 if int(cells[seq]) % 2 else 1.0)  # odd, whatever was left
        cells[seq] = writing
        for index in range(n):
            cells[seq + 1 + index] = float(
                sum(cells[at + w * n + index] for w in range(self.workers))
            )
        cells[seq] = writing + 1.0
        cells[self.summed_at] = now

    def fleet_loads(self, seen: float) -> tuple[float, dict[int, int] | None]:
        """``(sequence, table)`` if a table newer than sequence ``seen`` is published
        whole, else ``(seen, None)``: cheap enough to ask before every decision."""
        seq = self.fleet_at
        first = self.cells[seq]
        if first == seen or int(first) % 2:
            return seen, None
        table = {i: int(self.cells[seq + 1 + i]) for i in range(self.replicas)}
        return (first, table) if self.cells[seq] == first else (seen, None)


class _Cell(Generic[_T]):
    """One field of a ``_SharedBreaker``, stored as a float64 cell."""

    def __init__(self, offset: int, kind: Callable[[float], _T]) -> None:
        self.offset = offset
        self.kind = kind

    def __get__(self, obj: _SharedBreaker, owner: Any = None) -> _T:
        return self.kind(obj.cells[obj.base + self.offset])

    def __set__(self, obj: _SharedBreaker, value: _T) -> None:
        obj.cells[obj.base + self.offset] = float(value)  # type: ignore[arg-type]


def _state(value: float) -> BreakerState:
    return BreakerState(int(value))


class _Trial:
    """``trial_in_flight``, stored as the pid of the process that sent the trial: a trial
    whose process died (killed mid-request) is no longer in flight."""

    def __get__(self, obj: _SharedBreaker, owner: Any = None) -> bool:
        pid = int(obj.cells[obj.base + 4])
        if not pid or pid == os.getpid():
            return bool(pid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, someone else's: not one of ours, though
            return False
        return True

    def __set__(self, obj: _SharedBreaker, value: bool) -> None:
        obj.cells[obj.base + 4] = float(os.getpid() if value else 0)


class _SharedBreaker(Breaker):
    """``Breaker``'s fields, read and written in the shared table."""

    __slots__ = ("base", "cells")

    state = _Cell(0, _state)
    consecutive_errors = _Cell(1, int)
    ejections = _Cell(2, int)
    reopen_at = _Cell(3, float)
    trial_in_flight = _Trial()

    def __init__(self, cells: Any, index: int) -> None:  # no dataclass init
        self.cells = cells
        self.base = 1 + _FIELDS * index


class SharedOutlierDetector(OutlierDetector):
    """``OutlierDetector`` over a ``SharedState`` table: the same decisions, taken
    once for the whole gateway. Replica indices are fixed (no discovery with workers)."""

    def __init__(self, table: SharedState, **limits: Any) -> None:
        self._table = table
        opened = table.cells[0]
        super().__init__(**limits)
        table.cells[0] = opened  # the base resets the count; a restarted worker must not
        self._breakers = {i: _SharedBreaker(table.cells, i) for i in range(table.replicas)}

    @property
    def _open(self) -> int:
        return int(self._table.cells[0])

    @_open.setter
    def _open(self, value: int) -> None:
        self._table.cells[0] = float(value)

    def breaker(self, index: int) -> Breaker:
        return self._breakers[index]

    def _allows(self, index: int, now: float) -> bool:
        with self._table.locked():  # only reached while some breaker is not closed
            return super()._allows(index, now)

    def dispatched(self, index: int) -> bool:
        if not self._open:
            return True
        with self._table.locked():
            b = self._breakers[index]
            if b.state is BreakerState.HALF_OPEN:
                if b.trial_in_flight:
                    return False  # another worker's trial is on its way
                b.trial_in_flight = True
            return True

    def record(self, index: int, status: int, now: float, members: int) -> Any:
        b = self._breakers[index]
        if not b.consecutive_errors and b.state is BreakerState.CLOSED and status < 429:
            return None  # the common case, lock-free: a good answer from a closed breaker
        with self._table.locked():
            return super().record(index, status, now, members)

    def abandoned(self, index: int) -> None:
        with self._table.locked():
            super().abandoned(index)

    def forget(self, index: int) -> None:
        with self._table.locked():
            b = self._breakers[index]
            if b.state is not BreakerState.CLOSED:
                self._open -= 1
            b.state, b.consecutive_errors, b.ejections = BreakerState.CLOSED, 0, 0
            b.reopen_at, b.trial_in_flight = 0.0, False


class SharedRetryBudget(RetryBudget):
    """``RetryBudget`` whose buckets are shared cells: one budget for all workers. Moving
    the window and spending a retry take the lock (once a second, and rarely); counting a
    request does not (an update lost to a race miscounts one request)."""

    def __init__(self, table: SharedState, *, ratio: float, min_per_s: float) -> None:
        super().__init__(ratio=ratio, min_per_s=min_per_s, window_s=table.window_s)
        at, n = table.budget_at, table.window_s
        self._cells = table.cells
        self._at = at
        self._requests = table.cells[at + 1 : at + 1 + n]
        self._retries = table.cells[at + 1 + n : at + 1 + 2 * n]
        self._table = table

    def _advance(self, now: float) -> int:
        if int(now) <= self._second:
            return int(now) % self.window_s
        with self._table.locked():
            return super()._advance(now)

    def try_retry(self, now: float) -> bool:
        self._advance(now)  # first, so the base's own call below needs no lock (not reentrant)
        with self._table.locked():
            return super().try_retry(now)

    @property
    def _second(self) -> int:
        return int(self._cells[self._at])

    @_second.setter
    def _second(self, value: int) -> None:
        if hasattr(self, "_cells"):  # the base's __init__ sets it before the cells exist
            self._cells[self._at] = float(value)
