"""Adapter registry and lifecycle state machine (sans-I/O).

Rules of this file (h11 ``_state.py`` style):

* No asyncio, no httpx, no clock. Every event takes ``now`` (seconds, monotonic).
* Events in, actions out. Public methods return ``list[Action]``; the shell
  (``fanout.py``) performs each action once ``now >= action.not_before`` *and*
  ``is_current(action)`` still holds, then feeds the outcome back with ``on_result``.
  At most one action per (adapter, replica) is outstanding at any time.
* Every state change goes through ``_advance`` and one of the three tables below.
  An event a table does not allow raises ``IllegalTransition``; public methods check
  legality before mutating anything, so an illegal event changes nothing.
* Three machines:
    - the adapter (``ADAPTER_TRANSITIONS``): a load is a transaction -- LOADING becomes
      LIVE only when every *admitted* replica holds the adapter; a real failure rolls
      back the replicas that accepted; REPLACING/REVERTING are the same for a name that
      is already live (in-place reload, old weights keep serving, no 404 gap);
    - one copy per (adapter, replica) (``COPY_TRANSITIONS``): what that replica holds;
    - the replica (``REPLICA_TRANSITIONS``): DOWN -> SYNCING (its ``/v1/models`` was
      read, replay/cleanup running) -> UP (admitted: holds every live adapter).
* Invariants kept (and checked by ``tests/adapters/test_state_machine.py``):
    - a routable adapter is registered on every UP replica;
    - ``candidates`` only returns UP replicas whose copy is registered;
    - an unload is emitted for a copy only when nothing is in flight on it there, or
      ``unload_grace_s`` after it stopped being routable;
    - per family, once a version goes live, only versions within
      ``[v - max_staleness, v]`` stay desired (older *and* newer: a lower version being
      published means a new run, whose leftovers must not outlive it).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

from gateway.adapters.naming import AdapterName, NamePattern

__all__ = [
    "ADAPTER_TRANSITIONS",
    "COPY_TRANSITIONS",
    "LOST",
    "REPLICA_TRANSITIONS",
    "Action",
    "AdapterPolicy",
    "AdapterRegistry",
    "AdapterState",
    "AdapterView",
    "CopyState",
    "Failure",
    "IllegalTransition",
    "ListedAdapter",
    "LoadOnReplica",
    "Outcome",
    "ReplicaState",
    "ReplicaView",
    "Result",
    "Settlement",
    "Snapshot",
    "UnloadOnReplica",
    "audit_drift",
]


class IllegalTransition(RuntimeError):
    """An event that the current state does not allow; nothing was changed."""


# --------------------------------------------------------------------------- states


class AdapterState(StrEnum):
    GONE = "gone"  # no record (also: terminal state of a record)
    LOADING = "loading"  # first load fanning out; not routable
    LIVE = "live"  # on every admitted replica; routable and listed
    REPLACING = "replacing"  # live; in-place reload to a new path fanning out
    ROLLING_BACK = "rolling_back"  # first load failed; unloading where it landed
    REVERTING = "reverting"  # replacement failed; reloading the old path in place
    RETIRING = "retiring"  # unload acknowledged / evicted / stray; draining copies


class AdapterEvent(StrEnum):
    LOAD = "load"
    ADOPT = "adopt"  # rebuild: found on replicas, taken as live
    DISCOVER = "discover"  # found on a replica but not desired: a stray to unload
    ALL_LOADED = "all_loaded"
    LOAD_FAILED = "load_failed"
    ROLLED_BACK = "rolled_back"
    UNLOAD = "unload"
    ALL_UNLOADED = "all_unloaded"


_A, _AE = AdapterState, AdapterEvent
ADAPTER_TRANSITIONS: dict[tuple[AdapterState, AdapterEvent], AdapterState] = {
    (_A.GONE, _AE.LOAD): _A.LOADING,
    (_A.GONE, _AE.ADOPT): _A.LIVE,
    (_A.GONE, _AE.DISCOVER): _A.RETIRING,
    (_A.LOADING, _AE.ALL_LOADED): _A.LIVE,
    (_A.LOADING, _AE.LOAD_FAILED): _A.ROLLING_BACK,
    (_A.ROLLING_BACK, _AE.ROLLED_BACK): _A.GONE,
    (_A.LIVE, _AE.LOAD): _A.REPLACING,
    (_A.REPLACING, _AE.ALL_LOADED): _A.LIVE,
    (_A.REPLACING, _AE.LOAD_FAILED): _A.REVERTING,
    (_A.REVERTING, _AE.ROLLED_BACK): _A.LIVE,
    (_A.LIVE, _AE.UNLOAD): _A.RETIRING,
    (_A.RETIRING, _AE.UNLOAD): _A.RETIRING,
    (_A.RETIRING, _AE.DISCOVER): _A.RETIRING,
    (_A.RETIRING, _AE.ALL_UNLOADED): _A.GONE,
}

# Routable: requests may be sent; listed in /v1/models; desired on every replica.
ROUTABLE = frozenset({_A.LIVE, _A.REPLACING, _A.REVERTING})
IN_TRANSACTION = frozenset({_A.LOADING, _A.REPLACING, _A.ROLLING_BACK, _A.REVERTING})


class CopyState(StrEnum):
    ABSENT = "absent"
    LOADING = "loading"  # load outstanding (or a mount-lag retry scheduled)
    LOADED = "loaded"
    RELOADING = "reloading"  # in-place load outstanding; the name stays registered
    DRAINING = "draining"  # not desired; waiting for in-flight == 0 or the grace timeout
    UNLOADING = "unloading"  # unload outstanding


class CopyEvent(StrEnum):
    SEND_LOAD = "send_load"
    SEND_RELOAD = "send_reload"
    RETRY = "retry"
    LOAD_OK = "load_ok"
    LOAD_FAILED = "load_failed"
    OBSERVED = "observed"  # seen in the replica's /v1/models
    RETIRE = "retire"
    SEND_UNLOAD = "send_unload"
    UNLOADED = "unloaded"
    UNLOAD_FAILED = "unload_failed"


_C, _CE = CopyState, CopyEvent
COPY_TRANSITIONS: dict[tuple[CopyState, CopyEvent], CopyState] = {
    (_C.ABSENT, _CE.SEND_LOAD): _C.LOADING,
    (_C.ABSENT, _CE.OBSERVED): _C.LOADED,
    (_C.LOADING, _CE.RETRY): _C.LOADING,
    (_C.LOADING, _CE.LOAD_OK): _C.LOADED,
    (_C.LOADING, _CE.LOAD_FAILED): _C.ABSENT,
    (_C.LOADED, _CE.SEND_RELOAD): _C.RELOADING,
    (_C.RELOADING, _CE.RETRY): _C.RELOADING,
    (_C.RELOADING, _CE.LOAD_OK): _C.LOADED,
    # A failed in-place load leaves the name registered (old or new weights: unknown;
    # the path is then recorded as unknown and a revert reloads the old one).
    (_C.RELOADING, _CE.LOAD_FAILED): _C.LOADED,
    (_C.LOADED, _CE.RETIRE): _C.DRAINING,
    (_C.DRAINING, _CE.SEND_UNLOAD): _C.UNLOADING,
    (_C.UNLOADING, _CE.UNLOADED): _C.ABSENT,
    # The replica may still hold it; the replica is demoted and reconciled.
    (_C.UNLOADING, _CE.UNLOAD_FAILED): _C.DRAINING,
}
SERVING = frozenset({_C.LOADED, _C.RELOADING})


class ReplicaState(StrEnum):
    DOWN = "down"  # unhealthy or unreachable; what it holds is unknown
    SYNCING = "syncing"  # listing observed; replaying / cleaning up; not admitted
    UP = "up"  # admitted: holds every routable adapter


class ReplicaEvent(StrEnum):
    OBSERVE = "observe"
    ADMIT = "admit"
    FAULT = "fault"  # an unload/revert failed: our view may be wrong, re-reconcile
    LOST = "lost"


_R, _RE = ReplicaState, ReplicaEvent
REPLICA_TRANSITIONS: dict[tuple[ReplicaState, ReplicaEvent], ReplicaState] = {
    (_R.DOWN, _RE.OBSERVE): _R.SYNCING,
    (_R.SYNCING, _RE.OBSERVE): _R.SYNCING,
    (_R.SYNCING, _RE.ADMIT): _R.UP,
    (_R.UP, _RE.FAULT): _R.SYNCING,
    (_R.SYNCING, _RE.FAULT): _R.SYNCING,
    (_R.DOWN, _RE.LOST): _R.DOWN,
    (_R.SYNCING, _RE.LOST): _R.DOWN,
    (_R.UP, _RE.LOST): _R.DOWN,
}


def audit_drift(
    believed: Mapping[str, str | None], listing: Iterable[ListedAdapter]
) -> dict[str, list[str]]:
    """How a replica's listing differs from what the registry believes it holds:
    ``stray`` (held, not believed), ``missing`` (believed, not held) and ``moved`` (held
    at another path, or at a path the registry no longer knows). Empty: no drift."""
    held = {e.name: e.path for e in listing}
    drift = {
        "stray": sorted(held.keys() - believed.keys()),
        "missing": sorted(believed.keys() - held.keys()),
        "moved": sorted(n for n in held.keys() & believed.keys() if held[n] != believed[n]),
    }
    return {kind: names for kind, names in drift.items() if names}


_S = TypeVar("_S", bound=StrEnum)
_E = TypeVar("_E", bound=StrEnum)


def _advance(table: Mapping[tuple[_S, _E], _S], state: _S, event: _E) -> _S:
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(
            f"event {event.value!r} is illegal in state {state.value!r}"
        ) from None


# ------------------------------------------------------------------ actions & results


@dataclass(frozen=True, slots=True)
class LoadOnReplica:
    op: int
    replica: int
    name: str
    path: str
    inplace: bool
    not_before: float = 0.0  # mount-lag retries are scheduled, not slept, by the core
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class UnloadOnReplica:
    op: int
    replica: int
    name: str


Action = LoadOnReplica | UnloadOnReplica


class Outcome(StrEnum):
    """How the shell classifies one replica's answer (by status code, not by text)."""

    OK = "ok"  # 200
    NOT_FOUND = "not_found"  # load: 404 "No adapter found" (mount lag); unload: 404 = gone
    REJECTED = "rejected"  # other 4xx, e.g. 400 duplicate name without load_inplace
    FAILED = "failed"  # 5xx and anything unexpected
    # No HTTP answer: the replica is *lost* (gateway.fleet.quorum), its state unknown. It is
    # left out of the transaction and reconciled before it holds adapter traffic again.
    UNREACHABLE = "unreachable"  # connect refused, reset before a response
    TIMED_OUT = "timed_out"  # no answer within the call's deadline (a hung replica)


LOST = frozenset({Outcome.UNREACHABLE, Outcome.TIMED_OUT})


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    status: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ListedAdapter:
    """One adapter entry of a replica's ``/v1/models`` (``id`` and ``root``)."""

    name: str
    path: str


class Failure(StrEnum):
    REJECTED = "rejected"  # a replica refused for real -> 502
    NOT_FOUND_TIMEOUT = "not_found_timeout"  # mount lag past the deadline -> 504
    NO_REPLICAS = "no_replicas"  # nothing admitted to load onto -> 503


@dataclass(frozen=True, slots=True)
class Settlement:
    """The end of a load transaction, for the facade to answer the trainer."""

    name: str
    ok: bool
    failure: Failure | None = None
    failures: tuple[tuple[int, Result], ...] = ()
    rolled_back: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class AdapterPolicy:
    """Knobs of the lifecycle (``config.py`` builds this once)."""

    max_staleness: int | None = None  # None: the gateway never evicts by itself
    load_deadline_s: float = 300.0  # mount-lag retries stop here -> 504
    retry_initial_s: float = 0.5
    retry_max_s: float = 2.0
    unload_grace_s: float = 5.0
    name_pattern: NamePattern = field(default_factory=NamePattern)

    def backoff(self, attempt: int) -> float:
        return float(min(self.retry_initial_s * 2 ** (attempt - 1), self.retry_max_s))


# -------------------------------------------------------------------- records


@dataclass(slots=True)
class _Copy:
    state: CopyState
    path: str | None  # what the replica serves under the name; None = unknown
    drain_deadline: float = 0.0
    stuck: bool = False  # an unload failed: left alone until the replica is reconciled
    salt: str = ""  # the cache_salt of this load generation (``AdapterRegistry.salt``)


@dataclass(slots=True)
class _Adapter:
    parsed: AdapterName
    path: str  # the live (or, while LOADING, the requested) path
    state: AdapterState = AdapterState.GONE
    copies: dict[int, _Copy] = field(default_factory=dict)
    loaded_at: float = 0.0
    # transaction
    txn_path: str = ""
    inplace: bool = False
    started_at: float = 0.0
    deadline: float = 0.0
    targets: set[int] = field(default_factory=set)
    failure: Failure | None = None
    failures: dict[int, Result] = field(default_factory=dict)
    rolled_back: set[int] = field(default_factory=set)
    retired_at: float = 0.0

    @property
    def name(self) -> str:
        return self.parsed.name


@dataclass(slots=True)
class _Replica:
    state: ReplicaState = ReplicaState.DOWN
    gave_up: bool = False  # a replay/cleanup failed this round: wait for the next observe
    sync_deadline: float = 0.0


@dataclass(frozen=True, slots=True)
class _Op:
    action: Action
    deadline: float  # mount-lag retries of this op stop at this time


# ------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class AdapterView:
    name: str
    family: str | None
    version: int | None
    path: str
    state: AdapterState
    loaded_at: float
    replicas: tuple[int, ...]
    in_flight: int


@dataclass(frozen=True, slots=True)
class ReplicaView:
    index: int
    state: ReplicaState
    adapters: tuple[str, ...]
    version_lag: int  # max over families of (newest live version - newest held)


@dataclass(frozen=True, slots=True)
class Snapshot:
    adapters: tuple[AdapterView, ...]
    replicas: tuple[ReplicaView, ...]
    live_versions: dict[str, int]  # family -> number of live versions
    counts: dict[str, int]  # "<kind>.<outcome>" -> total


# ------------------------------------------------------------------- registry

RoutingView = tuple[
    dict[str, frozenset[int]], frozenset[str], frozenset[str], dict[str, dict[int, str]]
]


class RequestCounts:
    """Requests in flight per (adapter, replica), counted against ``candidates``: the
    registry's own, and a data-plane worker's over its snapshot
    (``gateway.workers.snapshot.SnapshotRoutes``)."""

    __slots__ = ()
    _inflight: Counter[tuple[str, int]]

    def candidates(self, model: str | None) -> frozenset[int] | None:
        raise NotImplementedError

    def request_started(self, name: str, replica: int) -> bool:
        """Count a request; False (and not counted) if ``replica`` may not serve it."""
        cands = self.candidates(name)
        if cands is None:
            return True
        if replica not in cands:
            return False
        self._inflight[(name, replica)] += 1
        return True

    def salt(self, name: str, replica: int) -> str | None:
        raise NotImplementedError

    def request_finished(self, name: str, replica: int) -> None:
        key = (name, replica)
        if self._inflight[key] <= 1:
            self._inflight.pop(key, None)
        else:
            self._inflight[key] -= 1


class AdapterRegistry(RequestCounts):
    """Desired vs actual adapters per replica, and the transitions between them."""

    def __init__(
        self, policy: AdapterPolicy, replicas: Iterable[int] = (), *, epoch: str = "0"
    ) -> None:
        self.policy = policy
        self._epoch = epoch  # unique per registry (process start): salts never repeat
        self._generations = itertools.count(1)
        self._adapters: dict[str, _Adapter] = {}
        self._replicas: dict[int, _Replica] = {r: _Replica() for r in replicas}
        self._ops: dict[int, _Op] = {}
        self._op_at: dict[tuple[str, int], int] = {}  # (name, replica) -> outstanding op
        self._op_ids = itertools.count(1)
        self._changes: Counter[int] = Counter()  # replica -> actions issued or settled
        self._drains = 0  # copies that entered DRAINING: what can make an unload due
        self._busy: Counter[str] = Counter()  # adapter name -> actions outstanding
        self._inflight: Counter[tuple[str, int]] = Counter()
        self._settled: dict[str, Settlement] = {}
        self._base_models: set[str] = set()
        self._heads: dict[str, int] = {}  # family -> version of its latest publish
        self._tombstones: dict[str, None] = {}  # recently gone names (insertion-ordered)
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------ queries

    def adapter_state(self, name: str) -> AdapterState:
        rec = self._adapters.get(name)
        return rec.state if rec else AdapterState.GONE

    def replica_state(self, replica: int) -> ReplicaState:
        rep = self._replicas.get(replica)
        return rep.state if rep else ReplicaState.DOWN

    def replica_settled(self, replica: int) -> bool:
        """True when no action on ``replica`` is outstanding."""
        return not any(op.action.replica == replica for op in self._ops.values())

    def adapter_settled(self, name: str) -> bool:
        rec = self._adapters.get(name)
        return rec is None or rec.state not in IN_TRANSACTION

    def is_current(self, action: Action) -> bool:
        return action.op in self._ops

    def is_adapter(self, name: str) -> bool:
        return name in self._adapters

    def known_name(self, name: str) -> bool:
        """A registered adapter, or one that went away recently (unload answers 200)."""
        return name in self._adapters or name in self._tombstones

    def set_base_models(self, names: Iterable[str]) -> None:
        self._base_models.update(names)

    def candidates(self, model: str | None) -> frozenset[int] | None:
        """Replicas that may serve ``model``; None if it is not an adapter name at all.

        An empty set means: not routable (unknown, loading, retiring, or no admitted
        replica holds it). Unknown names are only claimed as adapters once the base
        model names are known, so the base model is never mistaken for an adapter.
        """
        if model is None:
            return None
        rec = self._adapters.get(model)
        if rec is None:
            if not self._base_models or model in self._base_models:
                return None
            return frozenset()
        if rec.state not in ROUTABLE:
            return frozenset()
        return frozenset(
            r
            for r, c in rec.copies.items()
            if c.state in SERVING and self._replicas[r].state is ReplicaState.UP
        )

    def routing_view(self) -> RoutingView:
        """What the data path reads, for a worker's snapshot: every registered name's
        candidates, the live names, the base model names, and every copy's salt."""
        cands = {name: self.candidates(name) or frozenset() for name in self._adapters}
        live = frozenset(n for n, r in self._adapters.items() if r.state in ROUTABLE)
        salts = {name: found for name in self._adapters if (found := self.salts(name))}
        return cands, live, frozenset(self._base_models), salts

    def head(self, family: str) -> int | None:
        """The version the staleness window is anchored on: the family's latest completed
        publish (not the highest number: a restarted run may count from v1 again)."""
        return self._heads.get(family)

    def is_live(self, name: str) -> bool:
        rec = self._adapters.get(name)
        return rec is not None and rec.state in ROUTABLE

    def live_adapters(self) -> list[ListedAdapter]:
        """Routable adapters in load order, for ``/v1/models``."""
        live = sorted(
            (r for r in self._adapters.values() if r.state in ROUTABLE),
            key=lambda r: (r.loaded_at, r.name),
        )
        return [ListedAdapter(r.name, r.path) for r in live]

    def believed(self, replica: int) -> dict[str, str | None]:
        """What ``replica`` is believed to hold, for copies with no action outstanding
        (name -> path; None = registered, weights unknown). For tests and status."""
        return {
            rec.name: c.path
            for rec in self._adapters.values()
            if (c := rec.copies.get(replica)) is not None
            and self._op_on(rec.name, replica) is None
            and c.state in (CopyState.LOADED, CopyState.DRAINING)
        }

    def take_settlement(self, name: str) -> Settlement | None:
        return self._settled.pop(name, None)

    def peek_settlement(self, name: str) -> Settlement | None:
        return self._settled.get(name)

    def in_flight(self, name: str, replica: int) -> int:
        return self._inflight[(name, replica)]

    def in_flight_on(self, replica: int) -> int:
        """Requests on ``replica`` for any of this registry's adapters."""
        return sum(n for (_, r), n in self._inflight.items() if r == replica)

    def salt(self, name: str, replica: int) -> str | None:
        """The ``cache_salt`` requests for ``name`` on ``replica`` carry: one per load
        generation of that copy.

        vLLM keys an adapter's prefix-cache blocks by its name and path, not its bytes
        (vllm#42125): after a reload in place, or a later load of a reused name at the same
        path (TRL restarting at v1 in the same folder), prompts would reuse KV computed
        with the old weights. Every load that lands, and every copy found on a replica
        whose weights the registry cannot vouch for, starts a new generation, so blocks
        cached under another one are never matched again. A request sent with the old
        salt while the copy is swapped caches its blocks under that salt, which nothing
        sends afterwards."""
        rec = self._adapters.get(name)
        copy = rec.copies.get(replica) if rec is not None else None
        return copy.salt if copy is not None and copy.salt else None

    def salts(self, name: str) -> dict[int, str]:
        """``salt`` for every copy of ``name`` that has one (a worker's snapshot)."""
        rec = self._adapters.get(name)
        if rec is None:
            return {}
        return {r: c.salt for r, c in rec.copies.items() if c.salt}

    def _new_salt(self) -> str:
        return f"{self._epoch}.{next(self._generations)}"

    # ------------------------------------------------------------- events

    def request_load(self, name: str, path: str, *, inplace: bool, now: float) -> list[Action]:
        """Start a load transaction (the facade serializes loads per name)."""
        rec = self._adapters.get(name)
        state = rec.state if rec else AdapterState.GONE
        _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.LOAD)  # legality first
        self._settled.pop(name, None)
        if rec is None:
            rec = _Adapter(self.policy.name_pattern.parse(name), path)
            self._adapters[name] = rec
            self._tombstones.pop(name, None)
        if state is AdapterState.GONE:
            rec.path = path
        rec.state = _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.LOAD)
        rec.txn_path = path
        # Duplicate name: the live copy is reloaded in place, so it never stops serving.
        rec.inplace = inplace or state is AdapterState.LIVE
        rec.started_at = now
        rec.deadline = now + self.policy.load_deadline_s
        rec.failure = None
        rec.failures = {}
        rec.rolled_back = set()
        rec.targets = {r for r, rep in self._replicas.items() if rep.state is ReplicaState.UP}
        actions: list[Action] = []
        for r in sorted(rec.targets):
            actions.extend(self._send_txn_load(rec, r, now))
        return actions + self._progress(rec, now) + self._due(now)

    def request_unload(self, name: str, now: float) -> list[Action]:
        """Acknowledge an unload at once; copies drain and are unloaded per replica."""
        rec = self._adapters.get(name)
        if rec is None:
            return []
        _advance(ADAPTER_TRANSITIONS, rec.state, AdapterEvent.UNLOAD)
        self.counts["unload.requested"] += 1
        return self._retire(rec, now)

    def set_max_staleness(self, max_staleness: int | None, now: float) -> list[Action]:
        """A reload changed the window (a run's ``max_staleness``): a wider one keeps what
        is live; a narrower one retires, at once, every live version now outside
        ``[head - S, head]`` of its family (drained first, as any eviction)."""
        self.policy = replace(self.policy, max_staleness=max_staleness)
        actions: list[Action] = []
        for family in list(self._heads):
            actions += self._enforce_family(family, now)
        return actions + self._due(now)

    def tick(self, now: float) -> list[Action]:
        """Unloads that became due (drained, or grace timeout passed)."""
        return self._due(now)

    def add_replica(self, replica: int) -> None:
        """A replica joined the pool (discovery): DOWN until observed and admitted."""
        self._replicas.setdefault(replica, _Replica())

    def remove_replica(self, replica: int, now: float) -> list[Action]:
        """A replica left the pool for good: forget it like a lost one, then drop it."""
        if replica not in self._replicas:
            return []
        actions = self.replica_lost(replica, now)
        del self._replicas[replica]
        return actions

    def replica_lost(self, replica: int, now: float) -> list[Action]:
        """The replica is unhealthy or unreachable: forget what it holds."""
        rep = self._replicas.setdefault(replica, _Replica())
        rep.state = _advance(REPLICA_TRANSITIONS, rep.state, ReplicaEvent.LOST)
        rep.gave_up = False
        for op_id in [i for i, op in self._ops.items() if op.action.replica == replica]:
            self._drop_op(op_id)
        actions: list[Action] = []
        for rec in list(self._adapters.values()):
            rec.copies.pop(replica, None)
            rec.targets.discard(replica)
            actions += self._progress(rec, now)
        return actions + self._due(now)

    def observe(self, replica: int, listing: Iterable[ListedAdapter], now: float) -> list[Action]:
        """A (re)joining replica's ``/v1/models`` adapters: replay what it lacks, unload
        what it should not hold. It is admitted (UP) once nothing is left to do."""
        rep = self._replicas.setdefault(replica, _Replica())
        if not self.replica_settled(replica):
            raise IllegalTransition(f"replica {replica} has actions outstanding")
        rep.state = _advance(REPLICA_TRANSITIONS, rep.state, ReplicaEvent.OBSERVE)
        rep.gave_up = False
        rep.sync_deadline = now + self.policy.load_deadline_s
        known: dict[str, _Copy] = {}
        for rec in self._adapters.values():
            old = rec.copies.pop(replica, None)
            if old is not None and old.state in (CopyState.LOADED, CopyState.DRAINING):
                known[rec.name] = old
        actions: list[Action] = []
        for entry in listing:
            found = self._adapters.get(entry.name)
            if found is None:  # a stray: nobody asked for it (old run, manual load)
                found = _Adapter(self.policy.name_pattern.parse(entry.name), entry.path)
                found.state = _advance(ADAPTER_TRANSITIONS, found.state, AdapterEvent.DISCOVER)
                # Unload at once -- unless requests routed to it before we forgot it (its
                # replica flapped while it was retiring) are still running: they drain.
                draining = self._inflight[(entry.name, replica)] > 0
                found.retired_at = now - (0.0 if draining else self.policy.unload_grace_s)
                self._adapters[entry.name] = found
            rec = found
            old = known.get(entry.name)
            # Same weights as we last knew (same path, no load since): same generation.
            vouched = old is not None and old.path == entry.path and old.salt
            rec.copies[replica] = _Copy(
                _advance(COPY_TRANSITIONS, CopyState.ABSENT, CopyEvent.OBSERVED),
                entry.path,
                salt=old.salt if vouched and old is not None else self._new_salt(),
            )
            if rec.state is AdapterState.RETIRING:
                self._retire_copy(rec, replica, now)
        return actions + self._sync_step(replica, now) + self._due(now)

    def rebuild(self, listings: Mapping[int, Iterable[ListedAdapter]], now: float) -> list[Action]:
        """Gateway restart: every adapter found on any replica is adopted as live (the
        majority path wins); each replica is then reconciled as if it had just joined.
        No staleness eviction happens here -- only the next publish sets the window."""
        if self._adapters:
            raise IllegalTransition("rebuild needs an empty registry")
        listed = {r: list(entries) for r, entries in listings.items()}
        paths: dict[str, Counter[str]] = {}
        for entries in listed.values():
            for e in entries:
                paths.setdefault(e.name, Counter())[e.path] += 1
        for name, counter in paths.items():
            best = max(counter.items(), key=lambda kv: (kv[1], kv[0]))[0]
            rec = _Adapter(self.policy.name_pattern.parse(name), best, loaded_at=now)
            rec.state = _advance(ADAPTER_TRANSITIONS, rec.state, AdapterEvent.ADOPT)
            self._adapters[name] = rec
        self.counts["load.adopted"] += len(paths)
        actions: list[Action] = []
        for r, entries in sorted(listed.items()):
            actions += self.observe(r, entries, now)
        return actions

    def audit_mark(self, replica: int) -> int:
        """Taken before an audit's listing is asked for: ``audit`` ignores a listing
        when any action on the replica was issued or settled after its mark."""
        return self._changes[replica]

    def audit(
        self, replica: int, listing: Iterable[ListedAdapter], mark: int, now: float
    ) -> tuple[dict[str, list[str]], list[Action]]:
        """A periodic re-read of an admitted replica's ``/v1/models``.

        Health probes only say a replica answers. What it holds can still drift from the
        registry: a load a hung replica applied late, after it was left out of the
        transaction (a stray holding one of vLLM's ``--max-loras`` slots); a replica that
        restarted between two probes (a live version missing: vLLM would 404 it); a
        manual load or unload. Any difference sends the replica back to reconciliation,
        as after a fault: strays are unloaded, missing versions replayed, and it is
        admitted again once it holds what the registry says. A copy whose path did not
        change keeps its salt (``observe``), so its cached KV stays usable. Returns the
        drift acted on (``audit_drift``; empty: none, or the listing was not usable) and
        the actions."""
        rep = self._replicas.get(replica)
        if (
            rep is None
            or rep.state is not ReplicaState.UP
            or self._changes[replica] != mark
            or not self.replica_settled(replica)
        ):
            return {}, []  # not admitted, or something changed since the listing was asked
        entries = list(listing)
        drift = audit_drift(self.believed(replica), entries)
        if not drift:
            return {}, []
        for kind, names in drift.items():
            self.counts[f"audit.{kind}"] += len(names)
        rep.state = _advance(REPLICA_TRANSITIONS, rep.state, ReplicaEvent.FAULT)
        return drift, self.observe(replica, entries, now)

    def on_result(self, action: Action, result: Result, now: float) -> list[Action]:
        """Feed back one performed action. Results of cancelled actions are ignored."""
        op = self._drop_op(action.op)
        if op is None:
            return []
        r = action.replica
        if result.outcome in LOST:
            self.counts[f"replica.{result.outcome.value}"] += 1
            return self.replica_lost(r, now)
        rec = self._adapters[action.name]
        drains = self._drains
        if isinstance(action, LoadOnReplica):
            actions = self._on_load(rec, action, op, result, now)
        else:
            actions = self._on_unload(rec, action, result, now)
        actions += self._progress(rec, now) + self._sync_step(r, now)
        # One answer can make an unload due only by retiring a copy (in-flight counts and
        # the clock move in request_finished and tick): a scan of every copy per answer
        # made a load on N replicas cost adapters x N^2 (bench.control_plane.registry).
        return actions + (self._due(now) if self._drains != drains else [])

    # ---------------------------------------------------------- internals

    def _new_op(self, action: Action, deadline: float) -> None:
        key = (action.name, action.replica)
        assert key not in self._op_at, f"two outstanding actions for {key}"
        self._changes[action.replica] += 1
        self._busy[action.name] += 1
        self._ops[action.op] = _Op(action, deadline)
        self._op_at[key] = action.op

    def _drop_op(self, op_id: int) -> _Op | None:
        op = self._ops.pop(op_id, None)
        if op is not None:
            del self._op_at[(op.action.name, op.action.replica)]
            self._changes[op.action.replica] += 1
            self._busy[op.action.name] -= 1
            if not self._busy[op.action.name]:
                del self._busy[op.action.name]
        return op

    def _op_on(self, name: str, replica: int) -> _Op | None:
        op_id = self._op_at.get((name, replica))
        return None if op_id is None else self._ops[op_id]

    def _send_load(
        self, rec: _Adapter, r: int, path: str, inplace: bool, deadline: float
    ) -> list[Action]:
        copy = rec.copies.get(r)
        if copy is None:
            copy = _Copy(CopyState.ABSENT, None)
            copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.SEND_LOAD)
            rec.copies[r] = copy
        else:
            copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.SEND_RELOAD)
            inplace = True
        action = LoadOnReplica(next(self._op_ids), r, rec.name, path, inplace)
        self._new_op(action, deadline)
        return [action]

    def _send_txn_load(self, rec: _Adapter, r: int, now: float) -> list[Action]:
        return self._send_load(rec, r, rec.txn_path, rec.inplace, rec.deadline)

    def _on_load(
        self, rec: _Adapter, action: LoadOnReplica, op: _Op, result: Result, now: float
    ) -> list[Action]:
        r = action.replica
        copy = rec.copies[r]
        outcome = result.outcome
        if outcome is Outcome.REJECTED and not action.inplace:
            # 400 on a plain load: most likely "already loaded" (our view was stale).
            # Retry once in place rather than reading the error text.
            return self._schedule(op, action, now, inplace=True, at=now)
        if outcome is Outcome.NOT_FOUND and now < op.deadline and self._still_wanted(rec, action):
            self.counts["load.retry_not_found"] += 1
            at = min(now + self.policy.backoff(action.attempt), op.deadline)
            return self._schedule(op, action, now, inplace=action.inplace, at=at)
        ok = outcome is Outcome.OK
        copy.state = _advance(
            COPY_TRANSITIONS, copy.state, CopyEvent.LOAD_OK if ok else CopyEvent.LOAD_FAILED
        )
        copy.salt = self._new_salt()  # new weights, or (a failed reload) unknown ones
        if ok:
            copy.path = action.path
        elif copy.state is CopyState.LOADED and outcome is not Outcome.NOT_FOUND:
            copy.path = None  # a failed in-place load: weights unknown
        if copy.state is CopyState.ABSENT:
            del rec.copies[r]
        if rec.state in (AdapterState.LOADING, AdapterState.REPLACING) and r in rec.targets:
            if not ok:
                rec.failures[r] = result
                failure = (
                    Failure.NOT_FOUND_TIMEOUT if outcome is Outcome.NOT_FOUND else Failure.REJECTED
                )
                return self._fail(rec, failure, now)
            return []
        if rec.state is AdapterState.ROLLING_BACK and r in rec.targets:
            if ok:
                return self._retire_copy(rec, r, now)
            return []
        if rec.state is AdapterState.REVERTING and r in rec.targets:
            if ok and copy.path != rec.path:
                return self._send_load(rec, r, rec.path, True, now + self.policy.load_deadline_s)
            if not ok:
                return self._demote(r, now)
            return []
        # a replay onto a syncing replica
        if not ok:
            self.counts["replay.failed"] += 1
            self._replicas[r].gave_up = True
        return []

    def _schedule(
        self, op: _Op, action: LoadOnReplica, now: float, *, inplace: bool, at: float
    ) -> list[Action]:
        retry = LoadOnReplica(
            next(self._op_ids),
            action.replica,
            action.name,
            action.path,
            inplace,
            not_before=at,
            attempt=action.attempt + 1,
        )
        self._new_op(retry, op.deadline)
        return [retry]

    def _still_wanted(self, rec: _Adapter, action: LoadOnReplica) -> bool:
        if rec.state in (AdapterState.LOADING, AdapterState.REPLACING):
            return action.replica in rec.targets
        return rec.state in ROUTABLE and self._replicas[action.replica].state is not ReplicaState.UP

    def _on_unload(
        self, rec: _Adapter, action: UnloadOnReplica, result: Result, now: float
    ) -> list[Action]:
        r = action.replica
        copy = rec.copies[r]
        # 404 "cannot be found": already gone, which is what we wanted.
        if result.outcome in (Outcome.OK, Outcome.NOT_FOUND):
            copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.UNLOADED)
            del rec.copies[r]
            self.counts["unload.ok"] += 1
            if rec.state is AdapterState.ROLLING_BACK:
                rec.rolled_back.add(r)
            return []
        copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.UNLOAD_FAILED)
        copy.stuck = True  # not retried until the replica is reconciled
        self.counts["unload.failed"] += 1
        return self._demote(r, now)

    def _demote(self, r: int, now: float) -> list[Action]:
        """Our view of ``r`` may be wrong: stop routing to it until it is reconciled."""
        rep = self._replicas[r]
        rep.state = _advance(REPLICA_TRANSITIONS, rep.state, ReplicaEvent.FAULT)
        rep.gave_up = True
        actions: list[Action] = []
        for rec in self._adapters.values():
            if r in rec.targets and rec.state in (AdapterState.LOADING, AdapterState.REPLACING):
                rec.targets.discard(r)
                actions += self._progress(rec, now)
        return actions

    def _fail(self, rec: _Adapter, failure: Failure, now: float) -> list[Action]:
        rec.state = _advance(ADAPTER_TRANSITIONS, rec.state, AdapterEvent.LOAD_FAILED)
        rec.failure = failure
        rec.retired_at = now - self.policy.unload_grace_s  # never routable: no drain
        actions: list[Action] = []
        for r in sorted(rec.targets):
            op = self._op_on(rec.name, r)
            if (
                op is not None
                and isinstance(op.action, LoadOnReplica)
                and op.action.not_before > now
            ):
                # a scheduled mount-lag retry that was never sent: cancel it
                self._drop_op(op.action.op)
                copy = rec.copies[r]
                copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.LOAD_FAILED)
                if copy.state is CopyState.ABSENT:
                    del rec.copies[r]
                op = None
            if op is not None:
                continue  # answered later, handled in _on_load
            copy_ = rec.copies.get(r)
            if copy_ is None:
                continue
            if rec.state is AdapterState.ROLLING_BACK:
                actions += self._retire_copy(rec, r, now)
            elif copy_.path != rec.path:
                actions += self._send_load(
                    rec, r, rec.path, True, now + self.policy.load_deadline_s
                )
        return actions

    def _retire(self, rec: _Adapter, now: float) -> list[Action]:
        """LIVE -> RETIRING: stop routing now; each copy drains for up to the grace."""
        if rec.state is not AdapterState.RETIRING:
            rec.retired_at = now
        rec.state = _advance(ADAPTER_TRANSITIONS, rec.state, AdapterEvent.UNLOAD)
        for r in list(rec.copies):
            self._retire_copy(rec, r, now)
        return self._progress(rec, now) + self._due(now)

    def _retire_copy(self, rec: _Adapter, r: int, now: float) -> list[Action]:
        """Mark an undesired copy for unload. Requests can only have been routed to it
        while the adapter was routable, i.e. before ``retired_at``: the grace counts
        from then (rollbacks and strays set ``retired_at`` in the past)."""
        copy = rec.copies[r]
        if copy.state is CopyState.LOADED and self._op_on(rec.name, r) is None:
            copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.RETIRE)
            copy.drain_deadline = rec.retired_at + self.policy.unload_grace_s
            self._drains += 1
        return []

    def _due(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for rec in self._adapters.values():
            for r, copy in rec.copies.items():
                if copy.state is not CopyState.DRAINING or copy.stuck:
                    continue
                if self._inflight[(rec.name, r)] > 0 and now < copy.drain_deadline:
                    continue
                if self._replicas[r].state is ReplicaState.DOWN:
                    continue
                copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.SEND_UNLOAD)
                action = UnloadOnReplica(next(self._op_ids), r, rec.name)
                self._new_op(action, now)
                actions.append(action)
        return actions

    def _progress(self, rec: _Adapter, now: float) -> list[Action]:
        """Advance an adapter whose copies changed; may finish its transaction."""
        busy = rec.name in self._busy  # an action outstanding on any of its copies
        state = rec.state
        if state in (AdapterState.LOADING, AdapterState.REPLACING):
            if not rec.targets:
                return self._fail(rec, Failure.NO_REPLICAS, now) + self._progress(rec, now)
            done = all(
                (c := rec.copies.get(r)) is not None
                and c.state is CopyState.LOADED
                and c.path == rec.txn_path
                for r in rec.targets
            )
            if done and not busy:
                rec.state = _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.ALL_LOADED)
                rec.path = rec.txn_path
                rec.loaded_at = now
                self._settle(rec, now, ok=True)
                if rec.parsed.family is not None and rec.parsed.version is not None:
                    self._heads[rec.parsed.family] = rec.parsed.version
                return self._enforce_window(rec, now)
            return []
        if state is AdapterState.ROLLING_BACK:
            if not any(r in rec.targets for r in rec.copies):
                rec.state = _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.ROLLED_BACK)
                self._settle(rec, now, ok=False)
                if rec.copies:  # copies on non-target replicas (e.g. stray observations)
                    rec.state = _advance(ADAPTER_TRANSITIONS, rec.state, AdapterEvent.DISCOVER)
                    for r in list(rec.copies):
                        self._retire_copy(rec, r, now)
                    return []
                self._forget(rec)
            return []
        if state is AdapterState.REVERTING:
            if busy:
                return []
            targets = sorted(rec.targets)
            rec.state = _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.ROLLED_BACK)
            self._settle(rec, now, ok=False)
            actions = self._enforce_window(rec, now)  # a newer head may have gone live
            for r in targets:
                c = rec.copies.get(r)
                if (c is None or c.path != rec.path) and (
                    self._replicas[r].state is ReplicaState.UP
                ):
                    actions += self._demote(r, now)
            return actions
        if state is AdapterState.RETIRING and not rec.copies:
            rec.state = _advance(ADAPTER_TRANSITIONS, state, AdapterEvent.ALL_UNLOADED)
            self._forget(rec)
        return []

    def _settle(self, rec: _Adapter, now: float, *, ok: bool) -> None:
        outcome = "ok" if ok else (rec.failure or Failure.REJECTED).value
        self.counts[f"load.{outcome}"] += 1
        self._settled[rec.name] = Settlement(
            name=rec.name,
            ok=ok,
            failure=None if ok else rec.failure,
            failures=tuple(sorted(rec.failures.items())),
            rolled_back=tuple(sorted(rec.rolled_back)),
            replicas=tuple(sorted(rec.targets)),
            seconds=now - rec.started_at,
        )
        rec.targets = set()

    def _forget(self, rec: _Adapter) -> None:
        del self._adapters[rec.name]
        self._tombstones[rec.name] = None
        while len(self._tombstones) > 1024:
            del self._tombstones[next(iter(self._tombstones))]

    def _enforce_window(self, changed: _Adapter, now: float) -> list[Action]:
        """Retire the LIVE versions of ``changed``'s family outside [head - S, head]."""
        fam = changed.parsed.family
        return [] if fam is None else self._enforce_family(fam, now)

    def _enforce_family(self, fam: str, now: float) -> list[Action]:
        s = self.policy.max_staleness
        head = self._heads.get(fam)
        if s is None or head is None:
            return []
        actions: list[Action] = []
        for rec in list(self._adapters.values()):
            ver = rec.parsed.version
            if rec.parsed.family != fam or ver is None or rec.state is not AdapterState.LIVE:
                continue
            if not head - s <= ver <= head:
                self.counts["evict.stale"] += 1
                actions += self._retire(rec, now)
        return actions

    def _sync_step(self, r: int, now: float) -> list[Action]:
        """Replay/cleanup for a SYNCING replica; admit it when nothing is left."""
        rep = self._replicas.get(r)
        if rep is None or rep.state is not ReplicaState.SYNCING or rep.gave_up:
            return []
        actions: list[Action] = []
        pending = False
        for rec in self._adapters.values():
            if self._op_on(rec.name, r) is not None:
                pending = True
                continue
            copy = rec.copies.get(r)
            if rec.state in ROUTABLE:
                if copy is None or copy.path != rec.path:
                    actions += self._send_load(rec, r, rec.path, False, rep.sync_deadline)
                    self.counts["replay.load"] += 1
            elif copy is not None:
                pending = True
                if copy.state is CopyState.LOADED and self._op_on(rec.name, r) is None:
                    # not routable here: RETIRING drains from retired_at, others at once
                    copy.state = _advance(COPY_TRANSITIONS, copy.state, CopyEvent.RETIRE)
                    self._drains += 1
                    copy.drain_deadline = (
                        rec.retired_at + self.policy.unload_grace_s
                        if rec.state is AdapterState.RETIRING
                        else now
                    )
        if actions or pending:
            return actions
        rep.state = _advance(REPLICA_TRANSITIONS, rep.state, ReplicaEvent.ADMIT)
        # join open transactions so they cannot go live without this replica
        for rec in self._adapters.values():
            if rec.state in (AdapterState.LOADING, AdapterState.REPLACING):
                rec.targets.add(r)
                actions += self._send_txn_load(rec, r, now)
        return actions

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> Snapshot:
        heads: dict[str, int] = {}
        live_versions: Counter[str] = Counter()
        for rec in self._adapters.values():
            fam, ver = rec.parsed.family, rec.parsed.version
            if rec.state in ROUTABLE and fam is not None and ver is not None:
                live_versions[fam] += 1
                heads[fam] = max(heads.get(fam, ver), ver)
        adapters = tuple(
            AdapterView(
                rec.name,
                rec.parsed.family,
                rec.parsed.version,
                rec.path,
                rec.state,
                rec.loaded_at,
                tuple(sorted(r for r, c in rec.copies.items() if c.state in SERVING)),
                sum(n for (name, _), n in self._inflight.items() if name == rec.name),
            )
            for rec in sorted(self._adapters.values(), key=lambda r: r.name)
        )
        replicas = []
        for r, rep in sorted(self._replicas.items()):
            held = [a for a in adapters if r in a.replicas]
            lag = 0
            for fam, head in heads.items():
                mine = [a.version for a in held if a.family == fam and a.version is not None]
                lag = max(lag, head - max(mine) if mine else head)
            if rep.state is ReplicaState.DOWN:
                lag = 0
            replicas.append(ReplicaView(r, rep.state, tuple(a.name for a in held), lag))
        return Snapshot(adapters, tuple(replicas), dict(live_versions), dict(self.counts))
