"""policy.py: a contract suite over every router, and the prefix router's branches."""

from __future__ import annotations

import random
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.policy import (
    ROUTERS,
    CandidateLoads,
    Decision,
    PrefixAffinityRouter,
    Reason,
    ReplicaView,
    Router,
    RouteRequest,
    RoutingConfig,
    make_router,
)

COMP = "/v1/completions"
SYSTEM = list(range(1000, 1300))  # a 300-token shared system prompt


def req(ids: object, **kw: object) -> RouteRequest:
    return RouteRequest(COMP, "trl-policy-v1", {"prompt": ids, **kw})


def views(loads: list[int]) -> list[ReplicaView]:
    return [ReplicaView(i, v) for i, v in enumerate(loads)]


def router(name: str, n: int = 4, **cfg: object) -> Router:
    r = make_router(name, RoutingConfig(**cfg))  # type: ignore[arg-type]
    r.set_members(range(n))
    return r


@pytest.fixture(params=sorted(ROUTERS))
def any_router(request: pytest.FixtureRequest) -> Router:
    return router(request.param)


def test_contract_choose_picks_a_candidate_and_is_pure(any_router: Router) -> None:
    cands = [ReplicaView(1, 3), ReplicaView(3, 0)]
    for payload in ([1, 2, 3], "text", None, [[1], [2]]):
        d1 = any_router.choose(req(payload), cands)
        d2 = any_router.choose(req(payload), cands)
        assert d1 == d2 and d1.replica in (1, 3)  # pure: same answer until observe
        any_router.observe(d1)
    d = any_router.choose(req([5] * 100), CandidateLoads(MappingProxyType({7: 1})))
    assert d.replica == 7


def test_contract_prefers_names_a_candidate_or_nothing(any_router: Router) -> None:
    for payload in ([1, 2, 3], [5] * 100, "text", None):
        p = any_router.prefers(req(payload), [1, 3])
        assert p is None or p in (1, 3)


@pytest.mark.parametrize("workers", [1, 2])
def test_prefers_is_where_choose_goes_when_every_candidate_is_idle(workers: int) -> None:
    r = PrefixAffinityRouter(RoutingConfig())
    r.set_members(range(4))
    r.set_workers(workers)
    idle = views([0, 0, 0, 0])
    rng = random.Random(3)
    for _ in range(50):
        prompt = SYSTEM + [rng.randrange(1, 30_000) for _ in range(rng.randrange(8, 80))]
        request = req(prompt)
        preferred = r.prefers(request, [0, 1, 2, 3])
        d = r.choose(request, idle)
        assert preferred == d.replica
        r.observe(d)
        assert r.prefers(request, [0, 1, 2, 3]) == d.replica  # a sibling: where it went
        others = [i for i in range(4) if i != d.replica]
        assert r.prefers(request, others) in others  # the home is not a candidate


def test_stateless_routers_prefer_nothing() -> None:
    for name in ("least_loaded", "round_robin", "random"):
        assert router(name).prefers(req([1, 2, 3] * 40), [0, 1]) is None


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("nope", RoutingConfig())


def test_round_robin_advances_only_on_observe() -> None:
    r = router("round_robin")
    seen = []
    for _ in range(4):
        d = r.choose(req([1]), views([0, 0]))
        seen.append(d.replica)
        r.observe(d)
    assert seen == [0, 1, 0, 1]


def test_grpo_group_lands_together_and_groups_spread() -> None:
    r = router("prefix", n=4)
    rng = random.Random(0)
    loads = [0, 0, 0, 0]
    homes = []
    for _ in range(64):
        prompt = SYSTEM + [rng.randrange(50_000) for _ in range(rng.randrange(20, 400))]
        chosen = set()
        for _ in range(8):
            d = r.choose(req(prompt), views(loads))
            r.observe(d)
            chosen.add(d.replica)
            loads[d.replica] += 1
        assert len(chosen) == 1
        homes.append(chosen.pop())
        for i in range(4):  # the group finishes
            loads[i] = 0
    assert len(set(homes)) == 4  # one system prompt does not collapse the groups


def test_first_sample_is_deterministic_across_instances() -> None:
    prompt = SYSTEM + list(range(77))
    a, b = router("prefix", n=8), router("prefix", n=8)
    assert a.choose(req(prompt), views([0] * 8)) == b.choose(req(prompt), views([0] * 8))


def test_multi_turn_continuation_keeps_replica() -> None:
    r = router("prefix", n=8)
    rng = random.Random(1)
    for _ in range(20):
        conv = SYSTEM + [rng.randrange(50_000) for _ in range(50)]
        d = r.choose(req(conv), views([0] * 8))
        r.observe(d)
        for _ in range(5):
            conv = conv + [rng.randrange(50_000) for _ in range(rng.randrange(30, 300))]
            d2 = r.choose(req(conv), views([0] * 8))
            r.observe(d2)
            assert d2.replica == d.replica and d2.reason is Reason.AFFINITY


def test_reasons_no_key_spill_fallback_adapter_constraint() -> None:
    r = router("prefix", n=4, min_load_bound=2, affinity_slack=0)
    empty = r.choose(req([]), views([3, 1, 2, 5]))
    assert (empty.replica, empty.reason) == (1, Reason.NO_KEY)  # no key: the least loaded
    assert r.choose(req([-1]), views([3, 1, 2, 5])).reason is Reason.NO_KEY
    prompt = list(range(500))
    d = r.choose(req(prompt), views([0, 0, 0, 0]))
    r.observe(d)
    assert d.reason is Reason.RING
    hot = [0, 0, 0, 0]
    hot[d.replica] = 50
    spill = r.choose(req(prompt), views(hot))
    assert spill.reason is Reason.SPILL and spill.replica != d.replica
    other = [ReplicaView(9, 0)]  # not on the ring
    assert r.choose(req(prompt), other).reason is Reason.FALLBACK
    fresh = router("prefix", n=4)
    home = fresh.choose(req(prompt), views([0] * 4)).replica
    cands = [v for v in views([0] * 4) if v.index != home]
    lacking = RouteRequest(
        COMP, "trl-policy-v1", {"prompt": prompt}, lacking_adapter=frozenset({home})
    )
    assert fresh.choose(lacking, cands).reason is Reason.ADAPTER_CONSTRAINT


def test_session_key_pins() -> None:
    r = router("prefix", n=8)
    a = r.choose(RouteRequest(COMP, "m", {"prompt": [1, 2]}, session_key="abc"), views([0] * 8))
    b = r.choose(RouteRequest(COMP, "m", {"prompt": [9] * 500, "user": "abc"}), views([0] * 8))
    assert a.replica == b.replica


@settings(max_examples=150, deadline=None)
@given(
    loads=st.lists(st.integers(0, 80), min_size=1, max_size=24),
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=700),
    eps=st.floats(0.05, 1.0),
)
def test_bounded_load_holds_for_new_keys(loads: list[int], prompt: list[int], eps: float) -> None:
    r = router("prefix", n=len(loads), load_epsilon=eps, min_load_bound=1)
    d = r.choose(req(prompt), views(loads))
    bound = max(-(-(1 + eps) * (sum(loads) + 1) // len(loads)), 1)
    if any(v + 1 <= bound for v in loads):
        assert loads[d.replica] + 1 <= bound


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_template_blocks_never_decide_affinity(seed: int) -> None:
    """Once a shared prefix is a template, a new prompt is never sent to a replica merely
    because it served that prefix: its choice equals a fresh router's whose index holds
    only the template knowledge."""
    rng = random.Random(seed)
    cfg = RoutingConfig(template_min_successors=4)
    r = PrefixAffinityRouter(cfg)
    r.set_members(range(8))
    shared = [rng.randrange(50_000) for _ in range(640)]  # exactly 10 whole blocks
    for _ in range(6):
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]
        d = r.choose(req(shared + tail), views([0] * 8))
        r.observe(d)
    probe = shared + [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]
    d = r.choose(req(probe), views([0] * 8))
    assert d.reason is Reason.RING
    assert r.index.template_depth(d.key.hashes if d.key else ()) >= 10


def test_decision_value_semantics() -> None:
    assert Decision(1, Reason.RING) == Decision(1, Reason.RING, None, False)
    assert Decision(1, Reason.RING) != Decision(1, Reason.RING, None, True)
    assert len({Decision(2, Reason.SPILL), Decision(2, Reason.SPILL)}) == 1
    assert "replica=2" in repr(Decision(2, Reason.SPILL))


def test_every_policy_answers_membership_and_cache_news(any_router: Router) -> None:
    """The interface app.py uses, with no isinstance: stateless policies learn nothing."""
    any_router.set_members(range(3))
    decision = any_router.choose(req(list(range(64))), views([0, 0, 0]))
    any_router.observe(decision)
    stats = any_router.stats()
    if any_router.name == "prefix":
        assert stats is not None and stats.served > 0
        assert any_router.forget_replica(decision.replica) > 0
    else:
        assert stats is None and any_router.forget_replica(decision.replica) == 0
