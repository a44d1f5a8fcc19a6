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

The fix, ``fleet-*``: every router gets ``set_workers(N)`` and is fed the fleet-wide
in-flight counts through ``set_fleet_loads`` (``gateway/routing/fleet.py``), as the owner
publishes them (:class:`_Tables`): one 50 ms snapshot for all workers (``fleet-50ms``), or
the same published a period late (``fleet-50ms-late``, 50-100 ms old, the interface's worst
case). Simulated time comes from the heap tap (a completion's time). The counterfactuals
and stress cases that settled this design (one shared index or template set, live counts,
each worker on its own timer, repeats following a worker's record) are
``bench/workers_routing.py`` at ``4a5220d``; their conclusions are in ``docs/routing.md``.

The index question is measured directly too (``replay``): before each real decision the
request is replayed to *every* worker's router with equal (zero) loads, and we count how
often the workers would pick different replicas, split by cause: their template sets
give different ring keys (the ring key is the chain hash ``key_blocks`` past the template
when one is known, else the whole capped prompt), or some worker remembers the prompt
(affinity) on a replica other than the ring's.

Sizing: 96 groups per replica (4x ``bench/routing.py``'s 24, so template warm-up is a
small part of the run), workloads a, c (single-turn GRPO), b (multi-turn) and e (repeats
over epochs), 3 worker-assignment seeds per N > 1 (the table shows their mean; the JSON
keeps each).
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
from gateway.routing.index import IndexStats  # noqa: E402
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
TABLES = ("50ms", "50ms-late")
FLEET = tuple(f"fleet-{t}" for t in TABLES)
VARIANTS = ("local", *FLEET)
REFRESH_S = 0.050  # the interface's refresh period, in simulated seconds
ARRIVAL_SPREAD_S = 0.003  # a request reads the table as of its arrival, up to 3 ms later
WORKLOADS = ("a", "c", "b", "e")
EPOCHS = 4  # (e): (a)'s first 1/EPOCHS of groups, sent EPOCHS times over
GROUPS_PER_REPLICA = 96
MULTI_TURN_GROUPS_PER_REPLICA = 32
SEEDS = (1, 2, 3)


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
            r = make_router("prefix", RoutingConfig())
            assert isinstance(r, PrefixAffinityRouter)
            r.set_members(range(replicas))
            if fleet:
                r.set_workers(workers)  # 1 worker: must change nothing (asserted in run)
            self.routers.append(r)
        cfg = self.routers[0].config
        self.fleet = fleet and workers > 1
        self.key_blocks = cfg.fleet_key_blocks if self.fleet else cfg.key_blocks
        model = variant.removeprefix("fleet-")
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
            if table is not self._fed[w]:
                self.routers[w].set_fleet_loads(table)  # a refresh
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
    """The fleet table each worker is handed: one snapshot of the fleet-wide counts every
    50 ms of simulated time, the same object for every worker (``50ms``: 0-50 ms old), or
    those snapshots published one period late (``50ms-late``: 50-100 ms old, the
    interface's "up to ~100 ms stale"). A request reads the table as of its arrival, up to
    ``ARRIVAL_SPREAD_S`` after the sim's send time (the sim sends a group's 8 samples at one
    instant; real ones spread over a few ms), so some groups straddle a refresh. Snapshots
    are taken at the first event at or after each boundary, before that event changes the
    counts: the state at the boundary.
    """

    def __init__(self, model: str, workers: int, replicas: int, seed: int) -> None:
        assert model in TABLES, model
        self.lag = model == "50ms-late"
        self.live = dict.fromkeys(range(replicas), 0)
        self.next_epoch = 0
        self.snaps: dict[int, dict[int, int]] = {}
        self.rng = random.Random(seed + 7919)  # apart from the worker draw: same workers
        self.now = 0.0
        self.tick(0.0)

    def tick(self, now: float) -> None:
        self.now = now
        while self.next_epoch * REFRESH_S <= now:
            e = self.next_epoch
            self.snaps.setdefault(e, dict(self.live))
            self.snaps.pop(e - 4, None)
            self.next_epoch += 1

    def for_worker(self, w: int) -> dict[int, int]:
        at = self.now + self.rng.uniform(0.0, ARRIVAL_SPREAD_S)
        e = math.floor(at / REFRESH_S) - self.lag
        snap = self.snaps.get(e)
        if snap is None:  # past the last boundary ticked (the spread crossed one): now
            snap = dict(self.live) if e >= 0 else dict.fromkeys(self.live, 0)
            self.snaps[e] = snap
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
    # Replay (the most expensive part at 8 workers) once per mode: the late table differs
    # from the 50 ms one only in what table each worker is handed, which the replay
    # equalises anyway.
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


def run(replicas: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "replicas": replicas,
        "workers": list(WORKERS),
        "seeds": list(SEEDS),
        "groups_per_replica": {"a/c": GROUPS_PER_REPLICA, "b": MULTI_TURN_GROUPS_PER_REPLICA},
        "assignment": "each request to a uniformly random worker (random.Random(seed))",
        "runs": {},
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
    return out


# -- reporting ----------------------------------------------------------------------------


def _replay(m: dict[str, Any]) -> str:
    if m["replay_disagree"] is None:
        return "not replayed"
    return (
        f"{m['replay_disagree']:.2%} ({m['replay_disagree_ring_key']:.2%}/"
        f"{m['replay_disagree_affinity']:.2%})"
    )


SUMMARY = (
    ("local", "per worker (before)"),
    ("fleet-50ms", "fleet: one 50 ms snapshot"),
    ("fleet-50ms-late", "fleet: snapshot 50-100 ms old"),
)


def summary_lines(data: dict[str, Any]) -> list[str]:
    """Before/after: the per-worker routers against ``set_workers(N)`` + fleet table."""
    lines = [
        "| workload | workers | routing | groups on one replica | after warm-up | "
        "co-location | continuation | in-flight max/mean | served max/mean | "
        "hit vs oracle | spill | replay disagree (template/index) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl, rows in data["runs"].items():
        for n in WORKERS:
            for variant, label in SUMMARY if n > 1 else (("local", "one process"),):
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


def finding(data: dict[str, Any]) -> str:
    """The figures ``docs/routing.md`` states, from this run (the why is there)."""
    runs = data["runs"]
    multi = [n for n in WORKERS if n > 1]
    worst_whole = min(
        runs[wl][f"{n}/{v}"]["mean"]["groups_whole"] for wl in "ace" for n in multi for v in FLEET
    )
    worst_d = max(
        runs[wl][f"{n}/{v}"]["mean"]["inflight_max_over_mean"]
        - runs[wl][f"{n}/local"]["mean"]["inflight_max_over_mean"]
        for wl in runs
        for n in multi
        for v in FLEET
    )
    whole = {n: {v: runs["a"][f"{n}/{v}"]["mean"]["groups_whole"] for v in VARIANTS} for n in multi}
    return (
        "Groups of (a) entirely on one replica with one 50 ms snapshot: "
        + ", ".join(f"{whole[n]['fleet-50ms']:.1%} at {n} workers" for n in multi)
        + " (per-worker routers: "
        + ", ".join(f"{whole[n]['local']:.1%}" for n in multi)
        + f"); over (a), (c) and (e), both tables, at worst {worst_whole:.1%}. In-flight "
        f"max/mean at most {worst_d:+.3f} against the per-worker routers in any row."
    )


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = [
        "# Routing with N data-plane workers (in-process simulation)",
        "",
        f"Generated by `bench/workers_routing.py` (wall time {data['wall_s']} s) on "
        f"`bench/routing.py`'s workloads: {data['replicas']} replicas, "
        f"{data['groups_per_replica']['a/c']} groups per replica on (a) GRPO and (c) hot "
        f"prefix, {data['groups_per_replica']['b']} on (b) multi-turn, and (e) = (a)'s first "
        f"quarter of prompts sent in each of {EPOCHS} epochs; G = 8. Each worker is a real "
        '`PrefixAffinityRouter` (`make_router("prefix", RoutingConfig())`) that sees only '
        "its own requests in flight; each request goes to a uniformly random worker "
        f"(seeded). Means over seeds {data['seeds']} for N > 1. One worker is "
        "`bench/routing.py`'s `prefix` policy, also after `set_workers(1)` (asserted). "
        'Why and what it means: `docs/routing.md`, "Across data-plane workers".',
        "",
        "`per worker (before)`: each worker's own router on its own counts. `fleet`: "
        "`set_workers(N)` and `set_fleet_loads` with one snapshot of the fleet-wide counts "
        "every 50 ms of simulated time (0-50 ms old), or published a period late (50-100 ms "
        "old). `after warm-up`: groups after the first quarter of the run. `replay "
        "disagree`: every worker handed the same snapshot and replayed the request; the "
        "fraction on which they would not all pick one replica, by cause: template set "
        "(ring key) / index (affinity).",
        "",
        *summary_lines(data),
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
            for variant, style in (("local", "-"), ("fleet-50ms", "--")):
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
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = run(args.replicas)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "workers_routing" if args.replicas == 8 else f"workers_routing-r{args.replicas}"
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(data, args.out / f"{stem}.md")
    plotted = write_plot(data, args.out / f"{stem}.png")
    print("\n".join(summary_lines(data)), finding(data), sep="\n\n")
    print(
        f"wrote {args.out}/{stem}.{{json,md{',png' if plotted else ''}}} in {data['wall_s']} s"
        + ("" if plotted else " (matplotlib missing: no PNG)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
