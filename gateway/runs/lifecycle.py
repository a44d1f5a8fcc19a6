"""Runs joining and leaving a live gateway (sans-I/O): what a reload of the run set
changes, and where every run lives afterwards.

Pure, like ``adapters/placement.py`` whose minimal-movement rule it keeps: given the
run table in force and the one a reload brings, :func:`plan` names the runs added,
removed and changed (key rotated, ``max_in_flight`` or weight changed, ``max_staleness``
changed: a window, and the slots on each home, ``max_staleness + 2``), and refuses what
cannot change under a live run (``adapter_root``: its adapter manager checks paths under
it; remove the run and add it back). :func:`replace` is the placement after
it: every kept home stays unless a budget forces it off, a run that leaves keeps its slots
until it is told gone (``leaving``: its adapters are still on its homes until they are
unloaded), and runs that did not fit are placed once they do.

The shell (``gateway.runs.reload``) applies a plan in this order: added runs are built
and placed; changed runs take their new limits (a rotated key keeps working for
``key_overlap_s``); removed runs stop being identified at once, drain (or are aborted
after ``run_remove_grace_s``), have their adapters unloaded, and only then give their
slots back (:func:`replace` without them).

A run that is gone leaves its final counts behind (:class:`Departed`): its
``gateway_run_*_total`` series stay on ``/metrics`` for ``DEPARTED_KEEP_S`` more, so
that the scrape after its removal still reads what it used last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from gateway.adapters.placement import Placement, PlacementError, place
from gateway.config import RunSpec
from gateway.runs.table import Run, RunTable
from gateway.runs.usage import RunUsage

__all__ = ["DEPARTED_KEEP_S", "Departed", "Final", "RunPlan", "plan", "replace", "run_table_of"]

DEPARTED_KEEP_S = 300.0
"""How long a gone run's final counts stay scrapeable. Scrape intervals are 15-60 s
(Prometheus' default is 60 s), so 300 s is five scrapes at the default: the last counts
survive a scrape or two that fail, and a pair of HA Prometheus servers each see them.
It is also Prometheus' own lookback window (``--query.lookback-delta``, 5 min), the time
a series that stopped is still read as present. Counting scrapes instead would let one
server's scrapes use up another's; and the memory held is a few numbers per removal."""


def run_table_of(specs: Iterable[RunSpec]) -> RunTable:
    """The configured runs (``runs:``) as the gateway knows them."""
    return RunTable(
        Run(
            s.name,
            s.key.get_secret_value().encode(),
            s.max_staleness,
            (s.adapter_root,),
            s.max_in_flight,
            s.remove_grace_s,
            s.key_overlap_s,
            s.weight,
        )
        for s in specs
    )


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What a reload changes, by run name (each tuple sorted)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    rotated: tuple[str, ...] = ()
    """Runs whose key changed: the old key works for ``key_overlap_s`` more."""
    limited: tuple[str, ...] = ()
    """Runs whose ``max_in_flight`` or ``weight`` changed: it applies to their next rollout."""
    windowed: tuple[str, ...] = ()
    """Runs whose ``max_staleness`` changed: their window (a narrower one evicts at once)
    and their slots on each home (re-placed: a run that no longer fits refuses the set)."""
    refused: str | None = None
    """Why the new set cannot be applied to the live one (None: it can)."""

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.rotated or self.limited or self.windowed)

    def summary(self) -> dict[str, list[str]]:
        return {"added": list(self.added), "removed": list(self.removed),
                "rotated": list(self.rotated), "limited": list(self.limited),
                "max_staleness": list(self.windowed)}  # fmt: skip


def plan(old: RunTable, new: RunTable, leaving: Iterable[str] = ()) -> RunPlan:
    """The changes from ``old`` to ``new``; ``leaving``: runs removed earlier that still
    drain (their names cannot come back until they are gone)."""
    before = {r.name: r for r in old.runs}
    after = {r.name: r for r in new.runs}
    still = sorted(set(leaving) & after.keys() - before.keys())
    if still:
        wait = "is still leaving (draining, unloading its adapters); reload once it is gone"
        return RunPlan(refused=f"run {still[0]!r} {wait}")
    kept = sorted(before.keys() & after.keys())
    for name in kept:
        if (why := _fixed(before[name], after[name])) is not None:
            return RunPlan(refused=f"run {name!r}: {why}")
    return RunPlan(
        added=tuple(sorted(after.keys() - before.keys())),
        removed=tuple(sorted(before.keys() - after.keys())),
        rotated=tuple(n for n in kept if before[n].key != after[n].key),
        limited=tuple(n for n in kept if _limits(before[n]) != _limits(after[n])),
        windowed=tuple(n for n in kept if before[n].max_staleness != after[n].max_staleness),
    )


def _limits(run: Run) -> tuple[int | None, float]:
    return run.max_in_flight, run.weight


def _fixed(old: Run, new: Run) -> str | None:
    if old.roots != new.roots:
        return ("adapter_root cannot change while the run is live; remove the run, reload, "
                "then add it back")  # fmt: skip
    return None


def replace(
    previous: Placement,
    runs: Mapping[str, int],
    replicas: Iterable[int],
    budget: int,
    down: Collection[int] = (),
) -> tuple[Placement, dict[str, str]]:
    """Every run of ``runs`` (name -> slots, leaving runs included) placed on ``replicas``
    of ``budget`` slots, moving as little as possible (``down``: those out of rotation,
    which take no new home; a run homed only on them is re-placed); and why each run that
    does not fit has no homes (the placement's error, naming the budget, and the homes it
    lost if they are down)."""
    result = place(previous, runs, dict.fromkeys(replicas, budget), down)
    if isinstance(result, PlacementError):
        failed = {name: _unfit(name, previous, down, str(result)) for name in result.needs}
        return result.best_effort, failed
    return result, {}


def _unfit(run: str, previous: Placement, down: Collection[int], why: str) -> str:
    homes = sorted(previous.homes(run))
    if homes and set(homes) <= set(down):
        return (f"LoRA adapter slots exhausted: run {run!r} lost its home replicas {homes} "
                f"(down) and no healthy replica has room for it: {why}")  # fmt: skip
    return f"LoRA adapter slots exhausted: {why}"


@dataclass(frozen=True, slots=True)
class Final:
    """A run's counters, as ``/metrics`` exports them (a live run's now, a gone run's last)."""

    name: str
    requests: int
    usage: RunUsage
    fair_overflows: int
    left_at: float = 0.0


class Departed:
    """Final counts of the runs that are gone, kept ``keep_s`` (``DEPARTED_KEEP_S``) after
    they left; a run added back under the same name drops its old ones (its counters
    start again at 0, as a new run's do). ``clock``: monotonic seconds (a test's own)."""

    __slots__ = ("_clock", "_finals", "keep_s")

    def __init__(
        self, keep_s: float = DEPARTED_KEEP_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._finals: dict[str, Final] = {}

    def left(self, name: str, requests: int, usage: RunUsage, fair_overflows: int) -> None:
        self._finals[name] = Final(name, requests, usage, fair_overflows, self._clock())

    def back(self, name: str) -> None:
        self._finals.pop(name, None)

    def finals(self) -> list[Final]:
        """The ones still kept, by name (older ones are dropped now)."""
        now = self._clock()
        for name in [n for n, f in self._finals.items() if now - f.left_at >= self.keep_s]:
            del self._finals[name]
        return sorted(self._finals.values(), key=lambda f: f.name)
