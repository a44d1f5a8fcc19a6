"""Example tests for the adapter core: one scenario each, fake replicas, fake clock."""

from __future__ import annotations

import pytest

from gateway.adapters.naming import AdapterName, NamePattern
from gateway.adapters.state import (
    ADAPTER_TRANSITIONS,
    Action,
    AdapterPolicy,
    AdapterRegistry,
    AdapterState,
    Failure,
    IllegalTransition,
    LoadOnReplica,
    Outcome,
    ReplicaState,
    UnloadOnReplica,
)
from tests.adapters._fake import FakeReplica, drive

POLICY = AdapterPolicy(
    max_staleness=2, load_deadline_s=10.0, retry_initial_s=0.5, retry_max_s=2.0, unload_grace_s=5.0
)


def make(n: int = 2, policy: AdapterPolicy = POLICY) -> tuple[AdapterRegistry, list[FakeReplica]]:
    core = AdapterRegistry(policy, range(n))
    core.set_base_models(["base"])
    fakes = [FakeReplica() for _ in range(n)]
    for r in range(n):
        drive(core, fakes, core.observe(r, [], 0.0), 0.0)
    return core, fakes


def publish(core: AdapterRegistry, fakes: list[FakeReplica], v: int, now: float = 0.0) -> float:
    name = f"p-v{v}"
    return drive(core, fakes, core.request_load(name, f"/r/{name}", inplace=False, now=now), now)


# ------------------------------------------------------------------- naming


@pytest.mark.parametrize(
    ("name", "family", "version"),
    [
        ("trl-policy-v12", "trl-policy", 12),
        ("a-v0", "a", 0),
        ("x-v-v3", "x-v", 3),
        ("trl-policy", None, None),
        ("-v3", None, None),
        ("p-v3a", None, None),
        ("p-v\u0663", None, None),  # a non-ASCII digit is not a version
    ],
)
def test_parse(name: str, family: str | None, version: int | None) -> None:
    assert NamePattern().parse(name) == AdapterName(name, family, version)


def test_custom_pattern_and_validation() -> None:
    pattern = NamePattern(r"^(?P<family>\w+)@(?P<version>\d+)$")
    assert pattern.parse("pol@7") == AdapterName("pol@7", "pol", 7)
    with pytest.raises(ValueError, match="lacks named group"):
        NamePattern(r"^(?P<family>.+)$")
    with pytest.raises(ValueError, match="invalid"):
        NamePattern("(")


# -------------------------------------------------------------- the tables


def test_illegal_event_raises_and_changes_nothing() -> None:
    core, fakes = make()
    actions = core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0)
    assert core.adapter_state("p-v1") is AdapterState.LOADING
    before = core.snapshot()
    with pytest.raises(IllegalTransition):
        core.request_unload("p-v1", 0.0)  # the facade defers unloads during a load
    with pytest.raises(IllegalTransition):
        core.request_load("p-v1", "/r/other", inplace=False, now=0.0)
    assert core.snapshot() == before
    with pytest.raises(IllegalTransition):
        core.observe(0, [], 0.0)  # outstanding actions on replica 0
    drive(core, fakes, actions, 0.0)
    with pytest.raises(IllegalTransition):
        core.observe(0, [], 0.0)  # UP replicas are not re-observed
    assert core.snapshot().replicas[0].state is ReplicaState.UP


def test_table_targets_are_states() -> None:
    assert all(isinstance(v, AdapterState) for v in ADAPTER_TRANSITIONS.values())


# ------------------------------------------------------------------ loading


def test_load_all_or_nothing_success() -> None:
    core, fakes = make(3)
    actions = core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0)
    assert sorted(a.replica for a in actions) == [0, 1, 2]
    assert core.candidates("p-v1") == frozenset()  # not live before every replica has it
    first = actions[0]
    more = core.on_result(first, fakes[0].perform(first), 0.1)
    assert more == []
    assert core.candidates("p-v1") == frozenset()
    drive(core, fakes, actions[1:], 0.2)
    assert core.candidates("p-v1") == {0, 1, 2}
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.ok and settled.replicas == (0, 1, 2)
    assert [a.name for a in core.live_adapters()] == ["p-v1"]


def test_real_failure_rolls_back_accepted_replicas() -> None:
    core, fakes = make(3)
    fakes[1].load_faults = [Outcome.FAILED]
    drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and not settled.ok
    assert settled.failure is Failure.REJECTED
    assert [r for r, _ in settled.failures] == [1]
    assert settled.rolled_back == (0, 2)
    assert all(not f.held for f in fakes)
    assert core.adapter_state("p-v1") is AdapterState.GONE
    assert core.candidates("p-v1") == frozenset()


def test_a_timed_out_replica_is_lost_not_failed_and_its_late_load_is_cleaned_up() -> None:
    """gateway.fleet.quorum: no answer in time = lost. The load goes live on the others; the hung
    replica is out of adapter traffic until it is re-read, and what it applied late (a
    version retired meanwhile) is unloaded then, not left as a stray."""
    core, fakes = make(3)
    fakes[1].load_faults = [Outcome.TIMED_OUT]
    drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.ok and settled.replicas == (0, 2)
    assert core.candidates("p-v1") == {0, 2}
    assert core.replica_state(1) is ReplicaState.DOWN
    assert core.counts["replica.timed_out"] == 1
    drive(core, fakes, core.request_unload("p-v1", 1.0), 1.0)
    drive(core, fakes, core.tick(10.0), 10.0)
    assert core.adapter_state("p-v1") is AdapterState.GONE
    fakes[1].held["p-v1"] = "/r/p-v1"  # the hung replica wakes up and applies the load
    actions = core.observe(1, fakes[1].listing(), 12.0)
    assert [(type(a), a.name) for a in actions] == [(UnloadOnReplica, "p-v1")]
    drive(core, fakes, actions, 12.0)
    assert not fakes[1].held
    assert core.replica_state(1) is ReplicaState.UP
    assert core.candidates("p-v1") == frozenset()


def test_not_found_three_times_then_ok_goes_live() -> None:
    core, fakes = make(2)
    fakes[1].load_faults = [Outcome.NOT_FOUND] * 3
    now = drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.ok
    assert now == pytest.approx(0.5 + 1.0 + 2.0)  # backoff 0.5, 1, 2 (capped)
    assert core.counts["load.retry_not_found"] == 3
    assert core.candidates("p-v1") == {0, 1}


def test_not_found_until_deadline_is_a_timeout_never_404() -> None:
    core, fakes = make(2)
    fakes[1].load_faults = [Outcome.NOT_FOUND] * 100
    now = drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.failure is Failure.NOT_FOUND_TIMEOUT
    assert now == pytest.approx(POLICY.load_deadline_s)
    assert settled.rolled_back == (0,)
    assert not fakes[0].held


def test_failure_cancels_scheduled_retries() -> None:
    core, fakes = make(3)
    fakes[1].load_faults = [Outcome.NOT_FOUND]
    fakes[2].load_faults = [Outcome.FAILED]
    actions = core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0)
    by = {a.replica: a for a in actions}
    retry = core.on_result(by[1], fakes[1].perform(by[1]), 0.0)
    assert isinstance(retry[0], LoadOnReplica) and retry[0].not_before == 0.5
    rollback = core.on_result(by[2], fakes[2].perform(by[2]), 0.1)
    assert not core.is_current(retry[0])  # never sent
    drive(core, fakes, [by[0], *rollback], 0.2)
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.rolled_back == (0,)


def test_unreachable_replica_is_dropped_not_fatal() -> None:
    core, fakes = make(2)
    fakes[1].alive = False
    drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.ok and settled.replicas == (0,)
    assert core.replica_state(1) is ReplicaState.DOWN
    assert core.candidates("p-v1") == {0}


def test_no_admitted_replica() -> None:
    core = AdapterRegistry(POLICY, range(2))
    assert core.request_load("p-v1", "/r", inplace=False, now=0.0) == []
    settled = core.take_settlement("p-v1")
    assert settled is not None and settled.failure is Failure.NO_REPLICAS


def test_stale_view_400_is_retried_in_place() -> None:
    core, fakes = make(2)
    fakes[1].held["p-v1"] = "/old"  # loaded behind our back
    drive(core, fakes, core.request_load("p-v1", "/r/p-v1", inplace=False, now=0.0), 0.0)
    assert core.take_settlement("p-v1").ok  # type: ignore[union-attr]
    assert fakes[1].held["p-v1"] == "/r/p-v1"


# ---------------------------------------------------------- duplicate names


def test_duplicate_name_reloads_in_place_with_no_gap() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    actions = core.request_load("p-v1", "/new/p-v1", inplace=False, now=1.0)
    assert all(isinstance(a, LoadOnReplica) and a.inplace for a in actions)
    assert core.adapter_state("p-v1") is AdapterState.REPLACING
    for a in actions:
        assert core.candidates("p-v1") == {0, 1}  # old weights keep serving
        core.on_result(a, fakes[a.replica].perform(a), 1.0)
    assert core.adapter_state("p-v1") is AdapterState.LIVE
    assert [x.path for x in core.live_adapters()] == ["/new/p-v1"]


def test_failed_replacement_reverts_to_old_path() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    fakes[1].load_faults = [Outcome.FAILED]
    drive(core, fakes, core.request_load("p-v1", "/new", inplace=True, now=1.0), 1.0)
    settled = core.take_settlement("p-v1")
    assert settled is not None and not settled.ok
    assert core.adapter_state("p-v1") is AdapterState.LIVE
    assert [f.held["p-v1"] for f in fakes] == ["/r/p-v1", "/r/p-v1"]
    assert core.candidates("p-v1") == {0, 1}


# ------------------------------------------------------ unload and staleness


def test_unload_waits_for_in_flight_then_grace() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    assert core.request_started("p-v1", 0)
    actions = core.request_unload("p-v1", 10.0)
    assert [(a.replica, a.name) for a in actions] == [(1, "p-v1")]  # idle replica: at once
    assert core.candidates("p-v1") == frozenset()  # no longer routable
    assert not core.request_started("p-v1", 0)
    drive(core, fakes, actions, 10.0)
    assert core.tick(10.5) == []
    core.request_finished("p-v1", 0)
    due = core.tick(11.0)
    assert [(a.replica, a.name) for a in due] == [(0, "p-v1")]
    drive(core, fakes, due, 11.0)
    assert core.adapter_state("p-v1") is AdapterState.GONE
    assert core.known_name("p-v1")  # a second unload still answers 200


def test_requests_still_running_on_a_flapping_replica_drain_before_the_unload() -> None:
    """Found by the state machine: a retiring copy with a request in flight, on a replica
    that is marked down (so forgotten) and comes back, is re-adopted as a stray. A stray
    is unloaded at once -- but not while requests routed to it before still run."""
    core, fakes = make(2)
    publish(core, fakes, 1)
    assert core.request_started("p-v1", 0)
    drive(core, fakes, core.request_unload("p-v1", 10.0), 10.0)  # replica 1 unloads now
    drive(core, fakes, core.replica_lost(0, 11.0), 11.0)  # a probe blip, vLLM still runs
    assert core.adapter_state("p-v1") is AdapterState.GONE  # no copy left that we know
    assert core.observe(0, fakes[0].listing(), 12.0) == []  # back: the stray drains
    assert core.tick(16.99) == []
    assert [(a.replica, a.name) for a in core.tick(17.0)] == [(0, "p-v1")]  # grace: 12 + 5


def test_an_idle_stray_is_unloaded_at_once() -> None:
    core, fakes = make(1)
    fakes[0].held["p-v7"] = "/old/run/p-v7"  # left by an earlier run, nobody asked for it
    core.replica_lost(0, 1.0)
    assert [(a.replica, a.name) for a in core.observe(0, fakes[0].listing(), 1.0)] == [(0, "p-v7")]


def test_grace_timeout_forces_unload() -> None:
    core, fakes = make(1)
    publish(core, fakes, 1)
    core.request_started("p-v1", 0)
    assert core.request_unload("p-v1", 10.0) == []
    assert core.tick(14.99) == []
    assert [a.name for a in core.tick(15.0)] == ["p-v1"]


def test_window_keeps_newest_s_plus_one() -> None:
    core, fakes = make(2)
    now = 0.0
    for v in range(1, 6):
        now = publish(core, fakes, v, now)
    assert [a.name for a in core.live_adapters()] == ["p-v3", "p-v4", "p-v5"]
    assert all(set(f.held) == {"p-v3", "p-v4", "p-v5"} for f in fakes)
    assert core.counts["evict.stale"] == 2
    snap = core.snapshot()
    assert snap.live_versions == {"p": 3}
    assert [r.version_lag for r in snap.replicas] == [0, 0]


def test_a_narrower_window_set_live_evicts_at_once_and_a_wider_keeps_all() -> None:
    core, fakes = make(2)
    now = 0.0
    for v in range(1, 4):
        now = publish(core, fakes, v, now)
    assert core.set_max_staleness(3, now) == []  # wider: nothing leaves
    now = publish(core, fakes, 4, now)
    assert [a.name for a in core.live_adapters()] == ["p-v1", "p-v2", "p-v3", "p-v4"]
    now = drive(core, fakes, core.set_max_staleness(1, now), now)
    assert [a.name for a in core.live_adapters()] == ["p-v3", "p-v4"]
    assert all(set(f.held) == {"p-v3", "p-v4"} for f in fakes)
    assert core.policy.max_staleness == 1 and core.counts["evict.stale"] == 2


def test_fresh_run_restarting_at_v1_evicts_the_old_run() -> None:
    core, fakes = make(1)
    for v in (5, 6, 7):
        publish(core, fakes, v)
    publish(core, fakes, 1, 1.0)
    assert [a.name for a in core.live_adapters()] == ["p-v1"]
    assert set(fakes[0].held) == {"p-v1"}


def test_plain_names_are_never_evicted() -> None:
    core, fakes = make(1)
    drive(core, fakes, core.request_load("mine", "/m", inplace=False, now=0.0), 0.0)
    for v in range(1, 6):
        publish(core, fakes, v)
    assert "mine" in fakes[0].held
    assert core.candidates("mine") == {0}


def test_no_staleness_policy_keeps_everything() -> None:
    core, fakes = make(1, AdapterPolicy(max_staleness=None))
    for v in range(1, 6):
        publish(core, fakes, v)
    assert len(fakes[0].held) == 5


# ----------------------------------------------------------- reconciliation


def test_rejoining_replica_is_reconciled_before_admission() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    publish(core, fakes, 2)
    core.replica_lost(1, 1.0)
    assert core.candidates("p-v2") == {0}
    fakes[1].held = {"p-v2": "/elsewhere", "junk": "/j"}  # restarted, half-state
    actions: list[Action] = core.observe(1, fakes[1].listing(), 2.0)
    kinds = sorted((type(a).__name__, a.name) for a in actions)
    assert kinds == [
        ("LoadOnReplica", "p-v1"),
        ("LoadOnReplica", "p-v2"),
        ("UnloadOnReplica", "junk"),
    ]
    assert core.replica_state(1) is ReplicaState.SYNCING
    assert core.candidates("p-v2") == {0}  # not admitted while syncing
    drive(core, fakes, actions, 2.0)
    assert core.replica_state(1) is ReplicaState.UP
    assert fakes[1].held == {"p-v1": "/r/p-v1", "p-v2": "/r/p-v2"}
    assert core.candidates("p-v2") == {0, 1}


def test_replay_failure_keeps_replica_out() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    core.replica_lost(1, 1.0)
    fakes[1].held.clear()
    fakes[1].load_faults = [Outcome.FAILED]
    drive(core, fakes, core.observe(1, [], 2.0), 2.0)
    assert core.replica_state(1) is ReplicaState.SYNCING
    assert core.replica_settled(1)
    drive(core, fakes, core.observe(1, fakes[1].listing(), 3.0), 3.0)  # next health cycle
    assert core.replica_state(1) is ReplicaState.UP


def test_replica_joining_during_a_load_is_included() -> None:
    core, fakes = make(2)
    core.replica_lost(1, 0.0)
    actions = core.request_load("p-v1", "/r/p-v1", inplace=False, now=1.0)
    assert [a.replica for a in actions] == [0]
    join = core.observe(1, [], 1.5)  # nothing to replay yet: admitted, joins the load
    assert [(a.replica, a.name) for a in join] == [(1, "p-v1")]
    drive(core, fakes, actions + join, 2.0)
    assert core.candidates("p-v1") == {0, 1}


def test_rebuild_adopts_majority_path_and_replays() -> None:
    core = AdapterRegistry(POLICY, range(3))
    fakes = [
        FakeReplica({"p-v1": "/a", "p-v2": "/b"}),
        FakeReplica({"p-v1": "/a"}),
        FakeReplica({"p-v1": "/stale", "p-v2": "/b"}),
    ]
    listings = {r: f.listing() for r, f in enumerate(fakes)}
    drive(core, fakes, core.rebuild(listings, 0.0), 0.0)
    assert [(a.name, a.path) for a in core.live_adapters()] == [("p-v1", "/a"), ("p-v2", "/b")]
    assert all(f.held == {"p-v1": "/a", "p-v2": "/b"} for f in fakes)
    assert all(core.replica_state(r) is ReplicaState.UP for r in range(3))
    with pytest.raises(IllegalTransition):
        core.rebuild(listings, 1.0)


def test_rebuild_skips_unreachable_replicas() -> None:
    core = AdapterRegistry(POLICY, range(2))
    fakes = [FakeReplica({"p-v1": "/a"}), FakeReplica()]
    drive(core, fakes, core.rebuild({0: fakes[0].listing()}, 0.0), 0.0)
    assert core.replica_state(1) is ReplicaState.DOWN
    assert core.candidates("p-v1") == {0}


def test_unload_failure_demotes_replica() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    fakes[1].unload_faults = [Outcome.FAILED]
    drive(core, fakes, core.request_unload("p-v1", 1.0), 1.0)
    assert core.replica_state(1) is ReplicaState.SYNCING
    assert core.adapter_state("p-v1") is AdapterState.RETIRING
    assert core.tick(100.0) == []  # not retried blindly
    actions = core.observe(1, fakes[1].listing(), 100.0)
    assert [type(a) for a in actions] == [UnloadOnReplica]
    drive(core, fakes, actions, 100.0)
    assert core.adapter_state("p-v1") is AdapterState.GONE
    assert core.replica_state(1) is ReplicaState.UP


# ------------------------------------------------------------------ queries


def test_candidates_distinguishes_base_model_and_unknown() -> None:
    core = AdapterRegistry(POLICY, range(1))
    assert core.candidates("anything") is None  # base models not known yet
    core.set_base_models(["base"])
    assert core.candidates("base") is None
    assert core.candidates(None) is None
    assert core.candidates("p-v9") == frozenset()
    assert core.request_started("base", 0)  # not an adapter: not counted


def test_snapshot_reports_lag_and_counts() -> None:
    core, fakes = make(2)
    publish(core, fakes, 1)
    core.replica_lost(1, 0.0)
    publish(core, fakes, 2)
    fakes[1].held.pop("p-v2", None)
    snap = core.snapshot()
    assert {a.name: a.replicas for a in snap.adapters} == {"p-v1": (0,), "p-v2": (0,)}
    assert snap.counts["load.ok"] == 2
    assert [r.state for r in snap.replicas] == [ReplicaState.UP, ReplicaState.DOWN]
