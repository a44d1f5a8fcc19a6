"""The fair share's pure core (``gateway.runs.fairshare``): guaranteed shares, borrowing,
weighted fair order, the idle window, overflow and removal; then a hypothesis state
machine over any interleaving of requests, placements, releases and removals."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.runs.fairshare import LOOKAHEAD, FairShare, Ticket


def req(
    share: FairShare, run: str, candidates: list[int], now: float, weight: float = 1,
    prefer: int | None = None,
) -> Ticket:  # fmt: skip
    ticket, granted = share.request(run, weight, candidates, now, prefer)
    assert granted == []  # nothing here changes a weight or a home set
    return ticket


def test_free_slots_are_taken_at_once_on_the_least_used_candidate() -> None:
    share = FairShare(capacity=4, idle_s=10)
    a = req(share, "a", [0, 1], now=0)
    b = req(share, "a", [0, 1], now=0)
    assert not a.waiting and not b.waiting
    assert {a.replica, b.replica} == {0, 1}
    assert share.charged("a") == 2 and share.used(0) == share.used(1) == 1


def test_a_lone_run_may_fill_the_replica_and_then_waits() -> None:
    share = FairShare(capacity=2, idle_s=10)
    held = [req(share, "a", [0], now=0) for _ in range(3)]
    assert [t.waiting for t in held] == [False, False, True]
    assert share.waiting("a") == 1
    granted = share.release(held[0], now=1)
    assert granted == [held[2]] and held[2].replica == 0 and share.waiting("a") == 0


def test_a_run_under_its_share_goes_before_the_floods_backlog() -> None:
    share = FairShare(capacity=4, idle_s=10)
    flood = [req(share, "a", [0], now=0) for _ in range(10)]
    running = [t for t in flood if not t.waiting]
    assert len(running) == 4  # alone, a borrows every slot
    b = [req(share, "b", [0], now=1) for _ in range(2)]
    assert all(t.waiting for t in b)  # full: b waits for a's rollouts to end...
    assert share.release(running[0], now=2) == [b[0]]  # ...but not behind a's 6 waiting
    assert share.release(running[1], now=2) == [b[1]]
    # b is active and holds 2 of its share of 2: a gets the next ones again
    assert share.release(running[2], now=3) == [flood[4]]


def test_an_active_runs_unused_share_is_kept_free_for_it() -> None:
    share = FairShare(capacity=4, idle_s=10)
    b = req(share, "b", [0], now=0)
    share.release(b, now=0)  # b is active (idle_s) but holds nothing
    a = [req(share, "a", [0], now=1) for _ in range(4)]
    assert [t.waiting for t in a] == [False, False, True, True]  # b's share stays free
    b2 = [req(share, "b", [0], now=2) for _ in range(2)]
    assert not any(t.waiting for t in b2)  # so b starts at once


def test_an_idle_runs_share_is_lent_in_full_after_idle_s() -> None:
    share = FairShare(capacity=4, idle_s=10)
    share.release(req(share, "b", [0], now=0), now=0)
    a = [req(share, "a", [0], now=10.5) for _ in range(4)]
    assert not any(t.waiting for t in a)


def test_saturating_runs_get_slots_in_proportion_to_their_weights() -> None:
    share = FairShare(capacity=6, idle_s=10)
    weights = {"a": 3.0, "b": 1.0}
    running: list[Ticket] = []
    for run, w in weights.items():
        for _ in range(1000):  # both stay backlogged throughout
            ticket = req(share, run, [0, 1], now=0, weight=w)
            if not ticket.waiting:
                running.append(ticket)
    started: Counter[str] = Counter(t.run for t in running)
    for step in range(300):  # the oldest ends, whoever it was; the freed slot is granted
        done = running.pop(0)
        granted = share.release(done, now=step * 0.01)
        running.extend(granted)
        started.update(t.run for t in granted)
    assert started["a"] / started["b"] == pytest.approx(3.0, rel=0.1)


def test_placing_moves_the_charge_to_the_replica_routing_chose() -> None:
    share = FairShare(capacity=2, idle_s=10)
    t = req(share, "a", [0, 1], now=0)
    other = 1 - t.replica
    assert share.place(t, other, now=0) == []
    assert t.replica == other and share.used(other) == 1 and share.used(1 - other) == 0


def test_routing_chooses_only_among_replicas_with_room() -> None:
    share = FairShare(capacity=2, idle_s=10)
    full = [req(share, "a", [0], now=0) for _ in range(2)]
    assert all(t.replica == 0 for t in full)
    t = req(share, "a", [0, 1], now=0)
    assert t.replica == 1 and share.room(t, [0, 1], now=0) == [1]  # replica 0 is full
    share.release(full[0], now=1)
    assert share.room(t, [0, 1], now=1) == [0, 1]


def test_a_free_slot_is_taken_on_the_preferred_replica_first() -> None:
    share = FairShare(capacity=2, idle_s=10)
    t = req(share, "a", [0, 1], now=0, prefer=1)
    assert t.replica == 1  # not the least used (a tie, which would be 0)
    assert req(share, "a", [0, 1], now=0, prefer=7).prefer is None  # not a candidate


def test_a_freed_slot_goes_to_the_oldest_waiter_that_prefers_its_replica() -> None:
    share = FairShare(capacity=2, idle_s=10)
    running = [req(share, "a", [0, 1], now=0, prefer=r) for r in (0, 0, 1, 1)]
    assert [t.replica for t in running] == [0, 0, 1, 1]
    # a flood's groups wait, each for its own prefix's replica
    waiting = [req(share, "a", [0, 1], now=0, prefer=r) for r in (0, 0, 1, 1, 0)]
    assert all(t.waiting for t in waiting)
    assert share.release(running[2], now=1) == [waiting[2]]  # replica 1 freed: the 1st for 1
    assert waiting[2].replica == 1
    assert share.release(running[0], now=1) == [waiting[0]]
    assert share.release(running[3], now=1) == [waiting[3]]
    # nobody left prefers replica 1: the run's oldest takes it rather than leave it free
    assert share.release(waiting[2], now=2) == [waiting[1]] and waiting[1].replica == 1
    assert share.waiting("a") == 1


def test_taking_a_later_waiter_first_keeps_the_runs_tags_in_order() -> None:
    share = FairShare(capacity=1, idle_s=10)
    first = [req(share, r, [r], now=0, prefer=r) for r in (0, 1)]  # "0" on 0, "1" on 1
    waiting = [req(share, "x", [0, 1], now=0, prefer=r) for r in (0, 1, 0)]
    tags = [t.tag for t in waiting]
    assert share.release(first[1], now=1) == [waiting[1]]  # the second, out of order
    assert waiting[1].tag == tags[0]  # it consumed the run's smallest tag
    assert [waiting[0].tag, waiting[2].tag] == tags[1:]  # the rest stay ordered


def test_a_head_passed_over_lookahead_times_goes_first_wherever_it_may() -> None:
    share = FairShare(capacity=1, idle_s=10)
    busy = req(share, "a", [0, 1], now=0, prefer=0)
    spare = req(share, "a", [0, 1], now=0, prefer=1)
    head = req(share, "a", [0, 1], now=0, prefer=0)  # waits for replica 0, held for ever
    later = [req(share, "a", [0, 1], now=0, prefer=1) for _ in range(LOOKAHEAD + 1)]
    running = spare
    for i in range(LOOKAHEAD):  # each slot freed on 1 goes to a later waiter preferring 1
        assert share.release(running, now=i) == [later[i]]
        running = later[i]
    assert head.passed == LOOKAHEAD and head.waiting
    assert share.release(running, now=LOOKAHEAD) == [head] and head.replica == 1
    assert busy.replica == 0


def test_overflow_sends_a_waiter_beyond_capacity_and_is_released_like_any_slot() -> None:
    share = FairShare(capacity=1, idle_s=10)
    first = req(share, "a", [0], now=0)
    late = req(share, "a", [0], now=0)
    assert share.overflow(late, now=0) == []
    assert not late.waiting and late.overflow and share.used(0) == 2
    share.release(late, now=1)
    share.release(first, now=1)
    assert share.used(0) == 0 and share.charged("a") == 0


def test_a_waiter_that_leaves_is_dropped_from_its_queue() -> None:
    share = FairShare(capacity=1, idle_s=10)
    first = req(share, "a", [0], now=0)
    gone = req(share, "a", [0], now=0)
    share.release(gone, now=0)
    assert share.waiting("a") == 0
    assert share.release(first, now=1) == []


def test_forgetting_a_run_frees_its_slots_and_returns_its_waiters() -> None:
    share = FairShare(capacity=1, idle_s=10)
    held = req(share, "a", [0], now=0)
    waiting = req(share, "a", [0], now=0)
    b = req(share, "b", [0], now=0)
    assert share.forget("a", now=1) == ([waiting], [b])  # a's slot goes to b at once
    assert share.used(0) == 1
    assert share.release(held, now=1) == []  # a's slot was already freed by forget
    assert share.used(0) == 1 and b.replica == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        FairShare(capacity=0, idle_s=1)


RUNS = ("a", "b", "c")


class FairMachine(RuleBasedStateMachine):
    """Any interleaving: the books always add up, nothing is granted beyond capacity but
    an overflow, and no ticket waits while one of its candidates would take it."""

    def __init__(self) -> None:
        super().__init__()
        self.share = FairShare(capacity=3, idle_s=5)
        self.now = 0.0
        self.running: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self.gone: set[str] = set()

    def _granted(self, granted: list[Ticket]) -> None:
        for t in granted:
            self.waiting.remove(t)
            self.running.append(t)
            assert self.share.used(t.replica) <= self.share.capacity

    @rule(run=st.sampled_from(RUNS), weight=st.sampled_from([0.5, 1.0, 3.0]),
          candidates=st.sets(st.integers(0, 2), min_size=1, max_size=3),
          prefer=st.none() | st.integers(0, 2))  # fmt: skip
    def request(self, run: str, weight: float, candidates: set[int], prefer: int | None) -> None:
        self.gone.discard(run)
        t, granted = self.share.request(run, weight, sorted(candidates), self.now, prefer)
        (self.waiting if t.waiting else self.running).append(t)
        self._granted([g for g in granted if g is not t])
        if not t.waiting:
            assert self.share.used(t.replica) <= self.share.capacity

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.running))
        self.running.remove(t)
        self._granted(self.share.release(t, self.now))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def leave_while_waiting(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(t)
        self._granted(self.share.release(t, self.now))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def overflow(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.waiting))
        granted = self.share.overflow(t, self.now)
        self.waiting.remove(t)
        self.running.append(t)
        self._granted(granted)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        """The routing decision picks any replica the ticket has room on."""
        t = data.draw(st.sampled_from(self.running))
        room = self.share.room(t, t.candidates, self.now)
        assert t.replica in room
        self._granted(self.share.place(t, data.draw(st.sampled_from(room)), self.now))

    @invariant()
    def no_replica_is_sent_more_than_its_capacity_but_overflows(self) -> None:
        for r in range(3):
            overflows = sum(t.overflow and t.replica == r for t in self.running)
            assert self.share.used(r) <= self.share.capacity + overflows

    @rule(dt=st.sampled_from([0.5, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._granted(self.share.grant(self.now))

    @rule(run=st.sampled_from(RUNS))
    def forget(self, run: str) -> None:
        dropped, granted = self.share.forget(run, self.now)
        assert sorted(map(id, dropped)) == sorted(id(t) for t in self.waiting if t.run == run)
        self.waiting = [t for t in self.waiting if t.run != run]
        self.running = [t for t in self.running if t.run != run]
        self._granted(granted)
        self.gone.add(run)

    @invariant()
    def books_add_up(self) -> None:
        per_replica: Counter[int] = Counter(t.replica for t in self.running)
        for r in range(3):
            assert self.share.used(r) == per_replica[r], (r, self.running)
        for run in RUNS:
            assert self.share.charged(run) == sum(t.run == run for t in self.running)
            assert self.share.waiting(run) == sum(t.run == run for t in self.waiting)

    @invariant()
    def nothing_waits_that_could_go(self) -> None:
        # every event that frees a slot grants at once: a grant now finds nothing to do
        assert self.share.grant(self.now) == []


FairMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestFairMachine = FairMachine.TestCase
