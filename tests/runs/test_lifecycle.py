"""The run-lifecycle core (``gateway/runs/lifecycle.py``): a stateful machine reloads the
run set (runs added, removed, re-keyed, re-limited) while replicas join and leave, in any
order, and checks after each step what a reload promises: every placed run's homes are
members, no replica holds more than its budget, a removed run holds no homes once gone,
and runs a reload keeps keep their homes when they still fit."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.adapters.placement import Placement
from gateway.runs.lifecycle import DEPARTED_KEEP_S, Departed, plan, replace
from gateway.runs.table import Run, RunTable
from gateway.runs.usage import RunUsage

NAMES = [f"run-{i}" for i in range(6)]


def run(name: str, key: int = 0, staleness: int = 1, cap: int | None = None) -> Run:
    return Run(name, f"k-{name}-{key}".encode(), staleness, (Path(f"/r/{name}"),), cap)


class ReloadMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(3, 10), replicas=st.integers(1, 4))
    def start(self, budget: int, replicas: int) -> None:
        self.budget = budget
        self.members = set(range(replicas))
        self.next_replica = replicas
        self.table = RunTable([])
        self.leaving: dict[str, int] = {}  # removed, still draining: name -> slots
        self.gone: set[str] = set()
        self.placement = Placement.empty(dict.fromkeys(self.members, budget))
        self.failed: dict[str, str] = {}

    def slots(self) -> dict[str, int]:
        return {**{r.name: r.slots for r in self.table.runs}, **self.leaving}

    def reload(self, new: RunTable) -> None:
        p = plan(self.table, new, self.leaving)
        assert p.refused is None, p.refused
        before, unplaced = self.placement, self.failed
        self.leaving.update({n: self.table[n].slots for n in p.removed})
        self.table = new
        self.placement, self.failed = replace(before, self.slots(), self.members, self.budget)
        if not p.added and not p.windowed and not unplaced:
            # only keys, caps, removals (still holding their slots): nothing moves. (A run
            # that did not fit before may be placed now, taking another run's extra home.)
            assert self.placement == before or self.failed
        for name in p.removed:  # a leaving run keeps its homes until it is gone (unless a
            if not unplaced:  # run that did not fit takes an extra one of them now)
                assert self.placement.homes(name) == before.homes(name)

    @rule(name=st.sampled_from(NAMES), staleness=st.integers(0, 3))
    def add_run(self, name: str, staleness: int) -> None:
        if name in {r.name for r in self.table.runs} or name in self.leaving:
            new = RunTable([*self.table.runs, run(name, 9, staleness)], ())
            if name in self.leaving:
                assert plan(self.table, new, self.leaving).refused is not None
            return
        before = self.placement
        room = any(before.free(r) >= staleness + 2 for r in self.members)
        self.reload(RunTable([*self.table.runs, run(name, 0, staleness)]))
        assert name in self.placement or name in self.failed
        if room and not self.failed:  # a joining run with room takes no one's home
            assert before.pairs() - {p for p in before.pairs() if p[1] not in self.members} <= (
                self.placement.pairs()
            )
        self.gone.discard(name)

    @precondition(lambda self: self.table.runs)
    @rule(data=st.data())
    def remove_run(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([r.name for r in self.table.runs]))
        self.reload(RunTable([r for r in self.table.runs if r.name != name]))
        assert self.table.identify(b"Bearer k-" + name.encode() + b"-0") is None

    @precondition(lambda self: self.leaving)
    @rule(data=st.data())
    def leaving_run_is_gone(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.leaving)))
        before, unplaced = self.placement, self.failed
        del self.leaving[name]
        self.gone.add(name)
        self.placement, self.failed = replace(before, self.slots(), self.members, self.budget)
        if not unplaced:  # a run leaving takes no one's home (but one that did not fit
            for other in before.runs - {name}:  # may be placed now, on another's extra)
                assert before.homes(other) <= self.placement.homes(other)

    @precondition(lambda self: self.table.runs)
    @rule(data=st.data(), cap=st.none() | st.integers(1, 64))
    def rotate_key_and_cap(self, data: st.DataObject, cap: int | None) -> None:
        old = data.draw(st.sampled_from(self.table.runs))
        new_run = Run(old.name, old.key + b"x", old.max_staleness, old.roots, cap)
        new = RunTable([new_run if r.name == old.name else r for r in self.table.runs],
                       [(old.name, old.key)])  # fmt: skip
        p = plan(self.table, new, self.leaving)
        assert p.rotated == (old.name,) and not p.added and not p.removed
        assert p.limited == ((old.name,) if cap != old.max_in_flight else ())
        self.reload(new)
        for key in (old.key, new_run.key):  # both work during the overlap
            assert self.table.identify(b"Bearer " + key) is new_run
        self.table = RunTable(self.table.runs)  # the overlap ends
        assert self.table.identify(b"Bearer " + old.key) is None

    @precondition(lambda self: self.table.runs)
    @rule(data=st.data(), staleness=st.integers(0, 3))
    def change_staleness(self, data: st.DataObject, staleness: int) -> None:
        old = data.draw(st.sampled_from(self.table.runs))
        new_run = Run(old.name, old.key, staleness, old.roots, old.max_in_flight)
        new = RunTable([new_run if r.name == old.name else r for r in self.table.runs])
        p = plan(self.table, new, self.leaving)
        assert p.refused is None
        assert p.windowed == ((old.name,) if staleness != old.max_staleness else ())
        slots = {**self.slots(), old.name: new_run.slots}
        trial, failed = replace(self.placement, slots, self.members, self.budget)
        before = self.placement
        if any(before.homes(n) and not trial.homes(n) for n in failed):
            return  # a placed run would lose every home: the shell refuses the set
        self.reload(new)
        for name in before.runs:  # nobody placed is dropped by a changed window
            assert not before.homes(name) or self.placement.homes(name), name

    @rule()
    def replica_joins(self) -> None:
        before = self.placement
        self.members.add(self.next_replica)
        self.next_replica += 1
        self.placement, self.failed = replace(before, self.slots(), self.members, self.budget)
        assert before.pairs() <= self.placement.pairs()

    @precondition(lambda self: len(self.members) > 1)
    @rule(data=st.data())
    def replica_leaves(self, data: st.DataObject) -> None:
        self.members.discard(data.draw(st.sampled_from(sorted(self.members))))
        self.placement, self.failed = replace(
            self.placement, self.slots(), self.members, self.budget
        )

    @invariant()
    def homes_are_members_within_budget(self) -> None:
        if not hasattr(self, "placement"):
            return
        for name in self.placement.runs:
            assert self.placement.homes(name) <= self.members
        for r in self.members:
            assert self.placement.load(r) <= self.budget

    @invariant()
    def every_run_is_placed_or_says_why(self) -> None:
        if not hasattr(self, "placement"):
            return
        for name in self.slots():
            assert (name in self.placement) != (name in self.failed)
            if name in self.failed:
                assert (
                    f"budget is {self.budget}" in self.failed[name]
                    or "more than" in (self.failed[name])
                )

    @invariant()
    def gone_runs_hold_nothing(self) -> None:
        if not hasattr(self, "placement"):
            return
        for name in self.gone:
            assert not self.placement.homes(name)


ReloadMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestReloadMachine = ReloadMachine.TestCase


def test_a_plan_names_each_kind_of_change() -> None:
    old = RunTable([run("a"), run("b"), run("c", cap=4)])
    new = RunTable([run("a", key=1), run("c", cap=8), run("d")])
    p = plan(old, new)
    assert (p.added, p.removed, p.rotated, p.limited) == (("d",), ("b",), ("a",), ("c",))
    assert p.summary()["added"] == ["d"] and p and not plan(old, old)
    heavier = RunTable([Run("a", b"k-a-0", 1, (Path("/r/a"),), weight=3.0)])
    assert plan(RunTable([Run("a", b"k-a-0", 1, (Path("/r/a"),))]), heavier).limited == ("a",)


def test_adapter_root_and_a_leaving_name_are_refused() -> None:
    old = RunTable([run("a")])
    moved = RunTable([Run("a", b"k-a-0", 1, (Path("/elsewhere"),))])
    assert "adapter_root" in (plan(old, moved).refused or "")
    assert "still leaving" in (plan(RunTable([]), old, leaving=["a"]).refused or "")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_gone_runs_final_counts_are_kept_for_the_stated_time() -> None:
    """Scraped every 15-60 s, a run's last counts must outlive its removal: kept
    ``DEPARTED_KEEP_S`` (300 s), dropped after; a run added back starts again."""
    clock = Clock()
    departed = Departed(clock=clock)
    usage = RunUsage(prompt_tokens=70, completion_tokens=20)
    departed.left("run-a", 9, usage, 1)
    clock.now += 60.0
    departed.left("run-b", 1, RunUsage(), 0)
    clock.now += DEPARTED_KEEP_S - 60.0 - 0.001  # four scrapes at 60 s, and then some
    finals = departed.finals()
    assert [(f.name, f.requests, f.usage.prompt_tokens, f.fair_overflows) for f in finals] == [
        ("run-a", 9, 70, 1), ("run-b", 1, 0, 0),
    ]  # fmt: skip
    clock.now += 0.001
    assert [f.name for f in departed.finals()] == ["run-b"]
    departed.back("run-b")  # added back under its name: its old counts go
    assert departed.finals() == []
    assert DEPARTED_KEEP_S >= 4 * 60  # covers any sane scrape interval, a failed one or two
