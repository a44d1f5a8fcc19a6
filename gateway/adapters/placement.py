"""Adapter slot placement: each run's *home replicas* on a shared fleet (sans-I/O).

Several TRL runs share one fleet. A vLLM replica holds ``--max-loras`` adapters (its
*budget*); a run needs ``slots = max_staleness + 2`` (live versions, plus one to sync) on
each replica that serves it, so when the fleet is short each run gets a subset, its homes.

Rules (as ``state.py``): pure, synchronous, deterministic; no clock, no I/O; ties go by a
seeded xxh3 rendezvous hash, never dict order, so two gateways agree. Values are immutable
snapshots the shell swaps. Replica ids are pool indices (as in ``routing/``); a DOWN replica
(``down``: ejected, unhealthy) keeps its homes (it is reconciled on return), except those
of a *stranded* run, every one of whose homes is down: such a run could serve nowhere, so
it is re-placed on replicas that are up, or left homeless (unplaced) if none has room.
Only leaving the pool removes the other homes. A DOWN replica takes no new home.

Algorithm (:func:`place`; :func:`admit` and :func:`release` are its one-run cases):

1. Keep every previous home whose replica is still present, but none of a stranded run's.
2. Repair: a replica over budget (its budget shrank, a run's slots grew) drops homes,
   extra homes of the most-homed runs first, until it fits.
3. Admit each homeless run (new, stranded, or all its homes left), largest first, on an up
   replica where it needs the fewest evictions, then has most room, then by hash. Only
   *extra* homes are evicted (never a run's last, nor its last up one, so no run is
   relocated or stranded), most-homed runs' first, none needlessly.
4. Spread (water-filling): the run with the fewest homes gains one, on the up replica with the
   most room (then rendezvous hash), until no run can gain. So free capacity is always
   used, and with ample budget every run is homed on every replica: single-run behaviour.
   Nothing is moved only to even out home counts: runs that joined an empty fleet keep
   more homes until joins take their extras (richest first) or leaves feed the poorest.

A run *fits* iff some replica has ``budget - pinned >= slots`` (pinned: slots of runs homed
only there, or whose last kept previous home it is: evicting that would relocate the run);
else it gets a :class:`PlacementError` naming the budget, and no homes at all.

Minimal movement, precisely (each is a test in ``tests/adapters/test_placement.py``):

* run leaves: no other run loses a home (some may gain homes in the freed room);
* replica joins: no run loses a home;
* replica leaves: if no run lost its last home, only the departed pairs go (runs homed there
  may gain homes); else other pairs go only to re-home those runs: extra homes, on the
  replicas where they were re-homed;
* run joins (:func:`admit`): if some replica has room, no run loses a home; otherwise
  only extra homes on one replica, the new run's first home, are evicted;
* replicas go down (``down``): only stranded runs lose homes (those on the down replicas),
  each re-placed on up replicas (evicting only extra homes, never another run's last up
  home) or left homeless; a stranded run does not move back when its old home returns
  (it may gain it as an extra home by spreading, like any run);
* always, with budgets and slots unchanged: a removed pair is irredundant (putting it back
  would exceed that replica's budget), and a run with a surviving home keeps one of its
  old homes (it stays routable while reconciling, below).

Reconciling (:func:`diff`, losses first): the shell keeps "a run's live versions are on all
its *routable* homes" and "never over budget" at every instant by this order:

1. LOSE (run, r): make the pair unroutable (swap the snapshot), then drain and unload the
   run's versions on r. Safe: by the last rule above the run keeps a routable home.
2. GAIN (run, r): once every LOSE on r is unloaded (so r's budget holds), load all the
   run's live versions on r (and any published meanwhile); then make the pair routable.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import TypeVar

from xxhash import xxh3_64_intdigest

__all__ = [
    "Change",
    "Move",
    "Placement",
    "PlacementError",
    "admit",
    "churn",
    "diff",
    "place",
    "release",
    "run_slots",
    "stranded",
]

_K = TypeVar("_K", int, str)

_SEED = 0x5EED_1A7E  # fixed: every gateway computing a placement must agree on it


def run_slots(max_staleness: int) -> int:
    """Slots a run needs on each home: ``max_staleness + 1`` live versions, one to sync."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return max_staleness + 2


def _score(run: str, replica: int) -> int:
    """Rendezvous (HRW) weight of a (run, replica) pair: the deterministic tie-break."""
    return xxh3_64_intdigest(f"{run}\x00{replica}".encode(), _SEED)


class Placement:
    """An immutable, valid assignment of runs to home replicas.

    Valid by construction (``ValueError`` otherwise): every run has at least one home, homes
    are present replicas, and no replica holds more slots than its budget. What the router
    reads per request (``homes``, ``ordered_homes``) is one precomputed dict lookup.
    """

    __slots__ = ("_budgets", "_homes", "_loads", "_ordered", "_slots")

    def __init__(
        self,
        budgets: Mapping[int, int],
        slots: Mapping[str, int],
        homes: Mapping[str, Iterable[int]],
    ) -> None:
        self._budgets = _checked(budgets, "budget", 0)
        self._slots = _checked(slots, "slots", 1)
        if set(homes) - set(self._slots):
            raise ValueError(f"homes given for runs without slots: {sorted(homes)}")
        self._homes = {r: frozenset(homes.get(r, ())) for r in self._slots}
        self._ordered = {r: tuple(sorted(h)) for r, h in self._homes.items()}
        loads = dict.fromkeys(self._budgets, 0)
        for run, hs in self._homes.items():
            if not hs:
                raise ValueError(f"run {run!r} has no home replica")
            for r in hs:
                if r not in loads:
                    raise ValueError(f"run {run!r} is homed on unknown replica {r}")
                loads[r] += self._slots[run]
        for r, used in loads.items():
            if used > self._budgets[r]:
                raise ValueError(f"replica {r} over budget: {used} > {self._budgets[r]}")
        self._loads = loads

    @classmethod
    def empty(cls, budgets: Mapping[int, int]) -> Placement:
        """No runs yet: the ``previous`` for a fleet's first :func:`place`."""
        return cls(budgets, {}, {})

    @property
    def budgets(self) -> Mapping[int, int]:
        return MappingProxyType(self._budgets)

    @property
    def slots(self) -> Mapping[str, int]:
        return MappingProxyType(self._slots)

    @property
    def replicas(self) -> frozenset[int]:
        return frozenset(self._budgets)

    @property
    def runs(self) -> frozenset[str]:
        return frozenset(self._slots)

    def __contains__(self, run: object) -> bool:
        return run in self._slots

    def homes(self, run: str) -> frozenset[int]:
        """The run's home replicas; empty if it is not placed."""
        return self._homes.get(run, frozenset())

    def ordered_homes(self, run: str) -> tuple[int, ...]:
        """The homes in ascending id order (precomputed; e.g. for ``candidates[i]``)."""
        return self._ordered.get(run, ())

    def load(self, replica: int) -> int:
        """Slots used on ``replica`` (0 for a replica not in the fleet)."""
        return self._loads.get(replica, 0)

    def free(self, replica: int) -> int:
        return self._budgets.get(replica, 0) - self.load(replica)

    def pinned(self, replica: int) -> int:
        """Slots on ``replica`` held by runs with no other home: what admission cannot free."""
        return sum(self._slots[r] for r, h in self._homes.items() if h == {replica})

    def headroom(self) -> int:
        """The most slots a new run can get on one replica: it fits iff ``slots <= this``."""
        return max((b - self.pinned(r) for r, b in self._budgets.items()), default=0)

    def max_loras(self, run: str) -> int:
        """What ``/server_info`` reports as ``max_loras`` to ``run``: the slots it holds on
        each home if placed, else the most it could be admitted with now. TRL's own check
        ``max_loras >= max_staleness + 2`` then fails exactly when admission would."""
        return self._slots[run] if run in self._slots else self.headroom()

    def pairs(self) -> frozenset[tuple[str, int]]:
        """Every (run, home replica) pair."""
        return frozenset((run, r) for run, hs in self._homes.items() for r in hs)

    def _key(self) -> tuple[object, ...]:
        return (tuple(self._budgets.items()), tuple(self._slots.items()), self.pairs())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        homes = ", ".join(f"{r!r}: {list(h)}" for r, h in self._ordered.items())
        return f"Placement(budgets={self._budgets}, slots={self._slots}, homes={{{homes}}})"


def _checked(values: Mapping[_K, int], what: str, least: int) -> dict[_K, int]:
    """A sorted copy (so nothing depends on the caller's insertion order), validated."""
    for key, value in values.items():
        if value < least:
            raise ValueError(f"{what} of {key!r} must be >= {least}, got {value}")
    return dict(sorted(values.items()))


class PlacementError(Exception):
    """Runs that cannot be placed without relocating another run's last home.

    Returned, not raised (results out); the shell raises or maps it on the run's first load.
    ``best_effort`` places all other runs, so no run is ever half-placed.
    """

    def __init__(self, needs: Mapping[str, int], best_effort: Placement) -> None:
        self.needs = dict(sorted(needs.items()))  # run -> slots it needs per home
        self.best_effort = best_effort
        super().__init__(_explain(self.needs, best_effort))


def _explain(needs: Mapping[str, int], p: Placement) -> str:
    runs = " and ".join(f"run {r!r} needs {n}" for r, n in needs.items())
    head = f"{runs} adapter slots on a replica (max_staleness + 2)"
    if not p.budgets:
        return f"{head}, but the fleet has no replicas"
    values = sorted(set(p.budgets.values()))
    each = ", ".join(f"{r}: {b}" for r, b in p.budgets.items())
    budget = f"every replica's budget is {values[0]}" if len(values) == 1 else f"budgets {each}"
    budget += " adapter slots (vLLM --max-loras)"
    if min(needs.values()) > values[-1]:
        return f"{head}, more than any replica holds: {budget}"
    only = [(r, sorted(run for run in p.runs if p.homes(run) == {r})) for r in p.budgets]
    held = ", ".join(f"replica {r}: {p.pinned(r)} {runs}" for r, runs in only[:8] if runs)
    more = ", ..." if len(only) > 8 else ""
    return (
        f"{head}, but at most {p.headroom()} can be freed on any replica without moving "
        f"another run's only home: {budget}; held by runs homed only there: {held}{more}"
    )


# ------------------------------------------------------------------ the algorithm


class _Work:
    """Mutable scratch state of one :func:`place` call (never escapes it)."""

    def __init__(
        self, budgets: Mapping[int, int], slots: Mapping[str, int], down: Collection[int] = ()
    ) -> None:
        self.budgets = _checked(budgets, "budget", 0)
        self.slots = _checked(slots, "slots", 1)
        self.down = frozenset(down) & self.budgets.keys()
        """Replicas that keep their homes but take no new one (ejected, unhealthy)."""
        self.homes: dict[str, set[int]] = {run: set() for run in self.slots}
        self.loads = dict.fromkeys(self.budgets, 0)
        self.kept: dict[str, set[int]] = {run: set() for run in self.slots}
        """Each run's homes from the previous placement: its last one is never evicted
        for another run, even once spreading gave it a new one (that would relocate it)."""

    def free(self, r: int) -> int:
        return self.budgets[r] - self.loads[r]

    def add(self, run: str, r: int) -> None:
        self.homes[run].add(r)
        self.loads[r] += self.slots[run]

    def drop(self, run: str, r: int) -> None:
        self.homes[run].discard(r)
        self.loads[r] -= self.slots[run]

    def evictions(self, r: int, deficit: int, *, last_homes: bool) -> list[str] | None:
        """Runs to take off ``r`` to free ``deficit`` slots; None if impossible. Extra homes
        of the most-homed runs first (joins take from the rich), then, if ``last_homes``,
        runs homed only on ``r``; pruned smallest first so that no chosen run could stay."""
        here = [run for run, hs in self.homes.items()
                if r in hs and (last_homes or (self._up_elsewhere(run, r)
                                               and self._movable(run, r)))]  # fmt: skip
        here.sort(key=lambda run: (-len(self.homes[run]), -self.slots[run], _score(run, r)))
        chosen: list[str] = []
        freed = 0
        for run in here:
            if freed < deficit:
                chosen.append(run)
                freed += self.slots[run]
        if freed < deficit:
            return None
        for run in sorted(chosen, key=lambda run: (self.slots[run], _score(run, r))):
            if freed - self.slots[run] >= deficit:
                chosen.remove(run)
                freed -= self.slots[run]
        return chosen

    def _up_elsewhere(self, run: str, r: int) -> bool:
        """Whether ``run`` keeps a home that is up without ``r`` (with nothing down: whether
        ``r`` is an extra home): taking ``r`` must not strand it."""
        return any(h != r and h not in self.down for h in self.homes[run])

    def _movable(self, run: str, r: int) -> bool:
        """Whether ``run``'s home ``r`` may go without taking its last previous home."""
        kept = self.kept[run]
        return r not in kept or len(kept & self.homes[run]) > 1

    def repair(self) -> None:
        """Bring every replica within its budget (only needed when budgets or slots change)."""
        for r in self.budgets:
            deficit = self.loads[r] - self.budgets[r]
            if deficit > 0:
                for run in self.evictions(r, deficit, last_homes=True) or ():
                    self.drop(run, r)

    def admit(self, run: str) -> bool:
        """Give a homeless ``run`` its first home, evicting extra homes if needed."""
        need = self.slots[run]
        best: tuple[tuple[int, int, int, int], int, list[str]] | None = None
        for r in self.budgets:
            if r in self.down:
                continue
            deficit = need - self.free(r)
            victims = [] if deficit <= 0 else self.evictions(r, deficit, last_homes=False)
            if victims is None:
                continue
            room = self.free(r) + sum(self.slots[v] for v in victims) - need
            poorest = min((len(self.homes[v]) for v in victims), default=0)
            key = (len(victims), -poorest, -room, -_score(run, r))
            if best is None or key < best[0]:
                best = (key, r, victims)
        if best is None:
            return False
        _, r, victims = best
        for victim in victims:
            self.drop(victim, r)
        self.add(run, r)
        return True

    def spread(self) -> int:
        """Water-fill extra homes, fewest-homed run first; returns the pairs added.

        Room only shrinks while spreading, so a run that cannot gain now never can: each run
        leaves the heap once, and the cost is O((pairs added + runs) * replicas).
        """
        # among equals, a hashed order: no name (``run-01``) is always served first
        heap = [(len(hs), _score(run, -1), run) for run, hs in self.homes.items() if hs]
        heapq.heapify(heap)
        added = 0
        while heap:
            count, order, run = heapq.heappop(heap)
            need, hs = self.slots[run], self.homes[run]
            options = [r for r in self.budgets
                       if r not in hs and r not in self.down and self.free(r) >= need]  # fmt: skip
            if not options:
                continue
            self.add(run, max(options, key=lambda r: (self.free(r), _score(run, r))))
            added += 1
            heapq.heappush(heap, (count + 1, order, run))
        return added

    def freeze(self) -> Placement:
        homes = {run: hs for run, hs in self.homes.items() if hs}
        return Placement(self.budgets, {run: self.slots[run] for run in homes}, homes)


def stranded(placement: Placement, down: Collection[int]) -> frozenset[str]:
    """The runs every one of whose homes is in ``down``: they can serve nowhere until
    :func:`place` (given the same ``down``) re-places them."""
    gone = frozenset(down)
    return frozenset(run for run in placement.runs if placement.homes(run) <= gone)


def place(
    previous: Placement,
    runs: Mapping[str, int],
    replicas: Mapping[int, int],
    down: Collection[int] = (),
) -> Placement | PlacementError:
    """Place ``runs`` (name -> slots) on ``replicas`` (id -> budget), moving little; or a
    :class:`PlacementError` whose ``best_effort`` places every run that fits. ``down``:
    replicas present but out of rotation; they take no new home, and a run homed only on
    them is re-placed (the module's rules)."""
    work = _Work(replicas, runs, down)
    for run in work.slots:
        kept = previous.homes(run) & work.budgets.keys()
        if kept and kept <= work.down:  # stranded: re-placed on up replicas, or homeless
            continue
        for r in sorted(kept):
            work.add(run, r)
            work.kept[run].add(r)
    work.repair()
    pending = sorted(
        (run for run, hs in work.homes.items() if not hs),
        key=lambda run: (-work.slots[run], _score(run, -1), run),
    )
    while True:
        failed = [run for run in pending if not work.admit(run)]
        added = work.spread()
        # spreading can unpin a replica: retry until no run is placed and no home added
        if not failed or (len(failed) == len(pending) and not added):
            break
        pending = failed
    result = work.freeze()
    if failed:
        return PlacementError({run: work.slots[run] for run in failed}, result)
    return result


def admit(placement: Placement, run: str, slots: int) -> Placement | PlacementError:
    """Place one new run without relocating any other; all or nothing (on failure the
    error's ``best_effort`` is ``placement`` itself). Idempotent for a placed run."""
    if placement.slots.get(run) == slots:
        return placement
    result = place(placement, {**placement.slots, run: slots}, placement.budgets)
    if isinstance(result, PlacementError):
        return PlacementError({run: slots}, placement)
    return result


def release(placement: Placement, run: str) -> Placement:
    """The run left: its homes are freed and the fewest-homed runs may spread into them."""
    runs = {name: n for name, n in placement.slots.items() if name != run}
    result = place(placement, runs, placement.budgets)
    assert isinstance(result, Placement), "removing a run cannot make another one unfit"
    return result


# ------------------------------------------------------------------ reconciling


class Change(StrEnum):
    LOSE = "lose"
    GAIN = "gain"


@dataclass(frozen=True, slots=True)
class Move:
    """One (run, replica) pair to unload (``LOSE``) or load (``GAIN``)."""

    change: Change
    run: str
    replica: int


def diff(old: Placement, new: Placement) -> tuple[Move, ...]:
    """The moves from ``old`` to ``new``: every LOSE first, then every GAIN, each sorted
    by (replica, run). A LOSE on a replica that left the fleet is bookkeeping only."""
    before, after = old.pairs(), new.pairs()
    lost = [Move(Change.LOSE, run, r) for r, run in sorted((r, x) for x, r in before - after)]
    gained = [Move(Change.GAIN, run, r) for r, run in sorted((r, x) for x, r in after - before)]
    return (*lost, *gained)


def churn(old: Placement, new: Placement) -> int:
    """Pairs the shell must load or unload to go from ``old`` to ``new`` (each pair moves
    ``slots`` adapters). Losses on replicas that left are not counted: nothing to do."""
    return sum(1 for m in diff(old, new) if m.change is Change.GAIN or m.replica in new.replicas)
