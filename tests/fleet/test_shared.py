"""Breakers and the retry budget shared by forked processes (``serve --workers N``).

Every cross-process test forks real children (``multiprocessing``'s fork context, as the
supervisor does) that map the same ``SharedState``; results come back over a pipe, every
join is bounded, and the clock is injected (``now``), so nothing sleeps."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.outliers import BreakerState, OutlierDetector, OutlierEvent
from gateway.fleet.retry_budget import RetryBudget
from gateway.fleet.shared import (
    SharedBuckets,
    SharedOutlierDetector,
    SharedRetryBudget,
    SharedState,
)

CTX = multiprocessing.get_context("fork")
LIMITS: dict[str, Any] = {
    "consecutive_errors": 3,
    "base_ejection_s": 10.0,
    "max_ejection_s": 40.0,
    "max_ejected_fraction": 0.5,
}
ALL = [0, 1, 2]
JOIN_S = 10.0

T = TypeVar("T")


def open_breakers(d: OutlierDetector) -> list[tuple[int, float]]:
    """``(replica, reopen_at)`` of every OPEN breaker, read through the public API."""
    return [(i, d.breaker(i).reopen_at) for i, s in d.states().items() if s is BreakerState.OPEN]


def _run(fn: Callable[[], object], out: Connection) -> None:
    try:
        out.send(("ok", fn()))
    except BaseException:
        out.send(("error", traceback.format_exc()))


def in_children(*fns: Callable[[], object]) -> list[Any]:
    """Run each of ``fns`` in its own forked child, at once; their results, in order."""
    pipes, procs = [], []
    for fn in fns:
        recv, send = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_run, args=(fn, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    try:
        answers = []
        for recv in pipes:
            assert recv.poll(JOIN_S), "a child gave no answer"
            answers.append(recv.recv())
    finally:
        for proc in procs:
            proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_S)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    for kind, value in answers:
        if kind == "error":
            raise AssertionError(f"in a child:\n{value}")
    return [value for _, value in answers]


def in_child(fn: Callable[[], T]) -> T:
    result: T = in_children(fn)[0]
    return result


def detector(table: SharedState, **limits: Any) -> SharedOutlierDetector:
    return SharedOutlierDetector(table, **{**LIMITS, **limits})


def fail(d: OutlierDetector, index: int, times: int, now: float, members: int = 3) -> list[Any]:
    return [d.record(index, 500, now, members) for _ in range(times)]


# ----------------------------------------------------------------- one breaker for all


def test_an_ejection_in_one_process_holds_in_another() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    assert fail(parent, 0, 3, 0.0) == [None, None, OutlierEvent.EJECTED]

    def child() -> tuple[list[int], BreakerState, list[tuple[int, float]]]:
        worker = detector(table)  # a worker builds its own detector after the fork
        return (worker.routable(ALL, 5.0), worker.breaker(0).state, open_breakers(worker))

    routable, state, opened = in_child(child)
    assert routable == [1, 2]
    assert state is BreakerState.OPEN
    assert opened == [(0, 10.0)]


def test_a_child_ejection_is_seen_by_the_parent() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    events = in_child(lambda: fail(detector(table), 2, 3, 0.0))
    assert events == [None, None, OutlierEvent.EJECTED]
    assert parent.routable(ALL, 1.0) == [0, 1]
    assert parent.states()[2] is BreakerState.OPEN


def test_errors_count_toward_one_streak_across_processes() -> None:
    """Three failures in a row from the fleet's point of view eject, whichever process
    saw each (not three per process)."""
    table = SharedState(replicas=3)
    parent = detector(table)
    assert fail(parent, 1, 2, 0.0) == [None, None]
    assert in_child(lambda: fail(detector(table), 1, 1, 0.1)) == [OutlierEvent.EJECTED]
    assert parent.routable(ALL, 0.2) == [0, 2]


def test_a_good_answer_anywhere_breaks_the_streak() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 1, 2, 0.0)
    assert in_child(lambda: detector(table).record(1, 200, 0.1, 3)) is None
    assert fail(parent, 1, 2, 0.2) == [None, None]  # counting from zero again
    assert parent.routable(ALL, 0.3) == ALL


# ------------------------------------------------------------------- half-open trial


def test_one_trial_fleet_wide_and_a_good_answer_closes_it_for_all() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)
    assert parent.routable(ALL, 9.99) == [1, 2]

    assert parent.routable(ALL, 10.0) == ALL
    assert parent.dispatched(0) is True  # the parent sends the trial

    def child_finds_it_taken() -> object:
        worker = detector(table)
        return worker.routable(ALL, 10.1), worker.dispatched(0), worker.dispatched(1)

    assert in_child(child_finds_it_taken) == ([1, 2], False, True)
    assert parent.breaker(0).state is BreakerState.HALF_OPEN
    assert parent.breaker(0).trial_in_flight

    assert in_child(lambda: detector(table).record(0, 200, 10.5, 3)) is OutlierEvent.RESTORED
    assert parent.breaker(0).state is BreakerState.CLOSED
    assert not parent.breaker(0).trial_in_flight and parent.breaker(0).ejections == 0
    assert parent.routable(ALL, 10.6) == ALL
    assert open_breakers(parent) == []
    assert in_child(lambda: detector(table).routable(ALL, 10.6)) == ALL


def test_a_failed_trial_reopens_longer_for_all() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)
    assert parent.routable(ALL, 10.0) == ALL
    assert parent.dispatched(0) is True  # the parent's trial this time

    def child() -> object:
        worker = detector(table)
        return worker.dispatched(0), worker.record(0, 503, 10.2, 3)  # its answer: 503

    assert in_child(child) == (False, OutlierEvent.EJECTED)
    assert open_breakers(parent) == [(0, 30.2)]  # 10.2 + 2 x 10 s
    assert parent.routable(ALL, 30.1) == [1, 2]
    assert parent.routable(ALL, 30.2) == ALL


def test_an_abandoned_trial_frees_the_slot_for_another_process() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)
    parent.routable(ALL, 10.0)
    assert parent.dispatched(0) is True
    assert in_child(lambda: detector(table).dispatched(0)) is False  # the parent's
    parent.abandoned(0)  # client went away: no verdict
    assert in_child(lambda: detector(table).dispatched(0)) is True


@pytest.mark.parametrize("round_", range(8))
def test_two_workers_racing_for_the_trial_get_one(round_: int) -> None:
    table = SharedState(replicas=3)
    fail(detector(table), 0, 3, 0.0)
    barrier = CTX.Barrier(2, timeout=JOIN_S)

    def race() -> object:
        worker = detector(table)
        seen = worker.routable(ALL, 10.0 + round_)  # both see it half-open, slot free
        barrier.wait()
        return seen, worker.dispatched(0)

    (seen_a, got_a), (seen_b, got_b) = in_children(race, race)
    assert seen_a == seen_b == ALL
    assert sorted([got_a, got_b]) == [False, True]


# ------------------------------------------------------------ the fleet-share cap


def test_max_ejected_fraction_holds_across_processes() -> None:
    table = SharedState(replicas=4)
    parent = detector(table)  # 4 members x 0.5: at most 2 ejected at once
    assert fail(parent, 0, 3, 0.0, members=4)[-1] is OutlierEvent.EJECTED
    assert in_child(lambda: fail(detector(table), 1, 3, 0.0, members=4)[-1]) is (
        OutlierEvent.EJECTED
    )
    assert fail(parent, 2, 3, 0.0, members=4) == [None, None, None]  # over the cap
    assert in_child(lambda: fail(detector(table), 3, 5, 0.0, members=4)) == [None] * 5
    assert parent.states() == {0: BreakerState.OPEN, 1: BreakerState.OPEN,
                               2: BreakerState.CLOSED, 3: BreakerState.CLOSED}  # fmt: skip
    assert parent.routable([0, 1, 2, 3], 1.0) == [2, 3]


@pytest.mark.parametrize("round_", range(4))
def test_concurrent_ejections_never_exceed_the_cap(round_: int) -> None:
    table = SharedState(replicas=3)  # 3 x 0.5 -> 1 at most
    barrier = CTX.Barrier(2, timeout=JOIN_S)

    def eject(index: int) -> Callable[[], object]:
        def go() -> object:
            worker = detector(table)
            barrier.wait()
            return fail(worker, index, 3, float(round_))

        return go

    a, b = in_children(eject(1), eject(2))
    assert (a + b).count(OutlierEvent.EJECTED) == 1
    states = detector(table).states()
    assert sorted(s for s in states.values()) == [BreakerState.CLOSED, BreakerState.CLOSED,
                                                  BreakerState.OPEN]  # fmt: skip


def test_a_restarted_worker_does_not_reset_the_open_count() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)

    def restarted() -> tuple[list[tuple[int, float]], list[Any]]:
        fresh = detector(table)  # created long after the ejection
        return open_breakers(fresh), fail(fresh, 1, 3, 1.0)

    opened, events = in_child(restarted)
    assert opened == [(0, 10.0)]
    assert events == [None, None, None]  # the cap still counts replica 0
    assert detector(table).routable(ALL, 2.0) == [1, 2]  # and so does one made here
    parent.routable(ALL, 10.0)
    parent.dispatched(0)
    assert parent.record(0, 200, 10.1, 3) is OutlierEvent.RESTORED
    # the count is back to zero, not below: exactly one ejection fits again (replica 1
    # kept its streak of 3 while capped, so its next failure ejects it)
    assert fail(parent, 1, 1, 11.0) == [OutlierEvent.EJECTED]
    assert fail(parent, 2, 3, 11.0) == [None, None, None]


def test_every_process_forgetting_a_replica_counts_it_once() -> None:
    """A replica out of rotation is forgotten by the owner and by every worker that
    follows the snapshot: the open count drops once."""
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)
    in_children(lambda: detector(table).forget(0), lambda: detector(table).forget(0))
    parent.forget(0)
    assert parent.states()[0] is BreakerState.CLOSED and open_breakers(parent) == []
    assert fail(parent, 1, 3, 1.0)[-1] is OutlierEvent.EJECTED
    assert fail(parent, 2, 3, 1.0) == [None, None, None]  # still capped at one


def test_a_trial_claimed_by_a_worker_that_died_is_not_held_forever() -> None:
    table = SharedState(replicas=3)
    parent = detector(table)
    fail(parent, 0, 3, 0.0)

    def claim_and_die() -> object:
        worker = detector(table)
        worker.routable(ALL, 10.0)
        return worker.dispatched(0)  # the child exits with the trial never answered

    assert in_child(claim_and_die) is True
    much_later = 10.0 + 100 * LIMITS["max_ejection_s"]
    assert 0 in detector(table).routable(ALL, much_later)


# ------------------------------------------------------------- one retry budget


def spend(budget: RetryBudget, now: float, limit: int = 10_000) -> int:
    granted = 0
    while granted < limit and budget.try_retry(now):
        granted += 1
    return granted


def test_the_retry_budget_is_one_for_all_processes() -> None:
    table = SharedState(replicas=2)  # window 10 s
    parent = SharedRetryBudget(table, ratio=0.0, min_per_s=1.0)  # 10 per window
    assert spend(parent, 100.0, limit=4) == 4
    assert in_child(lambda: spend(SharedRetryBudget(table, ratio=0.0, min_per_s=1.0),
                                  101.0)) == 6  # fmt: skip
    assert spend(parent, 102.0) == 0
    # the window slides for both: the 100 s bucket (4) expires at 110, the 101 s one not
    assert spend(parent, 110.0) == 4
    assert in_child(lambda: spend(SharedRetryBudget(table, ratio=0.0, min_per_s=1.0),
                                  110.5)) == 0  # fmt: skip


def test_requests_in_one_process_earn_retries_in_another() -> None:
    table = SharedState(replicas=2)
    parent = SharedRetryBudget(table, ratio=0.5, min_per_s=0.0)
    assert spend(parent, 50.0) == 0

    def record() -> object:
        worker = SharedRetryBudget(table, ratio=0.5, min_per_s=0.0)
        for _ in range(20):
            worker.record_request(50.0)
        return spend(worker, 50.0, limit=3)

    assert in_child(record) == 3
    assert spend(parent, 51.0) == 7  # 0.5 x 20, less the child's 3


class _StaleRead(SharedBuckets):
    """Buckets whose next read of the window's newest second runs ``then`` (another
    process's calls) right after the read: the interleaving two workers get when one is
    preempted between reading the second, lock-free, and acting on it."""

    then: Callable[[], object] | None = None

    @property
    def second(self) -> int:
        value = SharedBuckets.second.fget(self)  # type: ignore[attr-defined]
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return int(value)

    @second.setter
    def second(self, value: int) -> None:
        SharedBuckets.second.fset(self, value)  # type: ignore[attr-defined]


def test_advancing_the_window_at_once_does_not_forget_retries() -> None:
    table = SharedState(replicas=1)  # window 10 s
    a = SharedRetryBudget(table, ratio=0.0, min_per_s=1.0)  # 10 per window
    b = SharedRetryBudget(table, ratio=0.0, min_per_s=1.0)
    stale = b.buckets = _StaleRead(table)
    assert spend(a, 100.0) == 10
    spent: list[int] = []
    stale.then = lambda: spent.append(spend(a, 110.0, limit=9))  # a advances and spends first
    b.record_request(110.0)  # b read 100 as the newest second: the window moves, it thinks
    spent.append(spend(b, 110.0))
    assert spent[0] == 9  # the 100 s bucket expired: room for 10, a takes 9 of them...
    assert spent[1] == 1  # ...and b the one left (b's request did not clear a's retries)


def test_a_restarted_worker_does_not_refill_the_budget() -> None:
    table = SharedState(replicas=2)
    assert spend(SharedRetryBudget(table, ratio=0.0, min_per_s=1.0), 300.0) == 10
    assert in_child(lambda: spend(SharedRetryBudget(table, ratio=0.0, min_per_s=1.0),
                                  300.5)) == 0  # fmt: skip


# ------------------------------------------------ parity with the one-process classes

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 3),
                  st.sampled_from([200, 404, 429, 499, 500, 503]),
                  st.sampled_from([0.0, 0.5, 5.0, 10.0, 25.0])),
        st.tuples(st.just("route"), st.integers(0, 3), st.sampled_from([0.0, 0.5, 5.0, 10.0])),
        st.tuples(st.just("abandon"), st.integers(0, 3)),
        st.tuples(st.just("forget"), st.integers(0, 3)),
    ),
    max_size=60,
)  # fmt: skip


def _breaker_view(d: OutlierDetector, n: int) -> list[tuple[Any, ...]]:
    return [
        (b.state, b.consecutive_errors, b.ejections, b.reopen_at, b.trial_in_flight)
        for b in (d.breaker(i) for i in range(n))
    ]


@settings(max_examples=200)
@given(_ops, st.sampled_from([0, 1, 2, 3]))  # 0: detection off
def test_shared_detector_decides_like_the_in_process_one(
    ops: list[tuple[Any, ...]], errors: int
) -> None:
    """The same events, in one process, as the gateway sends them (``dispatched`` only to
    a replica ``routable`` just returned): the same answers and the same breakers."""
    n = 4
    limits = {**LIMITS, "consecutive_errors": errors}
    plain = OutlierDetector(**limits)
    shared = SharedOutlierDetector(SharedState(replicas=n), **limits)
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "record":
            _, index, status, dt = op
            now += dt
            assert shared.record(index, status, now, n) == plain.record(index, status, now, n)
        elif kind == "route":
            _, pick, dt = op
            now += dt
            routable = plain.routable(list(range(n)), now)
            assert shared.routable(list(range(n)), now) == routable
            if routable:
                index = routable[pick % len(routable)]
                assert shared.dispatched(index) is plain.dispatched(index) is True
        elif kind == "abandon":
            shared.abandoned(op[1])
            plain.abandoned(op[1])
        else:
            shared.forget(op[1])
            plain.forget(op[1])
        assert sorted(open_breakers(shared)) == sorted(open_breakers(plain))
        assert _breaker_view(shared, n) == _breaker_view(plain, n), op


def test_in_process_detector_dispatched_still_always_true() -> None:
    """The one-process class keeps its old contract: ``dispatched`` never refuses."""
    d = OutlierDetector(**LIMITS)
    fail(d, 0, 3, 0.0)
    assert d.routable(ALL, 10.0) == ALL
    assert d.dispatched(0) is True
    assert d.dispatched(0) is True  # a second one in the same process is not refused
    assert d.dispatched(2) is True
    assert open_breakers(d) == []  # half-open is not open
    assert d.states() == {0: BreakerState.HALF_OPEN}


_budget_ops = st.lists(
    st.tuples(st.sampled_from(["request", "retry"]),
              st.sampled_from([0.0, 0.0, 0.3, 1.0, 4.0, 11.0, 30.0])),
    max_size=120,
)  # fmt: skip


@settings(max_examples=100)
@given(_budget_ops, st.sampled_from([(0.2, 1.0), (0.0, 0.5), (1.0, 0.0)]))
def test_shared_budget_decides_like_the_in_process_one(
    ops: list[tuple[str, float]], params: tuple[float, float]
) -> None:
    ratio, floor = params
    plain = RetryBudget(ratio=ratio, min_per_s=floor, window_s=10)
    shared = SharedRetryBudget(SharedState(replicas=1), ratio=ratio, min_per_s=floor)
    now = 1000.0
    for kind, dt in ops:
        now += dt
        if kind == "request":
            plain.record_request(now)
            shared.record_request(now)
        else:
            assert shared.try_retry(now) is plain.try_retry(now)


def test_breakers_and_budget_do_not_overlap() -> None:
    """The budget's cells follow the last breaker's: filling one leaves the other alone."""
    table = SharedState(replicas=2, window_s=3)
    d = detector(table)
    budget = SharedRetryBudget(table, ratio=0.0, min_per_s=2.0)  # 6 per window
    assert spend(budget, 10.0) == 6
    assert [d.breaker(i).state for i in (0, 1)] == [BreakerState.CLOSED] * 2
    assert open_breakers(d) == []
    fail(d, 1, 3, 0.0, members=2)
    assert open_breakers(d) == [(1, 10.0)]
    assert spend(budget, 10.5) == 0
    assert spend(budget, 13.0) == 6  # a whole window later


# ------------------------------------------------------------- one fleet-load table


def test_the_owner_publishes_one_table_that_every_worker_reads_whole() -> None:
    table = SharedState(replicas=3, workers=2)
    seen, loads = table.fleet_loads(-1.0)
    assert loads == {0: 0, 1: 0, 2: 0}  # the initial (empty) table is a table
    table.publish_loads(0, [1, 2, 3])
    table.publish_loads(1, [10, 0, 5])
    assert table.fleet_loads(seen) == (seen, None)  # nothing new until the owner publishes

    def owner() -> None:
        table.publish_fleet_loads()

    in_child(owner)
    newer, loads = table.fleet_loads(seen)
    assert newer > seen and loads == {0: 11, 1: 2, 2: 8}
    assert in_child(lambda: table.fleet_loads(seen)) == (newer, {0: 11, 1: 2, 2: 8})
    assert table.fleet_loads(newer) == (newer, None)


def test_a_table_being_written_is_not_read() -> None:
    table = SharedState(replicas=2, workers=1)
    seen, _ = table.fleet_loads(-1.0)
    table.cells[table.fleet_at] += 1.0  # the owner is mid-write: odd sequence
    assert table.fleet_loads(seen) == (seen, None)
    table.cells[table.fleet_at] += 1.0
    assert table.fleet_loads(seen)[1] is not None


def test_a_worker_sums_the_table_when_it_is_due_and_only_then() -> None:
    """Issue 28: any worker sums the rows every ``FLEET_LOADS_S`` (the owner's 50 ms let
    the table age 100 ms, and saturated replicas herded); one sum per period fleet-wide."""
    table = SharedState(replicas=2, workers=2)
    seen, _ = table.fleet_loads(-1.0)
    table.publish_loads(0, [3, 1])
    table.publish_loads(1, [2, 2])
    assert table.publish_fleet_loads_due(0.002, now=100.0)  # never summed: due
    newer, loads = table.fleet_loads(seen)
    assert newer > seen and loads == {0: 5, 1: 3}
    table.publish_loads(1, [0, 0])
    assert not table.publish_fleet_loads_due(0.002, now=100.001)  # summed 1 ms ago
    assert table.fleet_loads(newer) == (newer, None)
    assert in_child(lambda: table.publish_fleet_loads_due(0.002, now=100.003))  # another worker
    assert table.fleet_loads(newer)[1] == {0: 3, 1: 1}


def _hold_the_lock(table: SharedState, held: Connection, release: Connection) -> None:
    """A worker in the middle of a sum: the lock taken, the sequence odd, until it is
    told to finish (or killed there)."""
    with table.locked():
        table.cells[table.fleet_at] += 1.0
        held.send(True)
        release.poll(JOIN_S)
        table.cells[table.fleet_at] += 1.0


def _holder(table: SharedState) -> tuple[Any, Connection, Connection]:
    held_r, held_w = CTX.Pipe(duplex=False)
    release_r, release_w = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_hold_the_lock, args=(table, held_w, release_r))
    proc.start()
    assert held_r.poll(JOIN_S) and held_r.recv() is True
    return proc, held_r, release_w


def test_a_worker_never_waits_for_the_lock_and_the_owner_waits_for_a_live_holder() -> None:
    """A worker that finds the lock taken skips its sum (whoever holds it is summing).
    The owner waits for the holder however long it holds it: it never writes the table
    while another process is writing it (the lock this replaced gave up after 50 ms and
    wrote anyway)."""
    table = SharedState(replicas=1, workers=1)
    seen, _ = table.fleet_loads(-1.0)
    table.publish_loads(0, [7])
    proc, _, release = _holder(table)
    try:
        assert not table.publish_fleet_loads_due(0.0, now=5.0)  # does not wait
        answer_r, answer_w = CTX.Pipe(duplex=False)

        def owner() -> None:
            answer_w.send("asking")
            table.publish_fleet_loads(now=5.0)
            answer_w.send(table.cells[table.fleet_at])

        waiter = CTX.Process(target=owner)
        waiter.start()
        assert answer_r.poll(JOIN_S) and answer_r.recv() == "asking"
        assert not answer_r.poll(0.3)  # six times the old 50 ms: still waiting
        assert table.fleet_loads(seen) == (seen, None)  # nobody wrote over the holder
        release.send(True)
        assert answer_r.poll(JOIN_S), "the owner never got the lock"
        assert int(answer_r.recv()) % 2 == 0  # it summed after the holder finished
        waiter.join(JOIN_S)
    finally:
        proc.join(JOIN_S)
    assert table.fleet_loads(seen)[1] == {0: 7}


def test_the_lock_dies_with_its_holder_and_the_owner_mends_the_table() -> None:
    """A worker killed while holding the lock, mid-sum: the kernel releases the lock with
    the process, so the owner's next sum goes ahead (no timeout), and mends the odd
    sequence the worker left, so the table never freezes."""
    table = SharedState(replicas=1, workers=1)
    seen, _ = table.fleet_loads(-1.0)
    table.publish_loads(0, [7])
    proc, _, _ = _holder(table)
    proc.kill()  # SIGKILL, with the lock held and the sequence odd
    proc.join(JOIN_S)
    assert int(table.cells[table.fleet_at]) % 2 == 1
    assert table.fleet_loads(seen) == (seen, None)
    in_child(lambda: table.publish_fleet_loads(now=5.0))  # bounded: in_child's join
    assert int(table.cells[table.fleet_at]) % 2 == 0
    assert table.fleet_loads(seen)[1] == {0: 7}
    assert table.publish_fleet_loads_due(0.0, now=6.0)  # and the lock is free again


def test_the_lock_is_not_reentrant() -> None:
    """A second acquire by the holder would not block (a record lock is the process's)
    and its release would free the first: it raises instead."""
    table = SharedState(replicas=1)
    with table.locked(), pytest.raises(RuntimeError, match="not reentrant"):
        table.publish_fleet_loads_due(0.0, now=1.0)
    assert table.publish_fleet_loads_due(0.0, now=1.0)  # released on the way out
