"""fleet.py and the prefix router's cross-worker mode (``set_workers(n > 1)``).

The property under test: N router instances with *different private histories* (what each
worker served, the templates each detected) pick the same replica for a GRPO group's
siblings when they are handed the same fleet snapshot; and ``set_workers(1)`` changes
nothing at all.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.fleet import FleetLoads
from gateway.routing.policy import (
    ROUTERS,
    CandidateLoads,
    Decision,
    PrefixAffinityRouter,
    Reason,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    make_router,
)

COMP = "/v1/completions"
SYSTEM = list(range(1000, 1300))  # a 300-token shared system prompt (4 whole blocks)
N = 8


def req(ids: list[int]) -> RouteRequest:
    return RouteRequest(COMP, "trl-policy-v1", {"prompt": ids})


def loads(values: list[int]) -> CandidateLoads:
    return CandidateLoads(MappingProxyType(dict(enumerate(values))))


def prefix_router(workers: int = 1, n: int = N, **cfg: object) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter(RoutingConfig(**cfg))  # type: ignore[arg-type]
    r.set_members(range(n))
    r.set_workers(workers)
    return r


def question(rng: random.Random, lo: int = 20, hi: int = 400) -> list[int]:
    return [rng.randrange(50_000) for _ in range(rng.randrange(lo, hi))]


def warm(r: PrefixAffinityRouter, seed: int, prompts: int = 80) -> None:
    """A private history: ``prompts`` GRPO prompts behind SYSTEM, served wherever this
    router put them under random local loads (and so the template SYSTEM is detected)."""
    rng = random.Random(seed)
    for _ in range(prompts):
        d = r.choose(req(SYSTEM + question(rng)), loads([rng.randrange(30) for _ in range(N)]))
        r.observe(Decision(rng.randrange(N), d.reason, d.key))  # even served elsewhere


def workers_with_histories(count: int, table: dict[int, int]) -> list[PrefixAffinityRouter]:
    routers = []
    for w in range(count):
        r = prefix_router(workers=count)
        warm(r, seed=100 + w)
        r.set_fleet_loads(table)
        routers.append(r)
    return routers


def test_every_policy_takes_the_worker_interface() -> None:
    for name in ROUTERS:
        r = make_router(name, RoutingConfig())
        r.set_workers(4)
        r.set_fleet_loads({0: 3, 1: 5})
        r.set_workers(1)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        prefix_router().set_workers(0)


def test_one_worker_decides_exactly_as_before() -> None:
    """``set_workers(1)`` and any fleet table: decision for decision the plain router."""
    plain = prefix_router()
    one = prefix_router(workers=8)
    one.set_fleet_loads({i: 100 * i for i in range(N)})  # ignored with one worker
    one.set_workers(1)  # and back: nothing of the fleet mode is left
    rng = random.Random(7)
    for g in range(150):
        prompt = SYSTEM + question(rng)
        turns = 3 if g % 5 == 0 else 1
        for _ in range(8):
            conv = list(prompt)
            for _ in range(turns):
                cands = loads([rng.randrange(40) for _ in range(N)])
                a, b = plain.choose(req(conv), cands), one.choose(req(conv), cands)
                assert a == b and a.key == b.key
                plain.observe(a)
                one.observe(b)
                conv += question(rng, 30, 200)
    assert plain.stats() == one.stats()


@pytest.mark.parametrize("hot", [False, True])
def test_siblings_agree_across_workers_with_different_histories(hot: bool) -> None:
    """8 workers, each with its own history; each new group's 8 samples go to random
    workers, each of which observes its decision: every group lands on one replica. With
    ``hot`` the fleet table has most replicas over the bound, so many first samples are
    moved off their ring home -- by the same walk on every worker."""
    # hot: total 540, bound ceil(1.15 * 541 / 8) = 78, so six of the eight are over it
    table = {i: (90 if i % 4 else 0) for i in range(N)} if hot else dict.fromkeys(range(N), 10)
    routers = workers_with_histories(8, table)
    rng = random.Random(3)
    moved = 0
    for _ in range(200):
        prompt = SYSTEM + question(rng)
        chosen = set()
        for _ in range(8):
            r = routers[rng.randrange(8)]
            d = r.choose(req(prompt), loads([rng.randrange(10) for _ in range(N)]))
            r.observe(d)
            chosen.add(d.replica)
            moved += d.moved_by_load
        assert len(chosen) == 1
    assert moved > 0 if hot else moved == 0


def test_a_repeat_goes_where_the_snapshot_says_whatever_each_worker_remembers() -> None:
    """Every worker has served the warm-up prompts, each on its own random replicas (the
    same prompts in an earlier epoch): a repeat's samples still agree on one replica."""
    table = {i: (90 if i % 4 else 0) for i in range(N)}  # some first samples are moved
    routers = workers_with_histories(8, table)
    rng = random.Random(100)  # warm()'s prompts of router 0, which the others saw too
    prompts = [SYSTEM + question(rng) for _ in range(80)]
    for r in routers[1:]:
        for p in prompts:
            d = r.choose(req(p), loads([0] * N))
            r.observe(Decision(rng.randrange(N), d.reason, d.key))  # records disagree
    pick = random.Random(5)
    for p in prompts:
        chosen = set()
        for _ in range(8):
            r = routers[pick.randrange(8)]
            d = r.choose(req(p), loads([pick.randrange(10) for _ in range(N)]))
            r.observe(d)
            chosen.add(d.replica)
        assert len(chosen) == 1


def test_a_record_names_the_reason_and_a_continuation_follows_it() -> None:
    """A verbatim repeat under a new snapshot goes where a worker without a record goes
    (``spill`` when that leaves the recorded replica); a later turn of a conversation this
    worker sent follows it (within bound + fleet slack), past that it spills there too."""
    a, b = prefix_router(workers=2), prefix_router(workers=2)
    for r in (a, b):
        r.set_fleet_loads(dict.fromkeys(range(N), 0))
    prompt = SYSTEM + list(range(5000, 5200))
    first = a.choose(req(prompt), loads([0] * N))
    a.observe(first)
    assert first.reason is Reason.RING
    home = first.replica
    again = a.choose(req(prompt), loads([0] * N))
    assert (again.replica, again.reason) == (home, Reason.AFFINITY)  # same snapshot: F
    cfg = a.config
    busy = {i: (cfg.fleet_min_load_bound + 4 if i == home else 0) for i in range(N)}
    for r in (a, b):
        r.set_fleet_loads(busy)  # the home is now over the bound, within bound + slack
    repeat, fresh = a.choose(req(prompt), loads([0] * N)), b.choose(req(prompt), loads([0] * N))
    assert fresh.replica != home and fresh.reason is Reason.RING and fresh.moved_by_load
    assert (repeat.replica, repeat.reason) == (fresh.replica, Reason.SPILL)
    turn = prompt + list(range(9000, 9100))
    follow, fresh = a.choose(req(turn), loads([0] * N)), b.choose(req(turn), loads([0] * N))
    assert (follow.replica, follow.reason) == (home, Reason.AFFINITY)
    assert fresh.replica != home and fresh.reason is Reason.RING
    hot = {i: (cfg.fleet_min_load_bound + cfg.fleet_affinity_slack if i == home else 0)
           for i in range(N)}  # fmt: skip
    for r in (a, b):
        r.set_fleet_loads(hot)
    spill, fresh = a.choose(req(turn), loads([0] * N)), b.choose(req(turn), loads([0] * N))
    assert spill.reason is Reason.SPILL and spill.replica == fresh.replica != home


def test_a_continuation_finds_its_replica_on_a_worker_that_never_saw_it() -> None:
    """The ring key is one block past the template, a block every later turn shares, so
    a worker with no record of the conversation still computes its replica."""
    routers = workers_with_histories(2, dict.fromkeys(range(N), 0))
    a, b = routers
    rng = random.Random(11)
    for _ in range(30):
        conv = SYSTEM + question(rng, 80, 300)  # turn 1 fills the block past the template
        d = a.choose(req(conv), loads([0] * N))
        a.observe(d)
        for _ in range(4):
            conv = conv + question(rng, 30, 300)
            later = b.choose(req(conv), loads([0] * N))  # b never saw this conversation
            assert later.replica == d.replica


def test_local_loads_decide_only_what_has_no_key() -> None:
    r = prefix_router(workers=4)
    r.set_fleet_loads(dict.fromkeys(range(N), 0))
    prompt = SYSTEM + list(range(7000, 7100))
    skewed = loads([50, 0, 50, 50, 50, 50, 50, 50])
    assert r.choose(req(prompt), skewed) == r.choose(req(prompt), loads([0] * N))
    empty = r.choose(req([]), skewed)
    assert (empty.replica, empty.reason) == (1, Reason.NO_KEY)
    outside = r.choose(req(prompt), [ReplicaView(9, 0)])  # no candidate on the ring
    assert (outside.replica, outside.reason) == (9, Reason.FALLBACK)


@settings(max_examples=150, deadline=None)
@given(
    fleet=st.lists(st.integers(0, 80), min_size=1, max_size=24),
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=700),
    drop=st.integers(0, 23),
)
def test_the_fleet_bound_holds_for_new_keys(fleet: list[int], prompt: list[int], drop: int) -> None:
    """A new key never goes over the fleet bound while a candidate is under it, also
    when the candidates are a subset of the table (a replica ejected or lacking the
    adapter): the bound is over the candidates' share of the table."""
    r = prefix_router(workers=2, n=len(fleet), fleet_min_load_bound=1)
    r.set_fleet_loads(dict(enumerate(fleet)))
    cands = [ReplicaView(i, 0) for i in range(len(fleet)) if i != drop or len(fleet) == 1]
    d = r.choose(req(prompt), cands)
    seen = [fleet[c.index] for c in cands]
    eps = r.config.load_epsilon
    bound = max(-(-(1 + eps) * (sum(seen) + 1) // len(seen)), 1)
    if any(v + 1 <= bound for v in seen):
        assert fleet[d.replica] + 1 <= bound


def test_fleet_loads_table() -> None:
    f = FleetLoads()
    assert f.over({0: 5, 1: 7}) == ({0: 0, 1: 0}, 0)  # nothing published yet: zeros
    source = {0: 3, 1: 4, 2: -1}
    f.update(source)
    source[0] = 99  # copied: the caller may reuse its mapping
    assert (f.loads, f.total) == ({0: 3, 1: 4, 2: 0}, 7)
    view, total = f.over(MappingProxyType({0: 1, 1: 1, 2: 1}))
    assert view is f.loads and total == 7  # the same replicas: no copy
    assert f.over({1: 0, 5: 0}) == ({1: 4, 5: 0}, 4)  # a subset, and one it never saw
