"""The control snapshot a worker routes by: its wire form, what counts as a change, and
``SnapshotRoutes`` answering exactly as the owner's adapter registry does."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import MappingProxyType

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.adapters.state import AdapterRegistry, AdapterState, LoadOnReplica, ReplicaState
from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.workers.snapshot import ControlSnapshot, RunView, SnapshotRoutes, capture
from tests.adapters._fake import FakeReplica, drive
from tests.adapters.test_state import POLICY

# ------------------------------------------------------------------------ wire form


def wire(snapshot: ControlSnapshot) -> ControlSnapshot:
    """What a worker gets: through JSON bytes, as the channel sends it."""
    return ControlSnapshot.from_wire(orjson.loads(orjson.dumps(snapshot.to_wire())))


FULL = ControlSnapshot(
    epoch=41,
    healthy=frozenset({0, 2, 3}),
    runs=(
        RunView(
            name="run-a",
            homes=frozenset({0, 3}),
            unplaced=None,
            paused="mode=keep",
            adapters=MappingProxyType(
                {
                    "run-a~p-v1": frozenset({0, 3}),
                    "run-a~p-v2": frozenset(),
                    "run-a~näme ✓": frozenset({3}),
                }
            ),
            live=frozenset({"run-a~p-v1", "run-a~näme ✓"}),
            base_models=frozenset({"tiny-base", "other"}),
        ),
        RunView(name="run-b", unplaced="LoRA adapter slots exhausted: ..."),
    ),
    cache_resets=MappingProxyType({0: 2, 3: 1}),
)


@pytest.mark.parametrize(
    "snapshot",
    [
        FULL,
        ControlSnapshot(epoch=0, healthy=frozenset(), runs=()),
        ControlSnapshot(epoch=1, healthy=frozenset({1}), runs=(RunView(""),)),
    ],
    ids=["full", "empty", "single-run-default-view"],
)
def test_wire_round_trip(snapshot: ControlSnapshot) -> None:
    back = wire(snapshot)
    assert back == snapshot
    assert back.same_state(snapshot) and snapshot.same_state(back)
    assert wire(back).to_wire() == snapshot.to_wire()


def test_wire_form_is_plain_json_types() -> None:
    data = FULL.to_wire()
    assert orjson.loads(orjson.dumps(data)) == data  # nothing orjson would coerce
    assert data["healthy"] == [0, 2, 3]
    assert data["cache_resets"] == {"0": 2, "3": 1}
    assert data["runs"][0]["adapters"]["run-a~p-v1"] == [0, 3]


def test_what_a_worker_reads_is_read_only() -> None:
    back = wire(FULL)
    view = back.run("run-a")
    assert view is not None
    with pytest.raises(TypeError):
        view.adapters["run-a~p-v3"] = frozenset({0})  # type: ignore[index]
    with pytest.raises(TypeError):
        back.cache_resets[9] = 1  # type: ignore[index]
    assert isinstance(next(iter(back.cache_resets)), int)  # keys back as ints, not "0"


_names = st.text(min_size=0, max_size=8)
_replicas = st.frozensets(st.integers(0, 64), max_size=6)
_views = st.builds(
    RunView,
    name=_names,
    homes=_replicas,
    unplaced=st.none() | _names,
    paused=st.none() | st.sampled_from(["mode=keep", "mode=wait", "mode=abort&x=1"]),
    adapters=st.dictionaries(_names, _replicas, max_size=5).map(MappingProxyType),
    live=st.frozensets(_names, max_size=4),
    base_models=st.frozensets(_names, max_size=3),
)
_snapshots = st.builds(
    ControlSnapshot,
    epoch=st.integers(0, 2**53),
    healthy=_replicas,
    runs=st.lists(_views, max_size=3).map(tuple),
    cache_resets=st.dictionaries(st.integers(0, 64), st.integers(0, 1000)).map(MappingProxyType),
)


@settings(max_examples=150)
@given(_snapshots)
def test_wire_round_trip_any(snapshot: ControlSnapshot) -> None:
    assert wire(snapshot) == snapshot


# ---------------------------------------------------------------------- same_state


def test_same_state_ignores_only_the_epoch() -> None:
    later = ControlSnapshot(FULL.epoch + 5, FULL.healthy, FULL.runs, FULL.cache_resets)
    assert later.same_state(FULL) and FULL.same_state(later)
    assert not FULL.same_state(None)
    a, b = FULL.runs
    changed = [
        ControlSnapshot(FULL.epoch, frozenset({0, 2}), FULL.runs, FULL.cache_resets),
        ControlSnapshot(FULL.epoch, FULL.healthy, (a,), FULL.cache_resets),
        ControlSnapshot(FULL.epoch, FULL.healthy, (b, a), FULL.cache_resets),
        ControlSnapshot(FULL.epoch, FULL.healthy, FULL.runs, MappingProxyType({0: 3, 3: 1})),
        ControlSnapshot(FULL.epoch, FULL.healthy, FULL.runs),
    ]
    for field_change in [
        RunView(a.name, a.homes | {1}, a.unplaced, a.paused, a.adapters, a.live, a.base_models),
        RunView(a.name, a.homes, "why", a.paused, a.adapters, a.live, a.base_models),
        RunView(a.name, a.homes, a.unplaced, None, a.adapters, a.live, a.base_models),
        RunView(a.name, a.homes, a.unplaced, "mode=abort", a.adapters, a.live, a.base_models),
        RunView(a.name, a.homes, a.unplaced, a.paused,
                MappingProxyType({**a.adapters, "run-a~p-v2": frozenset({0})}),
                a.live, a.base_models),
        RunView(a.name, a.homes, a.unplaced, a.paused, a.adapters, a.live - {"run-a~p-v1"},
                a.base_models),
        RunView(a.name, a.homes, a.unplaced, a.paused, a.adapters, a.live, frozenset()),
    ]:  # fmt: skip
        changed.append(ControlSnapshot(FULL.epoch, FULL.healthy, (field_change, b)))
    for other in changed:
        assert not other.same_state(FULL), other
        assert not FULL.same_state(other), other


def test_run_by_name() -> None:
    assert FULL.run("run-b") is FULL.runs[1]
    assert FULL.run("nope") is None


# -------------------------------------------------- SnapshotRoutes == the registry


def registry(n: int = 3, bases: bool = True) -> tuple[AdapterRegistry, list[FakeReplica]]:
    core = AdapterRegistry(POLICY, range(n))
    if bases:
        core.set_base_models(["base"])
    fakes = [FakeReplica() for _ in range(n)]
    for r in range(n):
        drive(core, fakes, core.observe(r, [], 0.0), 0.0)
    return core, fakes


def load(core: AdapterRegistry, fakes: list[FakeReplica], name: str, now: float = 0.0) -> None:
    drive(core, fakes, core.request_load(name, f"/r/{name}", inplace=False, now=now), now)
    assert core.adapter_state(name) is AdapterState.LIVE


def routes_of(core: AdapterRegistry, through_wire: bool = True) -> SnapshotRoutes:
    adapters, live, bases, salts = core.routing_view()
    view = RunView("", adapters=MappingProxyType(adapters), live=live, base_models=bases,
                   salts=MappingProxyType(salts))  # fmt: skip
    if through_wire:
        view = RunView.from_wire(orjson.loads(orjson.dumps(view.to_wire())))
    return SnapshotRoutes(view, Counter())


EXTRA = [None, "base", "unknown-adapter", ""]


def assert_same_answers(core: AdapterRegistry, names: list[str | None]) -> None:
    for through_wire in (False, True):
        routes = routes_of(core, through_wire)
        for name in names:
            assert routes.candidates(name) == core.candidates(name), name
            if name is not None:
                assert routes.is_live(name) is core.is_live(name), name
                for r in range(3):
                    assert routes.salt(name, r) == core.salt(name, r), (name, r)


def test_live_loading_retiring_replacing_and_unknown_names() -> None:
    core, fakes = registry(3)
    load(core, fakes, "live")
    load(core, fakes, "retiring")
    load(core, fakes, "replacing")

    loading = core.request_load("loading", "/r/loading", inplace=False, now=1.0)
    first = loading[0]
    core.on_result(first, fakes[first.replica].perform(first), 1.0)  # one copy loaded
    assert core.adapter_state("loading") is AdapterState.LOADING

    assert core.request_started("retiring", 0)  # keeps its copy on 0 draining
    drive(core, fakes, core.request_unload("retiring", 2.0), 2.0)
    assert core.adapter_state("retiring") is AdapterState.RETIRING

    reload = core.request_load("replacing", "/new/replacing", inplace=True, now=3.0)
    assert all(isinstance(a, LoadOnReplica) for a in reload)
    core.on_result(reload[0], fakes[reload[0].replica].perform(reload[0]), 3.0)
    assert core.adapter_state("replacing") is AdapterState.REPLACING

    names: list[str | None] = ["live", "loading", "retiring", "replacing", *EXTRA]
    assert_same_answers(core, names)
    routes = routes_of(core)
    assert routes.candidates("live") == frozenset({0, 1, 2})
    assert routes.candidates("loading") == frozenset() and not routes.is_live("loading")
    assert routes.candidates("retiring") == frozenset() and not routes.is_live("retiring")
    assert routes.candidates("replacing") == frozenset({0, 1, 2}) and routes.is_live("replacing")
    assert routes.candidates("unknown-adapter") == frozenset()
    assert routes.candidates("base") is None and routes.candidates(None) is None

    core.replica_lost(2, 4.0)  # down: no adapter traffic there until reconciled
    assert core.replica_state(2) is ReplicaState.DOWN
    assert_same_answers(core, names)
    assert routes_of(core).candidates("live") == frozenset({0, 1})


def test_unknown_names_before_and_after_the_base_models_are_known() -> None:
    core, fakes = registry(2, bases=False)
    load(core, fakes, "mine")
    names: list[str | None] = ["mine", *EXTRA]
    assert_same_answers(core, names)
    assert routes_of(core).candidates("unknown-adapter") is None  # might be the base model
    core.set_base_models(["base"])
    assert_same_answers(core, names)
    assert routes_of(core).candidates("unknown-adapter") == frozenset()
    assert routes_of(core).candidates("base") is None


def test_a_name_gone_for_good_answers_like_the_registry() -> None:
    core, fakes = registry(2)
    load(core, fakes, "gone")
    drive(core, fakes, core.request_unload("gone", 1.0), 1.0)
    assert core.adapter_state("gone") is AdapterState.GONE
    assert_same_answers(core, ["gone", *EXTRA])


def test_request_counting_matches_the_registry() -> None:
    core, fakes = registry(2)
    load(core, fakes, "mine")
    counter: Counter[tuple[str, int]] = Counter()
    adapters, live, bases, _ = core.routing_view()
    routes = SnapshotRoutes(RunView("", adapters=adapters, live=live, base_models=bases), counter)
    steps: list[tuple[str, str, int]] = [
        ("start", "mine", 0),
        ("start", "mine", 0),
        ("start", "mine", 1),
        ("start", "mine", 5),  # not a candidate: refused, not counted
        ("start", "base", 1),  # not an adapter: allowed, not counted
        ("start", "unknown-adapter", 0),  # unknown with bases known: refused
        ("finish", "mine", 0),
        ("finish", "mine", 1),
    ]
    for op, name, replica in steps:
        if op == "start":
            assert routes.request_started(name, replica) is core.request_started(name, replica)
        else:
            routes.request_finished(name, replica)
            core.request_finished(name, replica)
        for r in (0, 1, 5):
            assert counter[("mine", r)] == core.in_flight("mine", r)
    assert dict(counter) == {("mine", 0): 1}
    assert not routes.request_started("mine", 5)


def test_the_count_outlives_a_snapshot_and_never_goes_negative() -> None:
    counter: Counter[tuple[str, int]] = Counter()
    first = SnapshotRoutes(RunView("", adapters={"a": frozenset({0, 1})}, live=frozenset({"a"})),
                           counter)  # fmt: skip
    assert first.request_started("a", 0) and first.request_started("a", 0)
    # The next snapshot retires "a": no new request, but the old ones still count.
    second = SnapshotRoutes(RunView("", adapters={"a": frozenset()}), counter)
    assert not second.request_started("a", 0)
    assert second.in_flight[("a", 0)] == 2
    second.request_finished("a", 0)
    second.request_finished("a", 0)
    second.request_finished("a", 0)  # one too many: stays at zero
    assert ("a", 0) not in counter and counter[("a", 0)] == 0


# --------------------------------------------------------- capture on a real Gateway


def gateway(**overrides: object) -> Gateway:
    replicas = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
    return build_gateway(load_settings({"replicas": replicas, **overrides}, environ={}))


def test_capture_single_run_follows_the_pool() -> None:
    gw = gateway()
    snap = capture(gw, 1)
    assert snap.epoch == 1 and snap.healthy == frozenset()  # nothing probed yet
    assert [r.name for r in snap.runs] == [""]
    assert snap.runs[0] == RunView("")

    for i in (0, 1, 2):
        gw.pool.admit(i)
    up = capture(gw, 2)
    assert up.healthy == {0, 1, 2}
    assert not up.same_state(snap)
    assert capture(gw, 3).same_state(up)  # nothing changed: nothing to publish

    gw.rotation.on_connect_failure(1, "connect")  # passive ejection: out of rotation
    down = capture(gw, 4)
    assert down.healthy == {0, 2}
    assert dict(down.cache_resets) == {1: 1}  # its prefix cache is forgotten
    assert wire(down) == down


def test_capture_single_run_adapters() -> None:
    gw = gateway()
    core = gw.adapters.core
    core.set_base_models(["base"])
    fakes = [FakeReplica() for _ in range(3)]
    for r in range(3):
        drive(core, fakes, core.observe(r, [], 0.0), 0.0)
        gw.pool.admit(r)
    load(core, fakes, "p-v1")
    core.request_load("p-v2", "/r/p-v2", inplace=False, now=1.0)  # still loading
    view = capture(gw, 1).runs[0]
    assert dict(view.adapters) == {"p-v1": {0, 1, 2}, "p-v2": frozenset()}
    assert view.live == {"p-v1"} and view.base_models == {"base"}
    routes = SnapshotRoutes(wire(capture(gw, 1)).runs[0], Counter())
    for name in ("p-v1", "p-v2", "base", "nope", None):
        assert routes.candidates(name) == gw.adapters.candidates(name)


def test_capture_multi_run_homes_pause_and_placement(tmp_path: Path) -> None:
    runs = []
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    gw = gateway(runs=runs)
    gw.tenancy.place(gw.pool.indices(), 3)  # 3 slots a replica, 3 a run
    gw.pool.admit(0)
    gw.pool.admit(2)
    gw.tenancy.tenants["run-b"].hold("mode=keep")

    snap = capture(gw, 7)
    assert [r.name for r in snap.runs] == ["run-a", "run-b"]
    for tenant in gw.tenancy:
        view = snap.run(tenant.name)
        assert view is not None
        assert view.homes == tenant.homes and view.homes
        assert view.unplaced is None
    a, b = snap.runs
    assert a.paused is None and b.paused == "mode=keep"
    assert a.homes.isdisjoint(b.homes)  # a replica's 3 slots hold one run
    assert snap.healthy == {0, 2}
    assert wire(snap) == snap

    gw.tenancy.tenants["run-b"].resume()
    resumed = capture(gw, 8)
    assert not resumed.same_state(snap)
    assert resumed.runs[1].paused is None

    gw.tenancy.place(gw.pool.indices(), 2)  # too small for any run
    unplaced = capture(gw, 9)
    for view in unplaced.runs:
        assert view.homes == frozenset()
        assert view.unplaced is not None and "slots exhausted" in view.unplaced


def test_the_feed_hands_the_router_each_new_fleet_table_once() -> None:
    from gateway.fleet.shared import SharedState
    from gateway.workers.worker import FleetLoadsFeed

    class Router:
        def __init__(self) -> None:
            self.tables: list[dict[int, int]] = []

        def set_fleet_loads(self, loads: dict[int, int]) -> None:
            self.tables.append(dict(loads))

    shared = SharedState(replicas=2, workers=2)
    router = Router()
    feed = FleetLoadsFeed(shared)
    feed.refresh(router)  # type: ignore[arg-type]
    feed.refresh(router)  # type: ignore[arg-type]
    assert router.tables == [{0: 0, 1: 0}]
    shared.publish_loads(1, [4, 1])
    shared.publish_fleet_loads()
    feed.refresh(router)  # type: ignore[arg-type]
    feed.refresh(router)  # type: ignore[arg-type]
    assert router.tables == [{0: 0, 1: 0}, {0: 4, 1: 1}]
