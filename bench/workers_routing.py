"""Routing drift with N data-plane workers (issue 19): N routers, each with local loads.

Usage: ``python bench/workers_routing.py [--replicas 8] [--out bench/results]``

Why. ``serve --workers N`` runs N processes, each with its own router (``make_router("prefix",
RoutingConfig())``, as ``gateway/app.py`` builds it), so bounded load reads *that worker's*
in-flight counts, and the learned prefix index (GRPO sibling / continuation affinity,
template detection) is per worker too. This measures how far that drifts from one
process's decisions, in ``bench/routing.py``'s simulation, at N = 1, 2, 8 workers.

How. ``bench/routing.py``'s ``Workload``, ``simulate`` and ``summarize`` run unchanged
(same workloads, caches, service times, client slots; N=1 reproduces its ``prefix``
policy exactly). The router handed to ``simulate`` is a :class:`WorkerPool`: N real
``PrefixAffinityRouter`` instances. Each request lands on a uniformly random worker
(seeded ``random.Random``): a model of the kernel spreading TRL's keep-alive connections
over ``SO_REUSEPORT`` sockets, per request, so a group's 8 samples meet up to 8 different
workers. The chosen worker decides with ``CandidateLoads`` of *its own* requests in flight
per replica, and only it ``observe``s the decision. ``simulate`` keeps completions in a
heap; a tap on that heap (``_heap_tap``: ``bench.routing``'s ``heapq`` swapped for the
call) tells the pool when each request finishes, so the worker that sent it decrements its
count.

Three index variants per N > 1: ``local`` (the per-worker routers, nothing shared),
``shared-templates`` (counterfactual: workers share the template set only, so every ring
key agrees; served prompts stay local) and ``shared`` (counterfactual: one index for all
workers, loads still local). ``local - shared`` is the cost of not sharing the index;
``shared - N=1`` is the cost of local loads alone.

The fix, ``fleet-*``: every router gets ``set_workers(N)`` and is fed the fleet-wide
in-flight counts through ``set_fleet_loads`` (``gateway/routing/fleet.py``), in four models
of the wiring (:class:`_Tables`): one 50 ms snapshot for all workers, the same published a
period late (50-100 ms old), and two stress cases, live counts and each worker sampling
on its own 50 ms timer. Simulated time comes from the heap tap (a completion's time).

The index question is measured directly too (``replay``): before each real decision the
request is replayed to *every* worker's router with equal (zero) loads, and we count how
often the workers would pick different replicas, split by cause: their template sets
give different ring keys (the ring key is the chain hash ``key_blocks`` past the template
when one is known, else the whole capped prompt), or some worker remembers the prompt
(affinity) on a replica other than the ring's.

Sizing: 96 groups per replica (4x ``bench/routing.py``'s 24, so template warm-up is a
small part of the run), workloads a, c (single-turn GRPO) and b (multi-turn), 3 worker-
assignment seeds per N > 1 (the table shows their mean; the JSON keeps each). Runs in
about four minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script this is already the case
    sys.path.insert(0, str(HERE))

import routing as sim  # noqa: E402  (bench/routing.py; it puts the repo root on sys.path)

from bench.lib.report import pyplot  # noqa: E402
from gateway.routing.config import RoutingConfig  # noqa: E402
from gateway.routing.fleet import FleetLoads  # noqa: E402
from gateway.routing.index import IndexStats, PrefixIndex  # noqa: E402
from gateway.routing.policy import (  # noqa: E402
    CandidateLoads,
    Decision,
    PrefixAffinityRouter,
    Reason,
    ReplicaView,
    RouteRequest,
    make_router,
)

WORKERS = (1, 2, 8)
# How ``set_fleet_loads`` is fed in the ``fleet-*`` variants (``set_workers(N)``): see _Tables.
TABLES = ("50ms", "50ms-late", "live", "own-timer")
FLEET = tuple(f"fleet-{t}" for t in TABLES)
# Counterfactual: as fleet-50ms, but a prompt a worker served verbatim before follows that
# worker's record, as one process does (what the fleet mode deliberately does not do).
FOLLOW = "fleet-50ms-follow"
VARIANTS = ("local", "shared-templates", "shared", *FLEET, FOLLOW)
REFRESH_S = 0.050  # the interface's refresh period, in simulated seconds
ARRIVAL_SPREAD_S = 0.003  # a request reads the table as of its arrival, up to 3 ms later
WORKLOADS = ("a", "c", "b", "e")
EPOCHS = 4  # (e): (a)'s first 1/EPOCHS of groups, sent EPOCHS times over
GROUPS_PER_REPLICA = 96
MULTI_TURN_GROUPS_PER_REPLICA = 32
SEEDS = (1, 2, 3)
# ``--set name=value``: RoutingConfig fields for every router of every pool (to measure a
# knob; the committed results use the defaults).
OVERRIDES: dict[str, Any] = {}


class _RecordFollowingIndex(PrefixIndex):
    """``exact`` never answers, so ``_choose_fleet`` sends a verbatim repeat through
    ``lookup`` and follows this worker's record (the ``FOLLOW`` counterfactual)."""

    __slots__ = ()

    def exact(self, key: Any) -> int | None:
        return None


class WorkerPool:
    """N workers' prefix routers behind the one ``Router`` face ``sim.simulate`` expects.

    ``choose`` draws the worker for the request (the sim calls it exactly once per request),
    ``observe`` teaches only that worker; ``dispatched``/``completed`` (from the heap tap)
    keep each worker's own in-flight count per replica.
    """

    name = "prefix-workers"

    def __init__(
        self, workers: int, replicas: int, seed: int, variant: str, replay: bool = True
    ) -> None:
        self.routers: list[PrefixAffinityRouter] = []
        fleet = variant.startswith("fleet-")
        for _ in range(workers):
            r = make_router("prefix", RoutingConfig(**OVERRIDES))
            assert isinstance(r, PrefixAffinityRouter)
            r.set_members(range(replicas))
            if fleet:
                r.set_workers(workers)  # 1 worker: must change nothing (asserted in run)
            if variant == FOLLOW:
                r.index.__class__ = _RecordFollowingIndex
            self.routers.append(r)
        first = self.routers[0].index
        for r in self.routers[1:]:
            if variant == "shared":
                r.index = first
            elif variant == "shared-templates":
                # Counterfactual only: the template set is private state of PrefixIndex.
                r.index._templates = first._templates
        cfg = self.routers[0].config
        self.fleet = fleet and workers > 1
        self.key_blocks = cfg.fleet_key_blocks if self.fleet else cfg.key_blocks
        model = variant.removeprefix("fleet-").removesuffix("-follow")
        self.tables = _Tables(model, workers, replicas, seed) if fleet else None
        self._fed: list[dict[int, int] | None] = [None] * workers
        self.local = [dict.fromkeys(range(replicas), 0) for _ in range(workers)]
        self.views = [MappingProxyType(d) for d in self.local]
        self.totals = [0] * workers
        self.rng = random.Random(seed)
        self.replay = replay and workers > 1
        self._worker = 0
        self._pending: tuple[int, int] | None = None
        self._inflight: dict[int, tuple[int, int]] = {}
        # measurements
        self.per_worker = Counter[int]()
        self.ring_total = 0
        self.ring_key_from_template = 0  # ring decisions whose key depth the template set
        self.replays = 0
        self.disagree = Counter[str]()

    # -- Router protocol ---------------------------------------------------------------

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision:
        w = self.rng.randrange(len(self.routers)) if len(self.routers) > 1 else 0
        self._worker = w
        assert isinstance(candidates, CandidateLoads)
        mine = self.local[w]
        if candidates.loads.keys() == mine.keys():
            view: CandidateLoads = CandidateLoads(self.views[w], self.totals[w])
        else:  # a replica left: same candidate set, this worker's counts
            view = CandidateLoads({r: mine[r] for r in candidates.loads})
        table = None
        if self.tables is not None:
            table = self.tables.for_worker(w)
            if table is not self._fed[w] or self.tables.model == "live":
                self.routers[w].set_fleet_loads(table)  # a refresh (live: every decision)
                self._fed[w] = table
        if self.replay:
            self._replay(request, candidates, table)
        return self.routers[w].choose(request, view)

    def observe(self, decision: Decision) -> None:
        w = self._worker
        router = self.routers[w]
        self.per_worker[w] += 1
        if decision.reason is Reason.RING and decision.key is not None:
            self.ring_total += 1
            hashes = decision.key.hashes
            t = router.index.template_depth(hashes)
            self.ring_key_from_template += bool(t) and t + self.key_blocks < len(hashes)
        router.observe(decision)
        self._pending = (w, decision.replica)

    def set_members(self, members: Iterable[int]) -> None:
        for r in self.routers:
            r.set_members(members)

    def forget_replica(self, replica: int) -> int:
        return sum(r.forget_replica(replica) for r in self.routers)

    def stats(self) -> IndexStats | None:
        return self.routers[0].stats()

    # -- the heap tap --------------------------------------------------------------------

    def dispatched(self, seq: int) -> None:
        assert self._pending is not None
        w, r = self._pending
        self._pending = None
        self.local[w][r] += 1
        self.totals[w] += 1
        self._inflight[seq] = (w, r)
        if self.tables is not None:
            self.tables.live[r] += 1

    def completed(self, seq: int, at: float) -> None:
        if self.tables is not None:
            self.tables.tick(at)  # snapshots due by now are taken before this completion
        w, r = self._inflight.pop(seq)
        self.local[w][r] -= 1
        self.totals[w] -= 1
        if self.tables is not None:
            self.tables.live[r] -= 1

    # -- the index question --------------------------------------------------------------

    def _replay(
        self, request: RouteRequest, candidates: CandidateLoads, table: dict[int, int] | None
    ) -> None:
        """Would the workers, as they stand, agree on this request at equal loads? (Fleet
        mode: every worker given the deciding worker's snapshot, so only what each learned
        privately -- its template set, its index -- can make them differ.)"""
        zero = CandidateLoads(dict.fromkeys(candidates.loads, 0), 0)
        shared = None
        if table is not None:
            shared = FleetLoads()
            shared.update(table)
        picks, depths, affinity = set(), set(), set()
        for router in self.routers:
            if shared is not None:
                own, router.fleet = router.fleet, shared
                d = router.choose(request, zero)
                router.fleet = own
            else:
                d = router.choose(request, zero)
            picks.add(d.replica)
            if d.key is None:
                continue
            hashes = d.key.hashes
            t = router.index.template_depth(hashes)
            depths.add(min(len(hashes), t + self.key_blocks) if t else len(hashes))
            if d.reason is Reason.AFFINITY:
                affinity.add(d.replica)
        self.replays += 1
        if len(picks) == 1:
            return
        self.disagree["any"] += 1
        self.disagree["ring_key" if len(depths) > 1 else "affinity"] += 1


class _Tables:
    """The fleet table each worker is handed, in one of four models of the wiring.

    ``live``: the exact fleet-wide counts at every decision (no staleness at all).
    ``50ms``: one snapshot of the counts every 50 ms of simulated time, the same for every
    worker (0-50 ms old). ``50ms-late``: those snapshots published one period late (50-100
    ms old: the interface's "up to ~100 ms stale"). ``own-timer``: each worker takes its own
    snapshot every 50 ms, worker w at phase w/N of the period (workers sampling shared
    counters on their own timers). In the snapshot models a request reads the table as of
    its arrival, up to ``ARRIVAL_SPREAD_S`` after the sim's send time (the sim sends a
    group's 8 samples at one instant; real ones spread over a few ms), so some groups
    straddle a refresh. Snapshots are taken at the first event at or after each boundary,
    before that event changes the counts: the state at the boundary.
    """

    def __init__(self, model: str, workers: int, replicas: int, seed: int) -> None:
        assert model in TABLES, model
        self.model = model
        self.live = dict.fromkeys(range(replicas), 0)
        own = model == "own-timer"
        self.phases = [w * REFRESH_S / workers for w in range(workers)] if own else [0.0]
        self.next_epoch = [0] * len(self.phases)
        self.snaps: dict[tuple[int, int], dict[int, int]] = {}
        self.rng = random.Random(seed + 7919)  # apart from the worker draw: same workers
        self.now = 0.0
        self.tick(0.0)

    def tick(self, now: float) -> None:
        self.now = now
        if self.model == "live":
            return
        for g, phase in enumerate(self.phases):
            while phase + self.next_epoch[g] * REFRESH_S <= now:
                e = self.next_epoch[g]
                self.snaps.setdefault((g, e), dict(self.live))
                self.snaps.pop((g, e - 4), None)
                self.next_epoch[g] += 1

    def for_worker(self, w: int) -> dict[int, int]:
        if self.model == "live":
            return self.live
        g = w if self.model == "own-timer" else 0
        at = self.now + self.rng.uniform(0.0, ARRIVAL_SPREAD_S)
        e = math.floor((at - self.phases[g]) / REFRESH_S) - (self.model == "50ms-late")
        snap = self.snaps.get((g, e))
        if snap is None:  # past the last boundary ticked (the spread crossed one): now
            snap = dict(self.live) if e >= 0 else dict.fromkeys(self.live, 0)
            self.snaps[(g, e)] = snap
        return snap


class _HeapTap:
    """Stands in for ``heapq`` inside ``sim.simulate``: reports pushes and pops by seq."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def heappush(self, heap: list[Any], item: Any) -> None:
        self.pool.dispatched(item[1])  # item = (t_done, seq, replica, traj, turn, tid)
        heapq.heappush(heap, item)

    def heappop(self, heap: list[Any]) -> Any:
        item = heapq.heappop(heap)
        self.pool.completed(item[1], item[0])
        return item


@contextmanager
def _heap_tap(pool: WorkerPool) -> Iterator[None]:
    module: ModuleType = sim
    saved = vars(module)["heapq"]
    vars(module)["heapq"] = _HeapTap(pool)
    try:
        yield
    finally:
        vars(module)["heapq"] = saved


# -- runs ---------------------------------------------------------------------------------


def group_stats(res: sim.RunResult) -> dict[str, float]:
    groups = list(res.group_replicas.values())
    whole = sum(len(c) == 1 for c in groups) / max(1, len(groups))
    # Past the template warm-up: groups after the first quarter of the run (by group id).
    cut = (max(res.group_replicas, default=0) + 1) // 4
    late = [c for g, c in res.group_replicas.items() if g >= cut]
    whole_late = sum(len(c) == 1 for c in late) / max(1, len(late))
    spread = statistics.mean(len(c) for c in groups) if groups else 0.0
    peaks = [p for p in res.peak if p > 0] or [1]
    return {
        "groups_whole": round(whole, 4),
        "groups_whole_after_warmup": round(whole_late, 4),
        "replicas_per_group": round(spread, 4),
        "peak_max_over_mean": round(max(peaks) / statistics.mean(peaks), 3),
    }


def run_one(
    wl: str,
    groups: sim.Workload,
    replicas: int,
    workers: int,
    variant: str,
    seed: int,
    o_hit: float,
) -> dict[str, Any]:
    # Replay (the most expensive part at 8 workers) only the real configurations: with one
    # shared index every worker has the same state and ring, so a replay at equal loads
    # agrees by construction, and with a shared template set the ring keys do. Of the
    # fleet variants, the one with shared 50 ms snapshots (the others differ only in
    # what table each worker is handed, which the replay equalises anyway).
    pool = WorkerPool(workers, replicas, seed, variant, replay=variant in REPLAYED)
    slots = 4 * replicas if wl != "b" else max(2, replicas)
    t0 = time.perf_counter()
    with _heap_tap(pool):
        res = sim.simulate(pool, groups, replicas, slots)
    assert not pool._inflight and not any(pool.totals), "every request completed"
    s = sim.summarize(res, o_hit)
    for k in ("route_us_p50", "route_us_p99"):  # includes the replay: not a decision cost
        s.pop(k)
    n_req = s["requests"]
    return (
        s
        | group_stats(res)
        | {
            "index_decisions": round(s["reasons"].get("affinity", 0) / n_req, 4),
            "ring_decisions": round(s["reasons"].get("ring", 0) / n_req, 4),
            "ring_key_set_by_template": round(pool.ring_key_from_template / max(1, n_req), 4),
            "replay_requests": pool.replays,
            **{
                f"replay_disagree{suffix}": round(pool.disagree[cause] / pool.replays, 4)
                if pool.replays
                else (0.0 if workers == 1 else None)
                for suffix, cause in (
                    ("", "any"),
                    ("_ring_key", "ring_key"),
                    ("_affinity", "affinity"),
                )
            },
            "requests_per_worker_max_over_mean": round(
                max(pool.per_worker.values()) / statistics.mean(pool.per_worker.values()), 3
            ),
            "sim_s": round(time.perf_counter() - t0, 2),
        }
    )


REPLAYED = ("local", "fleet-50ms")

MEAN_KEYS = (
    "hit_rate",
    "hit_vs_oracle",
    "colocation",
    "groups_whole",
    "groups_whole_after_warmup",
    "replicas_per_group",
    "continuation_same_replica",
    "spill",
    "new_key_moved_by_load",
    "inflight_max_over_mean",
    "served_max_over_mean",
    "peak_inflight_max",
    "peak_max_over_mean",
    "index_decisions",
    "ring_decisions",
    "ring_key_set_by_template",
    "replay_disagree",
    "replay_disagree_ring_key",
    "replay_disagree_affinity",
)


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in MEAN_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = round(statistics.mean(xs), 4) if xs else None
    out["reasons"] = {
        k: round(statistics.mean(r["reasons"].get(k, 0) for r in runs) / runs[0]["requests"], 4)
        for k in sorted({k for r in runs for k in r["reasons"]})
    }
    return out


class Epochs(sim.Workload):
    """(e): (a)'s prompts, each sent again in every one of ``EPOCHS`` epochs (a small
    dataset trained for several epochs): group g has group g % (groups / EPOCHS)'s prompt,
    so every worker that saw a prompt before holds a record of where *it* sent it."""

    def __init__(self, groups: int, seed: int) -> None:
        super().__init__("a", groups, seed)
        self.distinct = max(1, groups // EPOCHS)

    def group(self, g: int) -> list[sim.Trajectory]:
        return [dataclasses.replace(t, group=g) for t in super().group(g % self.distinct)]


def workload(wl: str, replicas: int) -> sim.Workload:
    per = MULTI_TURN_GROUPS_PER_REPLICA if wl == "b" else GROUPS_PER_REPLICA
    seed = replicas * 31 + ord(wl if wl != "e" else "a")
    return Epochs(per * replicas, seed) if wl == "e" else sim.Workload(wl, per * replicas, seed)


def template_exposure(groups: sim.Workload, replicas: int) -> dict[str, Any]:
    """Of the workload's prompts, how many have a ring key that depends on template
    knowledge (more than ``key_blocks`` blocks past the template), once it is known."""
    r = make_router("prefix", RoutingConfig())
    assert isinstance(r, PrefixAffinityRouter)
    r.set_members(range(replicas))
    zero = CandidateLoads(dict.fromkeys(range(replicas), 0), 0)
    reqs = []
    for g in range(len(groups)):
        traj = groups.group(g)[0]
        req = RouteRequest("/v1/completions", sim.MODEL, {"prompt": traj.prompt(0)})
        reqs.append(req)
        r.observe(r.choose(req, zero))  # learn the templates as one process would
    exposed = 0
    t_seen: Counter[int] = Counter()
    for req in reqs:
        key = r.features(req)
        assert key is not None
        t = r.index.template_depth(key.hashes)
        t_seen[t] += 1
        exposed += bool(t) and t + r.config.key_blocks < len(key.hashes)
    return {
        "prompts": len(reqs),
        "template_depths": dict(sorted(t_seen.items())),
        "ring_key_depends_on_templates": round(exposed / len(reqs), 4),
    }


def run(replicas: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "replicas": replicas,
        "workers": list(WORKERS),
        "seeds": list(SEEDS),
        "groups_per_replica": {"a/c": GROUPS_PER_REPLICA, "b": MULTI_TURN_GROUPS_PER_REPLICA},
        "assignment": "each request to a uniformly random worker (random.Random(seed))",
        "runs": {},
        "exposure": {},
    }
    for wl in WORKLOADS:
        groups = workload(wl, replicas)
        slots = 4 * replicas if wl != "b" else max(2, replicas)
        oracle = sim.simulate(
            sim.make_policy("oracle", 1), groups, 1, slots, cache_blocks=4096 * replicas
        )
        o_hit = oracle.hits / max(1, oracle.queries)
        base = sim.simulate(sim.make_policy("prefix", replicas), groups, replicas, slots)
        rows: dict[str, Any] = {"oracle_hit_rate": round(o_hit, 4), "groups": len(groups)}
        for n in WORKERS:
            for variant in VARIANTS if n > 1 else ("local",):
                seeds = SEEDS if n > 1 else (0,)
                per_seed = [run_one(wl, groups, replicas, n, variant, s, o_hit) for s in seeds]
                if n == 1:  # the pool of one is bench/routing.py's prefix policy, exactly
                    assert per_seed[0]["reasons"] == dict(base.reasons)
                    assert per_seed[0]["hit_rate"] == sim.summarize(base, o_hit)["hit_rate"]
                    # ... and so is it after set_workers(1), fed a fleet table it must ignore
                    one = run_one(wl, groups, replicas, 1, "fleet-50ms", 0, o_hit)
                    for k in ("reasons", "hit_rate", "served_max_over_mean", "colocation"):
                        assert one[k] == per_seed[0][k], k
                rows[f"{n}/{variant}"] = {"mean": mean_of(per_seed), "per_seed": per_seed}
                m = rows[f"{n}/{variant}"]["mean"]
                print(
                    f"{wl} workers={n} {variant} ({time.perf_counter() - T0:.0f}s): "
                    f"coloc {m['colocation']} whole {m['groups_whole']} "
                    f"inflight {m['inflight_max_over_mean']} peak {m['peak_inflight_max']} "
                    f"replay-disagree {m['replay_disagree']}",
                    flush=True,
                )
        out["runs"][wl] = rows
        out["exposure"][wl] = template_exposure(groups, replicas)
    return out


# -- reporting ----------------------------------------------------------------------------


def _d(x: float | None, ref: float | None, pct: bool = False) -> str:
    if x is None or ref is None:
        return ""
    diff = x - ref
    return f"{diff * 100:+.2f} pp" if pct else f"{diff:+.3f}"


def _replay(m: dict[str, Any]) -> str:
    if m["replay_disagree"] is None:
        return "not replayed"
    return (
        f"{m['replay_disagree']:.2%} ({m['replay_disagree_ring_key']:.2%}/"
        f"{m['replay_disagree_affinity']:.2%})"
    )


def table_lines(data: dict[str, Any]) -> list[str]:
    lines = [
        "| workload | workers | index | co-location | Δ | groups on one replica | Δ "
        "| continuation | in-flight max/mean (time avg) | Δ | peak in-flight max "
        "(max/mean) | served max/mean | hit vs oracle | reasons ring/affinity/spill "
        "| replay disagree (ring key/affinity) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl, rows in data["runs"].items():
        ref = rows["1/local"]["mean"]
        for key, row in rows.items():
            if "/" not in key:
                continue
            n, variant = key.split("/")
            m = row["mean"]
            rs = m["reasons"]
            cont = m["continuation_same_replica"]
            lines.append(
                f"| {wl} | {n} | {variant} | {m['colocation']:.2%} | "
                f"{_d(m['colocation'], ref['colocation'], True)} | {m['groups_whole']:.2%} | "
                f"{_d(m['groups_whole'], ref['groups_whole'], True)} | "
                f"{'' if cont is None else format(cont, '.2%')} | "
                f"{m['inflight_max_over_mean']:.3f} | "
                f"{_d(m['inflight_max_over_mean'], ref['inflight_max_over_mean'])} | "
                f"{m['peak_inflight_max']:.1f} ({m['peak_max_over_mean']:.2f}) | "
                f"{m['served_max_over_mean']:.3f} | {m['hit_vs_oracle']:.4f} | "
                f"{rs.get('ring', 0):.1%}/{rs.get('affinity', 0):.1%}/{rs.get('spill', 0):.1%} | "
                f"{_replay(m)} |"
            )
    return lines


SUMMARY = (
    ("local", "per worker (before)"),
    ("fleet-50ms", "fleet: one 50 ms snapshot"),
    ("fleet-50ms-late", "fleet: snapshot 50-100 ms old"),
)
STRESS = (
    ("fleet-live", "fleet: live counts"),
    ("fleet-own-timer", "fleet: each worker's own 50 ms timer"),
    (FOLLOW, "counterfactual: repeats follow each worker's record"),
)


def summary_lines(data: dict[str, Any], modes: tuple[tuple[str, str], ...]) -> list[str]:
    """Before/after: the per-worker routers against ``set_workers(N)`` + fleet table."""
    lines = [
        "| workload | workers | routing | groups on one replica | after warm-up | "
        "co-location | continuation | in-flight max/mean | served max/mean | "
        "hit vs oracle | spill | replay disagree (template/index) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl, rows in data["runs"].items():
        for n in WORKERS:
            for variant, label in modes if n > 1 else (("local", "one process"),):
                m = rows[f"{n}/{variant}"]["mean"]
                cont = m["continuation_same_replica"]
                lines.append(
                    f"| {wl} | {n} | {label} | {m['groups_whole']:.1%} | "
                    f"{m['groups_whole_after_warmup']:.1%} | {m['colocation']:.2%} | "
                    f"{'' if cont is None else format(cont, '.1%')} | "
                    f"{m['inflight_max_over_mean']:.3f} | {m['served_max_over_mean']:.3f} | "
                    f"{m['hit_vs_oracle']:.4f} | {m['spill']:.2%} | {_replay(m)} |"
                )
    return lines


def finding_fleet(data: dict[str, Any]) -> str:
    """The fix, in one paragraph from the measured numbers."""
    runs = data["runs"]

    def m(wl: str, key: str) -> dict[str, Any]:
        mean: dict[str, Any] = runs[wl][key]["mean"]
        return mean

    a2, a8 = m("a", "2/fleet-50ms"), m("a", "8/fleet-50ms")
    l2, l8 = m("a", "2/fleet-50ms-late"), m("a", "8/fleet-50ms-late")
    b2, b8 = m("b", "2/fleet-50ms"), m("b", "8/fleet-50ms")
    ob2, ob8 = m("b", "2/local"), m("b", "8/local")
    multi = [n for n in WORKERS if n > 1]
    fleet = ("fleet-50ms", "fleet-50ms-late")
    worst_whole = min(
        m(wl, f"{n}/{v}")["groups_whole"] for wl in "ac" for n in multi for v in fleet
    )
    worst_d = max(
        m(wl, f"{n}/{v}")["inflight_max_over_mean"] - m(wl, f"{n}/local")["inflight_max_over_mean"]
        for wl in runs
        for n in multi
        for v in fleet
    )
    live8, own8 = m("a", "8/fleet-live"), m("a", "8/fleet-own-timer")
    e8, oe8, fe8 = m("e", "8/fleet-50ms"), m("e", "8/local"), m("e", f"8/{FOLLOW}")
    return (
        "**With `set_workers(N)` and the fleet table.** A new key's replica is the bounded-"
        "load ring walk over the fleet-wide snapshot (`set_fleet_loads`), keyed one block "
        "past the template, so every worker that routes a sibling under the same snapshot "
        "computes the same replica; the private index steers only continuations (a prompt "
        "extending one this worker sent). Groups of (a) entirely on one replica: "
        f"{a2['groups_whole']:.1%} at 2 workers and {a8['groups_whole']:.1%} at 8 with one "
        f"50 ms snapshot for all workers, {l2['groups_whole']:.1%} and {l8['groups_whole']:.1%} "
        "when it is published a period late (50-100 ms old); over (a), (c) and (e), both "
        "tables, "
        f"at worst {worst_whole:.1%}. What still splits: a group whose samples straddle a "
        "refresh (they arrive over up to 3 ms here) and template warm-up (a worker that has "
        "not yet seen a template's 32 successors keys the prompt differently: the replay "
        "shows it as `template`; after the first quarter of the run "
        f"{a8['groups_whole_after_warmup']:.1%} of (a)'s groups are whole at 8 workers). "
        "A prompt a worker has served before is placed like a new one (the index does not "
        "get a say), which is what keeps repeats whole: (e), the same prompts over "
        f"{EPOCHS} epochs, {e8['groups_whole']:.1%} of groups on one replica at 8 workers "
        f"(per-worker routers {oe8['groups_whole']:.1%}; following each worker's record, "
        f"as one process does, {fe8['groups_whole']:.1%}). Its price is cross-epoch cache "
        "reuse: a repeat whose walk moved since the last epoch misses the prefix still cached "
        f"where it went then (hit vs oracle {e8['hit_vs_oracle']:.3f} against "
        f"{oe8['hit_vs_oracle']:.3f} for the per-worker routers, "
        f"{fe8['hit_vs_oracle']:.3f} following records). Load: in-flight max/mean at most "
        f"{worst_d:+.3f} against the per-worker routers in any row (negative is better), "
        f"e.g. (a) {a2['inflight_max_over_mean']:.3f} / {a8['inflight_max_over_mean']:.3f} at "
        f"2 / 8 workers. Multi-turn (b) gains most: continuation on the same replica "
        f"{ob2['continuation_same_replica']:.1%} -> {b2['continuation_same_replica']:.1%} at 2 "
        f"workers and {ob8['continuation_same_replica']:.1%} -> "
        f"{b8['continuation_same_replica']:.1%} at 8 (the key block is one every turn shares; "
        "what is left at 8 is conversations whose group the walk moved, which a worker that "
        "never saw them cannot know). The table must be one snapshot for all workers: fed "
        f"live counts, (a) at 8 workers keeps {live8['groups_whole']:.1%} of groups whole "
        "(a sibling's own dispatch changes the next sibling's view), and with each worker "
        f"sampling on its own 50 ms timer {own8['groups_whole']:.1%}."
    )


def finding(data: dict[str, Any]) -> str:
    """The index question, answered in one paragraph from the measured numbers."""
    runs = data["runs"]

    def m(wl: str, key: str) -> dict[str, Any]:
        mean: dict[str, Any] = runs[wl][key]["mean"]
        return mean

    one, lo2, lo8 = m("a", "1/local"), m("a", "2/local"), m("a", "8/local")
    sh2, sh8 = m("a", "2/shared"), m("a", "8/shared")
    b1, b8 = m("b", "1/local"), m("b", "8/local")
    ex = data["exposure"]
    multi = [n for n in WORKERS if n > 1]
    worst_ring = max(m(wl, f"{n}/local")["replay_disagree_ring_key"] for wl in runs for n in multi)
    worst_tpl = max(
        abs(m(wl, f"{n}/local")["colocation"] - m(wl, f"{n}/shared-templates")["colocation"])
        for wl in runs
        for n in multi
    )

    def moved(x: dict[str, Any]) -> float:
        return float(x["new_key_moved_by_load"]) / max(1e-9, float(x["ring_decisions"]))

    def aff(x: dict[str, Any]) -> float:
        return float(x["replay_disagree_affinity"]) / max(1e-9, float(x["replay_disagree"]))

    return (
        "**Is the learned index shared, or provably neutral for a GRPO group?** Neither: "
        "each worker builds its own `PrefixIndex`, and it does change groups' replicas, "
        "through affinity rather than templates. In one process a group's first sample "
        "takes the ring and its 7 siblings follow by affinity "
        f"({one['index_decisions']:.1%} of (a)'s decisions come from the index; bounded "
        f"load moves {moved(one):.0%} of first samples off their ring home, harmlessly, "
        "since the siblings follow). With N workers a sibling that lands on a worker that "
        "has not seen its group takes that worker's own ring walk over that worker's own "
        f"counts (ring decisions: {lo2['ring_decisions']:.1%} of requests at 2 workers, "
        f"{lo8['ring_decisions']:.1%} at 8), so whenever one worker moved the first sample "
        "and another did not, the group splits. Replayed at equal loads with their own "
        f"learned state, the workers would disagree on {lo2['replay_disagree']:.1%} (2 "
        f"workers) and {lo8['replay_disagree']:.1%} (8) of (a)'s requests, "
        f"{aff(lo2):.0%} and {aff(lo8):.0%} of that from affinity; co-location falls to "
        f"{lo2['colocation']:.1%} ({lo2['groups_whole']:.1%} of groups whole) at 2 workers "
        f"and {lo8['colocation']:.1%} ({lo8['groups_whole']:.1%}) at 8, where one shared "
        f"index would keep {sh2['colocation']:.1%} and {sh8['colocation']:.1%}. 2 workers "
        "are worse than 8 because each worker's bound is still ~1.15x *its* share of the "
        f"load, so its walk moves {moved(lo2):.0%} of its ring decisions, as one process "
        "does, but each worker moves different groups; at 8 the per-worker "
        f"floor `min_load_bound` = 8 dominates (moves {moved(lo8):.0%}), which co-locates "
        "better and balances worse: in-flight max/mean "
        f"{lo8['inflight_max_over_mean']:.2f} vs {one['inflight_max_over_mean']:.2f}, "
        f"peak {lo8['peak_inflight_max']:.0f} vs {one['peak_inflight_max']:.0f} in flight "
        "(a shared index does not fix that: "
        f"{sh8['inflight_max_over_mean']:.2f}). The template path is real but small: a worker "
        "that has detected a template keys the ring `key_blocks` past it, one that has not "
        "keys on the whole capped prompt, which differ only for prompts longer than "
        f"template + 8 blocks ({ex['a']['ring_key_depends_on_templates']:.1%} of (a)'s "
        f"prompts, {ex['c']['ring_key_depends_on_templates']:.1%} of (c)'s) and only while "
        "the workers' template sets differ (warm-up); template-driven disagreement is at "
        f"most {worst_ring:.2%} of replayed requests in any run, and sharing the template "
        f"set alone moves co-location by at most {worst_tpl * 100:.2f} pp. Multi-turn (b) "
        "is hit hardest: a continuation usually lands on a worker that did not serve the "
        "previous turn, and until a conversation is `key_blocks` past its template the "
        "ring key of the grown prompt differs from the previous turn's, so at 8 workers "
        "continuation on the same replica falls to "
        f"{b8['continuation_same_replica']:.1%} (from {b1['continuation_same_replica']:.0%}) "
        f"and hit rate vs oracle to {b8['hit_vs_oracle']:.3f} "
        f"(from {b1['hit_vs_oracle']:.3f})."
    )


def write_markdown(data: dict[str, Any], path: Path) -> None:
    ex = data["exposure"]
    lines = [
        "# Routing with N data-plane workers (in-process simulation)",
        "",
        f"Generated by `bench/workers_routing.py` (wall time {data['wall_s']} s) on "
        f"`bench/routing.py`'s workloads: {data['replicas']} replicas, "
        f"{data['groups_per_replica']['a/c']} groups per replica on (a) GRPO and (c) hot "
        f"prefix, {data['groups_per_replica']['b']} on (b) multi-turn, and (e) = (a)'s first "
        f"quarter of prompts sent in each of {EPOCHS} epochs (a small dataset trained for "
        "several epochs: a worker holds a record of where it sent each prompt last time); "
        "G = 8. Each worker is "
        'a real `PrefixAffinityRouter` (`make_router("prefix", RoutingConfig())`) that '
        "sees only its own requests in flight. **Assignment model: each request goes to a "
        "uniformly random worker** (seeded; the kernel spreading TRL's keep-alive "
        "connections, per request), so a group's 8 samples meet up to 8 workers. Means "
        f"over seeds {data['seeds']} for N > 1; Δ is against 1 worker (identical to "
        "`bench/routing.py`'s `prefix` policy, and so is one worker after `set_workers(1)` "
        "fed a fleet table: asserted).",
        "",
        "## Before and after: per-worker routers vs `set_workers(N)` with the fleet table",
        "",
        "`per worker (before)`: each worker's own router on its own counts (`--workers N` "
        "without this change). `fleet`: `set_workers(N)` and `set_fleet_loads` with the "
        "fleet-wide counts (summed over workers), as one snapshot every 50 ms of simulated "
        "time handed to every worker (0-50 ms old), or the same snapshots published one "
        "period late (50-100 ms old, the interface's worst case). A request reads the "
        "snapshot current at its arrival, up to 3 ms after the sim sends it (a group's "
        "samples spread over a few ms), so some groups straddle a refresh. `after warm-up`: "
        "groups after the first quarter of the run. `replay disagree`: every worker handed "
        "the same snapshot and replayed the request; the fraction on which they would not "
        "all pick one replica, by cause: template set (ring key) / index (affinity).",
        "",
        *summary_lines(data, SUMMARY),
        "",
        "Stress rows (how *not* to feed the table): `live` = the exact fleet counts at "
        "every decision; `own timer` = each worker snapshots the counts every 50 ms at its "
        "own phase (worker w at w/N of the period), so two workers' tables differ by up to "
        "50 ms of traffic. And the design's counterfactual: with one 50 ms snapshot, but a "
        "prompt a worker served verbatim before follows that worker's record (as one "
        "process's affinity does) instead of being placed like a new key.",
        "",
        *summary_lines(data, STRESS),
        "",
        finding_fleet(data),
        "",
        "## Every variant",
        "",
        "`index`: `local` is the per-worker routers; `shared-templates` and `shared` are "
        "counterfactuals (template set, or the whole index, shared between workers; loads "
        "still local); `fleet-*` are `set_workers(N)` with the tables above.",
        "",
        *table_lines(data),
        "",
        "Columns: co-location = fraction of a group's requests on its most common replica; "
        "in-flight max/mean = the busiest replica's time-averaged in-flight count over the "
        "mean (`bench/routing.py`'s definition); peak in-flight max = the highest in-flight "
        "count any replica reached (and its ratio to the mean replica peak); reasons as "
        "fractions of requests; replay disagree = fraction of requests for which the "
        "workers, replayed at equal loads with their own learned state, would not all pick "
        "the same replica (by cause: different ring keys from different template sets / "
        "affinity of some worker elsewhere); replayed for `local` and `fleet-50ms` (there "
        "with every worker handed the deciding worker's snapshot) only (for the "
        "counterfactuals the ring-key part, or all of it, is 0 by construction).",
        "",
        f"Template depths of the prompts once learned (blocks of 64 tokens): (a) "
        f"{ex['a']['template_depths']}, (c) {ex['c']['template_depths']}, (b) "
        f"{ex['b']['template_depths']}.",
        "",
        "## The prefix index without `set_workers` (the per-worker routers)",
        "",
        finding(data),
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(data: dict[str, Any], path: Path) -> bool:
    if (plt := pyplot()) is None:
        return False

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = (
        ("colocation", "group co-location"),
        ("groups_whole", "groups entirely on one replica"),
        ("inflight_max_over_mean", "in-flight max/mean (time avg)"),
    )
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        for (wl, rows), marker in zip(data["runs"].items(), "os^D", strict=False):
            for variant, style in (("local", "-"), ("shared", ":"), ("fleet-50ms", "--")):
                ys = [rows[f"{n}/{variant if n > 1 else 'local'}"]["mean"][metric] for n in WORKERS]
                ax.plot(WORKERS, ys, style, marker=marker, label=f"({wl}) {variant}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(WORKERS), [str(n) for n in WORKERS])
        ax.set_xlabel("data-plane workers")
        ax.set_title(f"{title}, {data['replicas']} replicas")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a RoutingConfig field (e.g. fleet_key_blocks=8); repeatable",
    )
    args = ap.parse_args(argv)
    for item in args.set:
        name, _, value = item.partition("=")
        OVERRIDES[name] = type(getattr(RoutingConfig(), name))(value)
    t0 = time.perf_counter()
    data = run(args.replicas)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "workers_routing" if args.replicas == 8 else f"workers_routing-r{args.replicas}"
    if OVERRIDES:
        stem += "-" + "-".join(f"{k}={v}" for k, v in sorted(OVERRIDES.items()))
        data["overrides"] = dict(OVERRIDES)
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(data, args.out / f"{stem}.md")
    plotted = write_plot(data, args.out / f"{stem}.png")
    print("\n".join(summary_lines(data, SUMMARY + STRESS)))
    print()
    print(finding_fleet(data))
    print(
        f"wrote {args.out}/{stem}.{{json,md{',png' if plotted else ''}}} in {data['wall_s']} s"
        + ("" if plotted else " (matplotlib missing: no PNG)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
