"""Hypothesis stateful test of the adapter core against fake replicas.

Actions the core emits go into a queue; the ``deliver`` rule performs any one of them on
its fake replica (in any order, at any later time), so loads, unloads, request starts and
ends, replica deaths and rejoins, and ticks interleave freely. The invariants are plain
functions, so a shrunk failure can be replayed as an example test.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from gateway.adapters.state import (
    Action,
    AdapterPolicy,
    AdapterRegistry,
    AdapterState,
    LoadOnReplica,
    Outcome,
    ReplicaState,
    UnloadOnReplica,
)
from tests.adapters._fake import FakeReplica

N = 3
S = 2
GRACE = 5.0
POLICY = AdapterPolicy(
    max_staleness=S,
    load_deadline_s=20.0,
    retry_initial_s=0.5,
    retry_max_s=2.0,
    unload_grace_s=GRACE,
)
FAMILY = "pol"
VERSIONS = st.integers(1, 6)


def name_of(version: int) -> str:
    return f"{FAMILY}-v{version}"


# ----------------------------------------------------------------- invariants


def check_live_on_every_up_replica(core: AdapterRegistry, fakes: list[FakeReplica]) -> None:
    for adapter in core.live_adapters():
        for r, fake in enumerate(fakes):
            if core.replica_state(r) is ReplicaState.UP:
                assert adapter.name in fake.held, f"live {adapter.name} missing on {r}"


def check_candidates_hold(core: AdapterRegistry, fakes: list[FakeReplica], names: set[str]) -> None:
    for name in names:
        for r in core.candidates(name) or ():
            assert name in fakes[r].held, f"{name} routable to {r}, which lacks it"


def check_beliefs(core: AdapterRegistry, fakes: list[FakeReplica]) -> None:
    """For admitted replicas, settled beliefs match reality (so one name, one path)."""
    for r, fake in enumerate(fakes):
        if core.replica_state(r) is not ReplicaState.UP:
            continue
        for name, path in core.believed(r).items():
            assert name in fake.held, f"core believes {r} holds {name}"
            if path is not None:
                assert fake.held[name] == path, f"{name} on {r}: {fake.held[name]} != {path}"


def check_window(core: AdapterRegistry, fakes: list[FakeReplica], head: int | None) -> None:
    """After quiescing: no admitted replica holds a version outside [head - S, head]."""
    if head is None:
        return
    for r, fake in enumerate(fakes):
        if core.replica_state(r) is not ReplicaState.UP:
            continue
        for name in fake.held:
            version = int(name.rsplit("-v", 1)[1])
            assert head - S <= version <= head, f"{name} outside window of v{head} on {r}"


def check_unload_allowed(
    action: UnloadOnReplica, now: float, in_flight: int, retired_at: float | None
) -> None:
    if in_flight:
        assert retired_at is not None, f"unload of routable {action.name} under requests"
        assert now >= retired_at + GRACE, (
            f"unload of {action.name} on {action.replica} with {in_flight} in flight, "
            f"{now - retired_at:.2f}s after it stopped being routable"
        )


# ------------------------------------------------------------------- machine


class AdapterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = AdapterRegistry(POLICY, range(N))
        self.core.set_base_models(["base"])
        self.fakes = [FakeReplica() for _ in range(N)]
        self.pending: list[Action] = []
        self.requests: list[tuple[str, int]] = []
        self.names: set[str] = set()
        self.retired_at: dict[str, float] = {}
        self.head: int | None = None
        for r in range(N):
            self._apply(self.core.observe(r, [], self.now))

    # helpers
    def _apply(self, actions: list[Action]) -> None:
        self.pending.extend(actions)
        for name in list(self.names):
            if self.core.is_live(name):
                self.retired_at.pop(name, None)
            else:
                self.retired_at.setdefault(name, self.now)
        completed = []
        for name in self.names:
            settled = self.core.take_settlement(name)
            if settled is not None:
                event(f"settled ok={settled.ok} failure={settled.failure}")
            if settled is not None and settled.ok:
                completed.append(int(name.rsplit("-v", 1)[1]))
        if completed:
            # Several publishes can complete in one step (a replica loss ends them all);
            # the core anchors the window on the last one it completed, one of these.
            head = self.core.head(FAMILY)
            assert head in completed, f"window anchored on v{head}, not on any of {completed}"
            self.head = head

    def _deliver(self, index: int) -> None:
        action = self.pending.pop(index)
        if isinstance(action, LoadOnReplica):
            self.now = max(self.now, action.not_before)
        if not self.core.is_current(action):
            return
        if isinstance(action, UnloadOnReplica):
            key = (action.name, action.replica)
            check_unload_allowed(
                action, self.now, self.requests.count(key), self.retired_at.get(action.name)
            )
        result = self.fakes[action.replica].perform(action)
        event(f"{type(action).__name__} -> {result.outcome.value}")
        self._apply(self.core.on_result(action, result, self.now))

    # rules
    @rule(version=VERSIONS, variant=st.integers(0, 1), inplace=st.booleans())
    def publish(self, version: int, variant: int, inplace: bool) -> None:
        name = name_of(version)
        self.names.add(name)
        state = self.core.adapter_state(name)
        if state not in (AdapterState.GONE, AdapterState.LIVE):
            return  # the facade waits for the transaction / the retirement to finish
        path = f"/runs/{variant}/{name}"
        self._apply(self.core.request_load(name, path, inplace=inplace, now=self.now))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._deliver(data.draw(st.integers(0, len(self.pending) - 1)))

    @rule(
        r=st.integers(0, N - 1),
        outcome=st.sampled_from(
            [Outcome.NOT_FOUND, Outcome.FAILED, Outcome.REJECTED, Outcome.UNREACHABLE]
        ),
        count=st.integers(1, 3),
    )
    def load_fault(self, r: int, outcome: Outcome, count: int) -> None:
        self.fakes[r].load_faults.extend([outcome] * count)

    @rule(r=st.integers(0, N - 1), outcome=st.sampled_from([Outcome.FAILED, Outcome.UNREACHABLE]))
    def unload_fault(self, r: int, outcome: Outcome) -> None:
        self.fakes[r].unload_faults.append(outcome)

    @rule(version=VERSIONS)
    def unload(self, version: int) -> None:
        name = name_of(version)
        self.names.add(name)
        if self.core.adapter_state(name) in (AdapterState.LIVE, AdapterState.RETIRING):
            self._apply(self.core.request_unload(name, self.now))

    @rule(version=VERSIONS, data=st.data())
    def request_start(self, version: int, data: st.DataObject) -> None:
        name = name_of(version)
        self.names.add(name)
        cands = self.core.candidates(name)
        assert cands is not None  # an adapter-shaped name once base models are known
        if not cands:
            return
        r = data.draw(st.sampled_from(sorted(cands)))
        assert name in self.fakes[r].held, f"routed {name} to {r}, which lacks it"
        assert self.core.request_started(name, r)
        self.requests.append((name, r))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def request_end(self, data: st.DataObject) -> None:
        name, r = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.core.request_finished(name, r)

    @rule(r=st.integers(0, N - 1), kill=st.booleans(), wipe=st.booleans())
    def replica_down(self, r: int, kill: bool, wipe: bool) -> None:
        self.fakes[r].alive = not kill
        if wipe:  # a restarted vLLM comes back empty
            self.fakes[r].held.clear()
        self._apply(self.core.replica_lost(r, self.now))

    @rule(r=st.integers(0, N - 1))
    def replica_up(self, r: int) -> None:
        if self.core.replica_state(r) is ReplicaState.UP or not self.core.replica_settled(r):
            return
        self.fakes[r].alive = True
        self._apply(self.core.observe(r, self.fakes[r].listing(), self.now))

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0, GRACE + 0.5]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.core.tick(self.now))

    @rule()
    def quiesce(self) -> None:
        """No more faults: deliver everything, let the grace pass; the window holds."""
        for fake in self.fakes:
            fake.load_faults.clear()
            fake.unload_faults.clear()
        for _ in range(200):
            while self.pending:
                self._deliver(0)
            self.now += GRACE + 1
            self._apply(self.core.tick(self.now))
            if not self.pending:
                break
        assert not self.pending
        check_window(self.core, self.fakes, self.head)

    # invariants
    @invariant()
    def live_on_every_up_replica(self) -> None:
        check_live_on_every_up_replica(self.core, self.fakes)

    @invariant()
    def candidates_hold_their_adapter(self) -> None:
        check_candidates_hold(self.core, self.fakes, self.names)

    @invariant()
    def beliefs_match_replicas(self) -> None:
        check_beliefs(self.core, self.fakes)


AdapterMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdapterMachine = AdapterMachine.TestCase
