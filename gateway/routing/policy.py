"""Routing policies: pick one replica for a routed request, and say why.

A policy's ``choose`` is a pure function of (request features, candidate snapshot, what the
policy has learned so far): no I/O, no clock, no mutation. Learning is split off into
``observe(decision)``, which the caller invokes right after acting on a decision (select,
then observe; cf. h11). The caller (``gateway/api/rollout.py``) filters candidates
(healthy, holding the adapter), records the decision's reason in metrics and tells the
pool about in-flight changes.

Policies (``make_router(name, config)``; one name -> class map, ``ROUTERS``):

* ``prefix`` (default, :class:`PrefixAffinityRouter`) -- see its docstring.
* ``least_loaded`` -- fewest in flight, lowest index on ties.
* ``round_robin`` -- ``candidates[counter % n]``; the counter advances in ``observe``, so
  ``choose`` stays pure (the one policy whose *observe* state is a plain counter).
* ``random`` -- uniform draw from a seeded RNG; the next draw is prepared in ``observe``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import CandidateLoads, Decision, Reason, ReplicaView, RouteRequest
from gateway.routing.fleet import FleetLoads
from gateway.routing.index import IndexStats, PrefixIndex
from gateway.routing.prefix import PromptKey, prompt_key
from gateway.routing.ring import HashRing

__all__ = [
    "ROUTERS",
    "CandidateLoads",
    "Decision",
    "LeastLoadedRouter",
    "PrefixAffinityRouter",
    "RandomRouter",
    "Reason",
    "ReplicaView",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "RoutingConfig",
    "make_router",
]


log = logging.getLogger(__name__)


class Router(Protocol):
    """One small interface for every policy (the SGLang gateway's ``LoadBalancingPolicy``)."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        """Pick one of ``candidates`` (never empty). Pure."""
        ...

    def observe(self, decision: Decision) -> None:
        """Learn from a decision the caller acted on (call once per routed request)."""
        ...

    def prefers(self, request: RouteRequest, candidates: Sequence[int]) -> int | None:
        """The candidate ``choose`` would pick were every candidate idle: where the
        request's prefix is cached, or will be. None: the policy has no preference. Read
        before a rollout waits for a slot (``runs/fairshare.py``), so that it waits for
        its own replica. Pure."""
        ...

    def set_members(self, members: Iterable[int]) -> None:
        """The configured replicas changed (discovery); healthy or not."""
        ...

    def forget_replica(self, replica: int) -> int:
        """The replica lost its KV cache (restart, reset): stop steering by it."""
        ...

    def stats(self) -> IndexStats | None:
        """The learned index's size, for metrics; None for policies that learn nothing."""
        ...

    def set_workers(self, n: int) -> None:
        """``n`` data-plane workers each run an instance; n > 1: decide alike (``fleet.py``)."""
        ...

    def set_fleet_loads(self, loads: Mapping[int, int]) -> None:
        """In flight per replica summed over all workers: one snapshot every ~50 ms."""
        ...


class _Stateless:
    """What a policy that keeps no per-replica state answers to membership, cache and
    worker news (each worker balances its own requests), and it prefers no replica."""

    def prefers(self, request: RouteRequest, candidates: Sequence[int]) -> int | None:
        return None

    def set_members(self, members: Iterable[int]) -> None:
        pass

    def forget_replica(self, replica: int) -> int:
        return 0

    def stats(self) -> IndexStats | None:
        return None

    def set_workers(self, n: int) -> None:
        pass

    def set_fleet_loads(self, loads: Mapping[int, int]) -> None:
        pass


class LeastLoadedRouter(_Stateless):
    """Fewest in-flight requests wins; ties go to the lowest index (deterministic)."""

    name = "least_loaded"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        pass

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        if isinstance(candidates, CandidateLoads):
            return Decision(_least_loaded(candidates.loads), Reason.FALLBACK)
        best = min(candidates, key=lambda c: (c.in_flight, c.index))
        return Decision(best.index, Reason.FALLBACK)

    def observe(self, decision: Decision) -> None:
        pass


class RoundRobinRouter(_Stateless):
    """``candidates[counter % n]``; ``observe`` advances the counter."""

    name = "round_robin"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self._counter = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        return Decision(candidates[self._counter % len(candidates)].index, Reason.FALLBACK)

    def observe(self, decision: Decision) -> None:
        self._counter += 1


class RandomRouter(_Stateless):
    """Uniform choice from a seeded RNG; ``observe`` draws the next number."""

    name = "random"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self._rng = random.Random((config or RoutingConfig()).seed)
        self._u = self._rng.random()

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        return Decision(candidates[int(self._u * len(candidates))].index, Reason.FALLBACK)

    def observe(self, decision: Decision) -> None:
        self._u = self._rng.random()


class PrefixAffinityRouter:
    """Deterministic prefix key on a bounded-load ring, refined by a learned leaf index.

    ``choose`` steps (K = ``max_blocks``, m = ``key_blocks``, n = candidates, L = their
    total in flight; ``bound = max(ceil((1 + eps)(L + 1) / n), min_load_bound)``):

    1. No key (malformed or empty prompt) -> least loaded, ``no_key``.
    2. ``t`` = template depth of the chain (``index.PrefixIndex``).
    3. Affinity: the deepest previously served leaf at depth >= t (a GRPO sibling or an
       earlier turn of this conversation). If its replica is a candidate and its load + 1 <=
       bound + ``affinity_slack`` -> ``affinity``; otherwise fall through with ``spill``.
    4. Ring: key = chain hash at depth ``min(len, t + m)`` when a template was detected
       (``t > 0``), else of the whole capped prompt -- a deterministic hash, so the *first*
       sample of a group lands where its siblings will, every gateway agrees, and a
       conversation keeps its home once it is m blocks past the template. Bounded-load
       lookup -> ``ring``, with ``moved_by_load`` when the walk passed the home (harmless:
       no replica holds this prefix yet); the home lacks the adapter ->
       ``adapter_constraint``; came from step 3 -> ``spill`` (it leaves the replica holding
       its prefix: the cost we count, as the blog proxy does).
    5. No candidate is on the ring (``set_members`` not called for it) -> least loaded,
       ``fallback``.

    The ring covers the whole pool and is rebuilt only by ``set_members`` (pool membership,
    off the hot path); health and adapter filtering just skip members clockwise.
    Complexity: O(K) hashing + O(K) dict probes + O(n) to read the candidate loads +
    O(log(N V)) ring search.

    With ``set_workers(n > 1)`` (``serve --workers N``: one instance per worker) new keys and
    verbatim repeats are bounded by the fleet table instead, keyed one block past the
    template, and the private index steers only continuations: :meth:`_choose_fleet`,
    ``fleet.py``.
    """

    name = "prefix"

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        cfg = self.config
        self.index = PrefixIndex(
            cfg.index_capacity,
            cfg.node_capacity,
            cfg.template_min_successors,
            cfg.template_capacity,
        )
        self._ring = HashRing((), cfg.virtual_nodes, cfg.ring_seed)
        self.workers = 1
        self.fleet = FleetLoads()

    def set_workers(self, n: int) -> None:
        """How many workers run an instance each; 1 (the default) is one process's router."""
        if n < 1:
            raise ValueError(f"routing: workers must be >= 1, got {n}")
        self.workers = n

    def set_fleet_loads(self, loads: Mapping[int, int]) -> None:
        """The fleet-wide snapshot (``fleet.FleetLoads``); read only with n > 1 workers."""
        self.fleet.update(loads)

    @property
    def ring(self) -> HashRing:
        return self._ring

    def set_members(self, members: Iterable[int]) -> None:
        """Rebuild the ring for the pool's replica indices (call on pool changes only)."""
        members = frozenset(members)
        if members != self._ring.members:
            t0 = time.perf_counter()
            self._ring = HashRing(members, self.config.virtual_nodes, self.config.ring_seed)
            log.debug(
                "routing ring rebuilt: %d replicas, %d points, %.1f ms",
                len(members),
                len(self._ring),
                (time.perf_counter() - t0) * 1e3,
            )

    def features(self, request: RouteRequest) -> PromptKey | None:
        return prompt_key(
            request.path, request.model, request.payload, request.session_key, self.config
        )

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        if self.workers > 1:
            return self._choose_fleet(request, candidates)
        key = self.features(request)
        if isinstance(candidates, CandidateLoads):
            loads, total = candidates.loads, candidates.total
        else:
            loads = {c.index: c.in_flight for c in candidates}
            total = sum(loads.values())
        if key is None:
            return Decision(_least_loaded(loads), Reason.NO_KEY)
        cfg = self.config
        bound = _load_bound(cfg.load_epsilon, total, len(loads), cfg.min_load_bound)
        hashes = key.hashes
        t = self.index.template_depth(hashes)
        spilled = False
        home = self.index.lookup(key, t)
        if home is not None and home in loads:
            if loads[home] + 1 <= bound + cfg.affinity_slack:
                return Decision(home, Reason.AFFINITY, key)
            spilled = True
        return self._ring_walk(request, key, t + cfg.key_blocks if t else 0, loads, bound,
                               home, spilled, loads)  # fmt: skip

    def _choose_fleet(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        """``choose`` with N > 1 workers: the same answer on every worker (``fleet.py``).

        One process's steps, with the loads read from the fleet snapshot and the ``fleet_*``
        bound floor, slack and key depth; except that a prompt this worker has served
        verbatim before (a GRPO sibling, a repeat in a later epoch) is placed like a new one,
        so its replica is a function of inputs every worker shares: key, candidates, config,
        snapshot. Only a prompt that extends an earlier one (a later turn; or any prompt
        capped at ``max_blocks``, where the two look alike) follows the index, within bound
        + ``fleet_affinity_slack``. Local loads decide only ``no_key`` and ``fallback``.
        """
        key = self.features(request)
        if isinstance(candidates, CandidateLoads):
            local: Mapping[int, int] = candidates.loads
        else:
            local = {c.index: c.in_flight for c in candidates}
        if key is None:
            return Decision(_least_loaded(local), Reason.NO_KEY)
        cfg = self.config
        loads, total = self.fleet.over(local)
        bound = _load_bound(cfg.load_epsilon, total, len(loads), cfg.fleet_min_load_bound)
        hashes = key.hashes
        t = self.index.template_depth(hashes)
        spilled = False
        # Served verbatim before: decided like a new key (the record only names the reason).
        home = self.index.exact(key) if len(hashes) < cfg.max_blocks else None
        verbatim = home is not None
        if not verbatim:
            home = self.index.lookup(key, t)
        if home is not None and home in loads:
            if not verbatim and loads[home] + 1 <= bound + cfg.fleet_affinity_slack:
                return Decision(home, Reason.AFFINITY, key)
            spilled = True
        return self._ring_walk(request, key, t + cfg.fleet_key_blocks if t else 0, loads, bound,
                               home, spilled, local)  # fmt: skip

    def prefers(self, request: RouteRequest, candidates: Sequence[int]) -> int | None:
        """``choose`` with no load bound: the leaf already served (a GRPO sibling, an earlier
        turn; in fleet mode a verbatim repeat is placed like a new key, as there), else the
        key's home on the ring, among ``candidates``."""
        key = self.features(request)
        if key is None:
            return None
        cfg = self.config
        hashes = key.hashes
        t = self.index.template_depth(hashes)
        fleet = self.workers > 1
        if not (fleet and len(hashes) < cfg.max_blocks and self.index.exact(key) is not None):
            home = self.index.lookup(key, t)
            if home is not None and home in candidates:
                return home
        depth = t + (cfg.fleet_key_blocks if fleet else cfg.key_blocks) if t else 0
        return self._ring.preferred(_ring_key(hashes, depth), dict.fromkeys(candidates, 0))

    def _ring_walk(
        self, request: RouteRequest, key: PromptKey, depth: int, loads: Mapping[int, int],
        bound: int, home: int | None, spilled: bool, fallback: Mapping[int, int],
    ) -> Decision:  # fmt: skip
        """The bounded-load ring walk from the key ``depth`` blocks deep, and its reason.

        Past a detected template: m blocks after it (stable as a conversation grows). No
        template known yet (``depth`` 0): the whole capped prompt, so an undetected shared
        prefix longer than m blocks cannot collapse every new prompt onto one key.
        ``fallback``: the loads the least-loaded fallback reads when the walk finds none."""
        ring_key = _ring_key(key.hashes, depth)
        choice = self._ring.lookup(ring_key, loads, bound, self.config.max_probes)
        if choice is None:
            return Decision(_least_loaded(fallback), Reason.FALLBACK, key)
        if spilled:
            reason = Reason.AFFINITY if choice.member == home else Reason.SPILL
            return Decision(choice.member, reason, key)
        if request.lacking_adapter:
            natural = self._ring.preferred(ring_key)
            if natural is not None and natural in request.lacking_adapter:
                return Decision(choice.member, Reason.ADAPTER_CONSTRAINT, key, choice.moved)
        return Decision(choice.member, Reason.RING, key, choice.moved)

    def observe(self, decision: Decision) -> None:
        """Record where the request went; call after ``choose``, before the next ``choose``.

        If a retry sends the request elsewhere, call again with the replica that served it.
        """
        if decision.key is not None:
            self.index.observe(decision.key, decision.replica)

    def forget_replica(self, replica: int) -> int:
        """The replica lost its KV cache (restart / reset): drop what it served."""
        return self.index.forget_replica(replica)

    def stats(self) -> IndexStats:
        return self.index.stats()


def _ring_key(hashes: Sequence[int], depth: int) -> int:
    """The chain hash the ring is searched with: ``depth`` blocks deep, or the whole
    capped prompt when no template is known (``depth`` 0)."""
    return hashes[min(len(hashes), depth) - 1 if depth else len(hashes) - 1]


def _load_bound(epsilon: float, total: int, members: int, floor: int) -> int:
    """The bounded-load cap: (1 + epsilon) x the mean load with this request, at least
    ``floor``."""
    return max(math.ceil((1.0 + epsilon) * (total + 1) / members), floor)


def _least_loaded(loads: Mapping[int, int]) -> int:
    return min(loads, key=lambda i: (loads[i], i))


ROUTERS: dict[
    str, type[PrefixAffinityRouter | LeastLoadedRouter | RoundRobinRouter | RandomRouter]
] = {
    "prefix": PrefixAffinityRouter,
    "least_loaded": LeastLoadedRouter,
    "round_robin": RoundRobinRouter,
    "random": RandomRouter,
}


def make_router(name: str, config: RoutingConfig | None = None) -> Router:
    """Build the policy called ``name`` (one construction path for every caller)."""
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose from {sorted(ROUTERS)}"
        ) from None
    return cls(config or RoutingConfig())
