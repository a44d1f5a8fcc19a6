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
due (``publish_fleet_loads_due``), not only by the owner's 50 ms loop. Why: when the
replicas are the bottleneck, a replica over the bound in an old table is avoided by every
worker's new keys for as long as the table is old, while it drains its queue in a few ms
(56 slots x 4 ms: ~5 ms); the walk's next replicas take its share on top of theirs, and
the fleet herds from replica to replica (docs/decisions.md, 'Workers: fleet-load period').

Plain cell writes need no lock (a lost update of an error count is harmless); every state
change and the claim of a half-open trial take the one process-shared lock, so two workers
never both send the trial or both count one breaker as closed. The breakers' and the
budget's decisions are the one-process classes' own (``OutlierDetector``, ``RetryBudget``),
given this table as their storage (their ``store`` and ``buckets``): the shared classes
only add the lock around those public calls, so there is one copy of each rule.

The lock is a POSIX record lock (``fcntl``) on a memfd, not a semaphore. Why: the kernel
drops a record lock when the process holding it exits, however it died; a semaphore held
by a killed worker stays taken for ever, so it could only be waited on for a while, and a
caller that then carried on without it would break the guarantees above whenever a live
holder was merely preempted (docs/decisions.md, 'Workers: a lock that dies with its
holder'). With a lock that cannot outlive its holder, every caller waits for it, and only
ever waits on a live process holding it for a few microseconds of arithmetic on these
cells (never across I/O or an ``await``). A worker killed mid-change can leave that change
half done; where that would stick, the next one mends it (a trial whose process is gone is no
longer in flight, ``_sum`` mends an odd sequence). A holder that is stopped, not dead
(``SIGSTOP``, a debugger), holds up the others: that is the lock doing its job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from typing import Any, Generic, TypeVar

from gateway.fleet.outliers import Breaker, BreakerState, OutlierDetector, OutlierEvent
from gateway.fleet.retry_budget import RetryBudget

__all__ = [
    "SharedBreakers",
    "SharedBuckets",
    "SharedOutlierDetector",
    "SharedRetryBudget",
    "SharedState",
]

_FIELDS = 5  # state, consecutive_errors, ejections, reopen_at, trial's process
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
        self._lock = _ProcessLock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, held for microseconds by whoever has it; waited for as long as that
        takes, since it cannot outlive its holder (module docstring)."""
        self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()

    def publish_loads(self, worker: int, loads: Sequence[int]) -> None:
        """``worker``'s requests in flight per replica (its row, written by it alone)."""
        row = self.loads_at + worker * self.replicas
        for index, count in enumerate(loads[: self.replicas]):
            self.cells[row + index] = float(count)

    def publish_fleet_loads(self, now: float | None = None) -> None:
        """The owner, every 50 ms: sum the workers' rows into one table, under a sequence
        number (odd while writing), so every worker routes by the same one. Workers sum it
        too (``publish_fleet_loads_due``): the lock keeps one writer at a time. A worker
        that died mid-sum released the lock as it died, and ``_sum`` mends the odd
        sequence it left, so the table never freezes."""
        with self.locked():
            self._sum(time.monotonic() if now is None else now)

    def publish_fleet_loads_due(self, period_s: float, now: float | None = None) -> bool:
        """``publish_fleet_loads`` if the table is ``period_s`` old, by whichever worker
        asks first: one table per period fleet-wide, whichever workers are alive.
        ``time.monotonic`` is the host's one clock (CLOCK_MONOTONIC), the same in every
        process. Never waits for the lock: whoever holds it is publishing, or soon done."""
        now = time.monotonic() if now is None else now
        if now - self.cells[self.summed_at] < period_s:
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if now - self.cells[self.summed_at] < period_s:  # another worker just did
                return False
            self._sum(now)
        finally:
            self._lock.release()
        return True

    def _sum(self, now: float) -> None:
        """The table from the rows (lock held)."""
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


class _ProcessLock:
    """One lock for every process that inherited it and every thread in them: a POSIX
    record lock on a memfd (between processes; the kernel releases it when its holder
    exits) behind a ``threading.Lock`` (between threads of one process, which a record
    lock does not separate). Not reentrant: a second acquire by the holding thread raises
    instead of deadlocking, or, worse, silently sharing (a record lock is the process's).
    Fork only from a process not holding it (the supervisor never takes it)."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("gateway-shared-lock")  # inherited by fork, no file
        weakref.finalize(self, os.close, self._fd)
        self._threads = threading.Lock()
        self._holder: int | None = None  # the holding thread, to refuse re-entry

    def acquire(self, *, blocking: bool = True) -> bool:
        if self._holder == threading.get_ident():
            raise RuntimeError("the shared fleet lock is not reentrant")
        if not self._threads.acquire(blocking):
            return False
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:
            self._threads.release()
            if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EACCES):
                return False  # another process holds it (non-blocking only)
            raise
        self._holder = threading.get_ident()
        return True

    def release(self) -> None:
        self._holder = None
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._threads.release()


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


class SharedBreakers:
    """An ``OutlierDetector``'s ``BreakerStore`` in the shared table: a breaker for each of
    the fixed replica indices (no discovery with workers), closed until judged, and the
    count of those not closed in cell 0. Nothing here resets a cell when it is made: a
    restarted worker finds the fleet's breakers as the others left them."""

    def __init__(self, table: SharedState) -> None:
        self._cells = table.cells
        self._breakers = [_SharedBreaker(table.cells, i) for i in range(table.replicas)]

    @property
    def open(self) -> int:
        return int(self._cells[0])

    @open.setter
    def open(self, value: int) -> None:
        self._cells[0] = float(value)

    def get(self, index: int) -> Breaker | None:
        return self._breakers[index] if 0 <= index < len(self._breakers) else None

    def create(self, index: int) -> Breaker:
        return self._breakers[index]

    def pop(self, index: int) -> Breaker | None:
        """What the breaker was (a copy), its cells back to a closed breaker's."""
        b = self._breakers[index]
        was = Breaker(b.state, b.consecutive_errors, b.ejections, b.reopen_at, b.trial_in_flight)
        b.state, b.consecutive_errors, b.ejections = BreakerState.CLOSED, 0, 0
        b.reopen_at, b.trial_in_flight = 0.0, False
        return was

    def items(self) -> Iterable[tuple[int, Breaker]]:
        return enumerate(self._breakers)


class SharedOutlierDetector(OutlierDetector):
    """``OutlierDetector`` over a ``SharedState`` table: the same decisions, taken once
    for the whole gateway. Every call that may change a breaker runs the base's under the
    lock; the calls of the common case (every breaker closed, a good answer from a closed
    one) read the cells without it."""

    def __init__(self, table: SharedState, **limits: Any) -> None:
        super().__init__(**limits, store=SharedBreakers(table))
        self._table = table

    def routable(self, indices: list[int], now: float) -> list[int]:
        if not self.store.open:
            return indices
        with self._table.locked():  # a breaker may turn half-open here
            return super().routable(indices, now)

    def dispatched(self, index: int) -> bool:
        """As the base, but False when another worker claimed the half-open trial since
        this one's ``routable``: one trial at a time fleet-wide."""
        if not self.store.open:
            return True
        with self._table.locked():
            b = self.store.get(index)
            if b is not None and b.state is BreakerState.HALF_OPEN and b.trial_in_flight:
                return False
            return super().dispatched(index)

    def record(self, index: int, status: int, now: float, members: int) -> OutlierEvent | None:
        b = self.breaker(index)
        if not b.consecutive_errors and b.state is BreakerState.CLOSED and status < 429:
            return None  # the common case, lock-free: a good answer from a closed breaker
        with self._table.locked():
            return super().record(index, status, now, members)

    def abandoned(self, index: int) -> None:
        with self._table.locked():
            super().abandoned(index)

    def forget(self, index: int) -> None:
        with self._table.locked():
            super().forget(index)


class SharedBuckets:
    """A ``RetryBudget``'s ``BucketStore`` in the shared table: the newest second, then the
    requests and the retries of each second of the window. Nothing here resets a cell: a
    restarted worker does not refill the budget."""

    def __init__(self, table: SharedState) -> None:
        at, n = table.budget_at, table.window_s
        self._cells = table.cells
        self._at = at
        self.requests: MutableSequence[int] = table.cells[at + 1 : at + 1 + n]
        self.retries: MutableSequence[int] = table.cells[at + 1 + n : at + 1 + 2 * n]

    @property
    def second(self) -> int:
        return int(self._cells[self._at])

    @second.setter
    def second(self, value: int) -> None:
        self._cells[self._at] = float(value)


class SharedRetryBudget(RetryBudget):
    """``RetryBudget`` whose buckets are shared cells: one budget for all workers. Spending
    a retry, and counting a request that moves the window (once a second), run the base's
    call under the lock; counting a request within the current second does not (an
    update lost to a race miscounts one request)."""

    def __init__(self, table: SharedState, *, ratio: float, min_per_s: float) -> None:
        super().__init__(
            ratio=ratio, min_per_s=min_per_s, window_s=table.window_s, buckets=SharedBuckets(table)
        )
        self._table = table

    def record_request(self, now: float) -> None:
        # The newest second only grows: if ``now`` is within it, the base will not move
        # the window, whatever other workers do meanwhile.
        if int(now) <= self.buckets.second:
            super().record_request(now)
            return
        with self._table.locked():
            super().record_request(now)

    def try_retry(self, now: float) -> bool:
        with self._table.locked():
            return super().try_retry(now)
