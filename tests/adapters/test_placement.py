"""Properties of the placement core (``gateway/adapters/placement.py``).

A stateful machine drives one fleet through runs and replicas joining and leaving and checks,
after each event, the minimal-movement definition of that event from the module docstring,
and that the documented reconcile order keeps the budget and every run routable. ``@given``
tests cover arbitrary inputs (validity, determinism, admission, diff). The invariants are
plain functions, so a shrunk failure can be replayed as an example test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gateway.adapters.placement import (
    Change,
    Move,
    Placement,
    PlacementError,
    admit,
    churn,
    diff,
    place,
    release,
    run_slots,
    stranded,
)

RUN_NAMES = [f"r{i}" for i in range(12)]
REPLICA_IDS = st.integers(0, 7)
BUDGETS = st.integers(0, 9)
SLOTS = st.integers(1, 5)
runs_st = st.dictionaries(st.sampled_from(RUN_NAMES), SLOTS, max_size=8)
budgets_st = st.dictionaries(REPLICA_IDS, BUDGETS, max_size=6)
K = TypeVar("K", int, str)
FAST = settings(max_examples=150, deadline=None)


def settle(result: Placement | PlacementError) -> Placement:
    return result if isinstance(result, Placement) else result.best_effort


@st.composite
def fleets(draw: st.DrawFn) -> Placement:
    """A placement reached by a short history, so ``previous`` is path-dependent."""
    p = settle(place(Placement.empty({}), draw(runs_st), draw(budgets_st)))
    for runs, budgets in draw(st.lists(st.tuples(runs_st, budgets_st), max_size=3)):
        p = settle(place(p, runs, budgets))
    return p


# ----------------------------------------------------------------- invariants


def check_valid(p: Placement, runs: Mapping[str, int], budgets: Mapping[int, int]) -> None:
    """Never over budget, counted from the pairs (not from the object's own loads)."""
    assert dict(p.budgets) == dict(budgets)
    assert all(runs[run] == n for run, n in p.slots.items())
    used: Counter[int] = Counter()
    for run, r in p.pairs():
        assert r in budgets
        used[r] += runs[run]
    for r, b in budgets.items():
        assert used[r] == p.load(r) <= b, f"replica {r}: {used[r]} > {b}"
    for run in p.runs:
        assert p.homes(run) and p.ordered_homes(run) == tuple(sorted(p.homes(run)))


def headroom(p: Placement, previous: Placement | None = None) -> int:
    """Independent of ``Placement.headroom``: the most a replica can free of extra homes.
    A run's only home is pinned, and so is the last of its ``previous`` homes it kept
    (evicting that one would relocate it: ``test_replica_joining_never_relocates...``)."""
    pinned: Counter[int] = Counter()
    for run in p.runs:
        kept = p.homes(run) & previous.homes(run) if previous is not None else frozenset()
        only = p.homes(run) if len(p.homes(run)) == 1 else kept if len(kept) == 1 else None
        if only:
            pinned[next(iter(only))] += p.slots[run]
    return max((b - pinned[r] for r, b in p.budgets.items()), default=0)


def check_saturated(p: Placement) -> None:
    """Spread is done: no run could gain another home."""
    for run in p.runs:
        for r in p.replicas - p.homes(run):
            assert p.free(r) < p.slots[run], f"{run} could still gain replica {r}"


def check_outcome(
    result: Placement | PlacementError,
    runs: Mapping[str, int],
    budgets: Mapping[int, int],
    previous: Placement | None = None,
) -> Placement:
    p = settle(result)
    check_valid(p, runs, budgets)
    check_saturated(p)
    if isinstance(result, PlacementError):
        assert set(result.needs) == set(runs) - p.runs and result.needs
        for run, need in result.needs.items():
            assert need > headroom(p, previous), f"{run} was refused but fits"
            assert f"run {run!r} needs {need}" in str(result)
    else:
        assert p.runs == set(runs)
    return p


def lost(p: Placement, q: Placement, run: str) -> frozenset[int]:
    return p.homes(run) - q.homes(run)


def check_irredundant(p: Placement, q: Placement) -> None:
    """Budgets and slots unchanged: no removed pair could be put back, and every run with a
    surviving home keeps one of its old homes (it is never relocated)."""
    for run, r in p.pairs() - q.pairs():
        if run in q and r in q.replicas:
            assert q.load(r) + q.slots[run] > q.budgets[r], f"({run}, {r}) removed needlessly"
    for run in p.runs & q.runs:
        if p.homes(run) & q.replicas:
            assert p.homes(run) & q.homes(run), f"{run} was relocated"


def apply(pairs: Iterable[tuple[str, int]], moves: Iterable[Move]) -> set[tuple[str, int]]:
    out = set(pairs)
    for m in moves:
        if m.change is Change.LOSE:
            out.remove((m.run, m.replica))
        else:
            assert (m.run, m.replica) not in out
            out.add((m.run, m.replica))
    return out


def check_reconcile(p: Placement, q: Placement) -> None:
    """Replay ``diff`` in the documented order: routable homes hold the run's versions,
    no replica is ever over budget, and a run that keeps an old home is always routable."""
    moves = diff(p, q)
    assert apply(p.pairs(), moves) == set(q.pairs())
    changes = [m.change for m in moves]
    assert changes == sorted(changes, key=lambda c: c is Change.GAIN)  # losses first
    # A run whose slots changed is a redefinition outside the diff: count it at its new size.
    size = {**p.slots, **q.slots}
    loaded = {r: sum(size[run] for run, x in p.pairs() if x == r) for r in q.replicas}
    routable = {(run, r) for run, r in p.pairs() if r in q.replicas}
    keeps = {run for run in p.runs & q.runs if p.homes(run) & q.homes(run)}
    for m in moves:
        pair = (m.run, m.replica)
        if m.change is Change.LOSE:
            if m.replica not in q.replicas:
                continue  # the replica left: nothing to unload
            routable.remove(pair)  # stop routing first ...
            loaded[m.replica] -= size[m.run]  # ... then unload
        else:
            loaded[m.replica] += q.slots[m.run]  # load first ...
            assert loaded[m.replica] <= q.budgets[m.replica], f"over budget at {m}"
            routable.add(pair)  # ... then route
        for run in keeps:
            assert any(x == run for x, _ in routable), f"{run} unroutable at {m}"
    assert routable == set(q.pairs())
    assert loaded == {r: q.load(r) for r in q.replicas}
    assert churn(p, q) == sum(1 for m in moves if m.replica in q.replicas) <= len(moves)


# ----------------------------------------------------------------- stateful


class FleetMachine(RuleBasedStateMachine):
    """One fleet through runs and replicas joining and leaving, one event at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.p = Placement.empty({})

    def event(
        self,
        result: Placement | PlacementError,
        runs: Mapping[str, int],
        budgets: Mapping[int, int],
    ) -> Placement:
        q = check_outcome(result, runs, budgets, self.p)
        check_reconcile(self.p, q)
        check_irredundant(self.p, q)
        return q

    @initialize(budgets=st.dictionaries(REPLICA_IDS, st.integers(2, 9), min_size=2, max_size=5))
    def fleet(self, budgets: dict[int, int]) -> None:
        self.p = Placement.empty(budgets)

    @rule(r=REPLICA_IDS, budget=BUDGETS)
    def replica_joins(self, r: int, budget: int) -> None:
        if r in self.p.replicas:
            return
        budgets = {**self.p.budgets, r: budget}
        q = self.event(place(self.p, self.p.slots, budgets), self.p.slots, budgets)
        for run in self.p.runs:
            assert self.p.homes(run) <= q.homes(run), f"{run} lost a home on a replica join"
        self.p = q

    @precondition(lambda self: self.p.replicas)
    @rule(data=st.data())
    def replica_leaves(self, data: st.DataObject) -> None:
        p, gone = self.p, data.draw(st.sampled_from(sorted(self.p.replicas)))
        budgets = {r: b for r, b in p.budgets.items() if r != gone}
        q = self.event(place(p, p.slots, budgets), p.slots, budgets)
        homeless = {run for run in p.runs if p.homes(run) == {gone}}
        assert p.runs - homeless <= q.runs, "a run that kept a home was unplaced"
        event(f"replica leaves: {len(homeless)} homeless, {len(p.runs - q.runs)} unplaced")
        rehomed = set().union(*(q.homes(h) for h in homeless & q.runs))
        for run in p.runs - homeless:
            # only extra homes (check_irredundant), only where a homeless run was re-homed
            assert lost(p, q, run) - {gone} <= rehomed
            if not homeless and gone not in p.homes(run):
                assert q.homes(run) == p.homes(run), f"{run} moved though no run was homeless"
        self.p = q

    @rule(run=st.sampled_from(RUN_NAMES), slots=SLOTS)
    def run_joins(self, run: str, slots: int) -> None:
        p = self.p
        if run in p:
            return
        result = admit(p, run, slots)
        assert isinstance(result, Placement) == (slots <= headroom(p))
        assert (slots <= p.max_loras(run)) == isinstance(result, Placement)  # TRL's check
        if isinstance(result, PlacementError):
            event("run joins: refused")
            assert result.best_effort == p and set(result.needs) == {run}
            assert f"needs {slots}" in str(result)
            return
        q = self.event(result, {**p.slots, run: slots}, p.budgets)
        assert q.max_loras(run) == slots
        touched = {r for other in p.runs for r in lost(p, q, other)}
        if any(p.free(r) >= slots for r in p.replicas):
            assert not touched, "evicted though a replica had room"
        assert len(touched) <= 1 and touched <= q.homes(run)
        event(f"run joins: {'evicts' if touched else 'fits'}, {len(q.homes(run))} homes")
        self.p = q

    @precondition(lambda self: self.p.runs)
    @rule(data=st.data())
    def run_leaves(self, data: st.DataObject) -> None:
        p, run = self.p, data.draw(st.sampled_from(sorted(self.p.runs)))
        rest = {other: n for other, n in p.slots.items() if other != run}
        q = self.event(release(p, run), rest, p.budgets)
        assert run not in q and not q.homes(run)
        for other in q.runs:
            assert p.homes(other) <= q.homes(other), f"{other} lost a home when {run} left"
        self.p = q

    @invariant()
    def valid_and_saturated(self) -> None:
        check_valid(self.p, self.p.slots, self.p.budgets)
        check_saturated(self.p)


FleetMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFleetMachine = FleetMachine.TestCase


# ----------------------------------------------------------------- @given


@FAST
@given(fleets(), runs_st, budgets_st)
def test_place_is_valid_saturated_and_refuses_only_what_cannot_fit(
    p: Placement, runs: dict[str, int], budgets: dict[int, int]
) -> None:
    q = check_outcome(place(p, runs, budgets), runs, budgets, p)
    check_reconcile(p, q)


@FAST
@given(fleets(), runs_st, budgets_st)
def test_place_is_deterministic_and_ignores_insertion_order(
    p: Placement, runs: dict[str, int], budgets: dict[int, int]
) -> None:
    def rev(d: Mapping[K, int]) -> dict[K, int]:
        return dict(reversed(list(d.items())))

    p2 = Placement(
        rev(p.budgets), rev(p.slots), {run: p.homes(run) for run in reversed(sorted(p.runs))}
    )
    assert p2 == p and hash(p2) == hash(p)
    a, b = place(p, runs, budgets), place(p2, rev(runs), rev(budgets))
    assert settle(a) == settle(b)
    assert getattr(a, "needs", None) == getattr(b, "needs", None)
    assert str(a) == str(b)


@FAST
@given(fleets(), st.sampled_from(RUN_NAMES), SLOTS)
def test_admit_fails_iff_it_cannot_fit_and_then_changes_nothing(
    p: Placement, run: str, slots: int
) -> None:
    result = admit(p, run, slots)
    if run in p and p.slots[run] == slots:
        assert result is p  # idempotent
    elif isinstance(result, PlacementError):
        assert slots > headroom(p) or run in p
        assert result.best_effort is p and f"run {run!r} needs {slots}" in str(result)
    else:
        assert run in p or slots <= headroom(p)
        assert set(result.runs) == set(p.runs) | {run}


@FAST
@given(fleets(), fleets())
def test_diff_round_trips_losses_first(p: Placement, q: Placement) -> None:
    moves = diff(p, q)
    assert apply(p.pairs(), moves) == set(q.pairs())
    assert len(set(moves)) == len(moves)
    assert [m.change for m in moves] == sorted((m.change for m in moves), key=Change.GAIN.__eq__)
    assert diff(q, q) == () and churn(q, q) == 0


# ----------------------------------------------------------------- examples


def test_sixteen_runs_on_eight_tight_replicas_get_one_or_two_homes() -> None:
    budgets = dict.fromkeys(range(8), 9)  # 3 runs of 3 slots per replica
    runs = {f"run-{i:02d}": run_slots(1) for i in range(16)}
    p = place(Placement.empty(budgets), runs, budgets)
    assert isinstance(p, Placement)
    assert Counter(len(p.homes(run)) for run in p.runs) == {1: 8, 2: 8}
    assert all(p.load(r) == 9 for r in budgets)
    assert all(p.max_loras(run) == 3 for run in runs)


def test_sixteen_runs_joining_one_by_one_each_cost_one_eviction_once_full() -> None:
    budgets = dict.fromkeys(range(8), 9)
    p = Placement.empty(budgets)
    costs = []
    for i in range(16):
        q = admit(p, f"run-{i:02d}", 3)
        assert isinstance(q, Placement)
        costs.append(churn(p, q))
        p = q
    assert costs == [8, 8, 8] + [2] * 13  # homed everywhere; then evict one, load one
    assert sum(len(p.homes(run)) for run in p.runs) == 24
    # joins take from the richest; the first runs keep the rest (no rebalancing moves)
    assert sorted(len(p.homes(run)) for run in p.runs) == [1] * 13 + [3, 4, 4]
    full = p
    for i in range(16, 24):  # 24 single homes fill the fleet; then every replica is pinned
        q = admit(full, f"run-{i:02d}", 3)
        assert isinstance(q, Placement) and churn(full, q) == 2
        full = q
    assert isinstance(admit(full, "run-24", 3), PlacementError)
    for i in range(0, 16, 2):  # half leave: the rest only gain homes
        q = release(p, f"run-{i:02d}")
        assert all(p.homes(run) <= q.homes(run) for run in q.runs)
        p = q
    assert sorted(len(p.homes(run)) for run in p.runs) == [2, 3, 3, 3, 3, 3, 3, 4]


def test_single_run_with_ample_budget_is_homed_everywhere() -> None:
    budgets = dict.fromkeys(range(4), 8)
    p = admit(Placement.empty(budgets), "solo", run_slots(2))
    assert isinstance(p, Placement)
    assert p.ordered_homes("solo") == (0, 1, 2, 3)
    assert p.max_loras("solo") == 4 and p.load(0) == 4 and p.free(0) == 4


def test_error_names_the_budget_and_changes_nothing() -> None:
    budgets = {0: 4, 1: 4}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    assert p.ordered_homes("a") != p.ordered_homes("b")  # one home each: every replica pinned
    err = admit(p, "c", 3)
    assert isinstance(err, PlacementError) and err.best_effort is p and err.needs == {"c": 3}
    msg = str(err)
    assert "run 'c' needs 3 adapter slots" in msg and "budget is 4" in msg
    assert "--max-loras" in msg and "at most 1 can be freed" in msg
    assert p.max_loras("c") == 1  # TRL's max_loras >= max_staleness + 2 check fails too


def test_error_for_a_run_larger_than_any_replica_or_an_empty_fleet() -> None:
    err = admit(Placement.empty({0: 4, 1: 6}), "big", 7)
    assert isinstance(err, PlacementError)
    assert "more than any replica holds" in str(err) and "0: 4, 1: 6" in str(err)
    err = admit(Placement.empty({}), "a", 2)
    assert isinstance(err, PlacementError) and "no replicas" in str(err)


def test_replica_leaving_a_full_fleet_unplaces_whole_runs_only() -> None:
    budgets = {0: 3, 1: 3}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    result = place(p, p.slots, {0: 3})
    assert isinstance(result, PlacementError) and len(result.needs) == 1
    (kept,) = result.best_effort.runs
    assert result.best_effort.homes(kept) == {0} and kept == next(iter(p.runs - {*result.needs}))


def test_replica_leaving_rehomes_its_run_by_evicting_an_extra_home() -> None:
    budgets = {0: 3, 1: 3, 2: 3}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    (rich,) = (run for run in p.runs if len(p.homes(run)) == 2)
    ((poor, (gone,)),) = ((run, p.ordered_homes(run)) for run in p.runs if run != rich)
    q = place(p, p.slots, {r: b for r, b in budgets.items() if r != gone})
    assert isinstance(q, Placement) and len(q.homes(poor)) == len(q.homes(rich)) == 1
    assert q.homes(rich) < p.homes(rich) and [m.change for m in diff(p, q)] == [
        Change.LOSE,
        Change.LOSE,
        Change.GAIN,
    ]
    assert churn(p, q) == 2  # unload the extra home, load the re-homed run


def test_budget_shrink_is_repaired_without_going_over() -> None:
    budgets = {0: 6, 1: 6}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    assert p.load(0) == p.load(1) == 6
    q = place(p, p.slots, {0: 3, 1: 6})
    assert isinstance(q, Placement) and q.load(0) == 3 and q.runs == {"a", "b"}


def test_placement_refuses_invalid_states() -> None:
    with pytest.raises(ValueError, match="over budget"):
        Placement({0: 2}, {"a": 3}, {"a": [0]})
    with pytest.raises(ValueError, match="no home"):
        Placement({0: 4}, {"a": 3}, {})
    with pytest.raises(ValueError, match="unknown replica"):
        Placement({0: 4}, {"a": 3}, {"a": [1]})
    with pytest.raises(ValueError, match="must be >= 1"):
        place(Placement.empty({}), {"a": 0}, {0: 4})
    with pytest.raises(ValueError):
        run_slots(-1)
    assert run_slots(0) == 2


def test_replica_joining_never_relocates_a_run_that_spreading_gave_a_new_home() -> None:
    # Found by the reload state machine (tests/runs/test_lifecycle.py): a and b fill half
    # of replica 0; c (3) and d (4) do not fit beside them. Replica 1 joins: d takes it,
    # c still fails, spreading gives a an extra home on 1, and the retry for c used to
    # evict a's *old* home on 0 (a moved from 0 to 1 on a join that must move nothing).
    first = settle(place(Placement.empty({0: 6}), {"a": 2, "b": 2}, {0: 6}))
    late = place(first, {"a": 2, "b": 2, "c": 3, "d": 4}, {0: 6})
    assert isinstance(late, PlacementError)
    p = late.best_effort
    assert p.homes("a") == p.homes("b") == {0} and not p.homes("c") and not p.homes("d")
    result = place(p, {"a": 2, "b": 2, "c": 3, "d": 4}, {0: 6, 1: 6})
    q = result.best_effort if isinstance(result, PlacementError) else result
    assert all(p.homes(run) <= q.homes(run) for run in p.runs), (p, q)
    assert q.homes("d") == {1}


# ----------------------------------------------------------------- replicas down


@st.composite
def downs(draw: st.DrawFn) -> tuple[Placement, frozenset[int]]:
    """A placement and some of its replicas out of rotation."""
    p = draw(fleets())
    down = draw(st.frozensets(st.sampled_from(sorted(p.replicas)))) if p.replicas else frozenset()
    return p, down


@FAST
@given(downs())
def test_replicas_down_rehome_only_stranded_runs_onto_up_replicas(
    case: tuple[Placement, frozenset[int]],
) -> None:
    """The decision a health round's ejections trigger (``place(..., down)``): a run whose
    homes are all down moves to up replicas or is left unplaced (only when no up replica
    has room for it); every other run keeps its homes on the down replicas and an up home;
    no down replica gains a home; nothing is over budget."""
    p, down = case
    result = place(p, p.slots, p.budgets, down)
    q = settle(result)
    check_valid(q, p.slots, p.budgets)
    cut = stranded(p, down)
    assert all(r not in down for _, r in q.pairs() - p.pairs()), "a down replica gained a home"
    for run in q.runs:
        assert q.homes(run) - down, f"{run} is placed on down replicas only"
    for run in p.runs - cut:
        assert run in q and p.homes(run) & down <= q.homes(run), f"{run} lost a down home"
        assert p.homes(run) & q.homes(run) - down, f"{run} was relocated"
    for run in cut:
        assert not q.homes(run) & down, f"{run} kept a home that is down"
        if run not in q:  # unplaced: no up replica could take it, even evicting extra homes
            assert isinstance(result, PlacementError) and run in result.needs
            assert all(q.free(r) < q.slots.get(run, p.slots[run]) for r in q.replicas - down)
    if not cut:  # nothing stranded: the down replicas change nothing
        assert q == p


@FAST
@given(downs())
def test_a_moved_run_does_not_move_back_when_its_old_home_returns(
    case: tuple[Placement, frozenset[int]],
) -> None:
    """Stability: once re-placed, every home survives the down replicas' return (they may
    only gain homes by spreading), when the re-placement placed every run."""
    p, down = case
    moved = place(p, p.slots, p.budgets, down)
    if isinstance(moved, PlacementError):
        event("a stranded run found no room")
        return
    back = place(moved, moved.slots, moved.budgets)
    assert isinstance(back, Placement) and moved.pairs() <= back.pairs(), (moved, back)


def test_a_run_whose_only_home_is_down_takes_an_extra_home_of_another_run() -> None:
    budgets = {0: 3, 1: 3, 2: 3}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    (rich,) = (run for run in p.runs if len(p.homes(run)) == 2)
    ((poor, (home,)),) = ((run, p.ordered_homes(run)) for run in p.runs if run != rich)
    assert stranded(p, {home}) == {poor} and stranded(p, set(p.homes(rich))) == {rich}
    q = place(p, p.slots, budgets, {home})
    assert isinstance(q, Placement), q
    assert len(q.homes(poor)) == 1 and q.homes(poor) < p.homes(rich)
    assert q.homes(rich) == p.homes(rich) - q.homes(poor)
    # the move: the rich run's extra home is unloaded first, then the poor run loaded there
    assert [(m.change, m.run) for m in diff(p, q) if m.replica != home] == [
        (Change.LOSE, rich),
        (Change.GAIN, poor),
    ]
    assert home not in q.homes(poor)  # its old home is down: nothing placed there
    back = place(q, q.slots, budgets)  # back up: nothing moves back, its room is spread
    assert isinstance(back, Placement) and q.pairs() < back.pairs() and back.load(home) == 3


def test_a_stranded_run_with_no_room_on_up_replicas_is_unplaced_until_its_home_returns() -> None:
    budgets = {0: 3, 1: 3}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    ((home,),) = (p.ordered_homes("b"),)
    result = place(p, p.slots, budgets, {home})
    assert isinstance(result, PlacementError) and set(result.needs) == {"b"}
    q = result.best_effort
    assert q.homes("a") == p.homes("a") and "b" not in q and q.free(home) == 3
    back = place(q, p.slots, budgets)
    assert isinstance(back, Placement) and back.homes("b") == {home}


def test_every_replica_down_unplaces_every_run() -> None:
    """Nothing can serve anywhere: moving would gain nothing, and every run is stranded
    with nowhere to go, so each is unplaced rather than pointed at a dead replica."""
    budgets = {0: 6, 1: 6}
    p = settle(place(Placement.empty(budgets), {"a": 3, "b": 3}, budgets))
    result = place(p, p.slots, budgets, {0, 1})
    assert isinstance(result, PlacementError) and set(result.needs) == {"a", "b"}
    assert not result.best_effort.runs
