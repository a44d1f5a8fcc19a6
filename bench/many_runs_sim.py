"""Many runs at scale, simulated: 16 runs over 8 replicas with tight adapter budgets,
runs joining and leaving, through the gateway's own pure cores.

What it runs: ``gateway.adapters.placement`` places the runs (each needs
``max_staleness + 2`` slots per home), then a timeline of joins and leaves; after every
event, GRPO-shaped rollouts (groups of 8 samples of one token-id prompt, shared
template prefix) from every placed run are routed by the real ``PrefixAffinityRouter``
among that run's home replicas, exactly as ``gateway.api.rollout.plan_rollout`` narrows
the candidates. In-flight counts are kept per replica (a rollout finishes after a fixed
number of later decisions), so bounded load matters.

Reports: placement churn per event ((run, replica) pairs loaded or unloaded), rollouts per
replica (max/mean), whether any replica was ever over budget, the time of one placement
and of one routing decision including the home-replica filter (median of the run).

    .venv/bin/python bench/many_runs_sim.py          # writes bench/results/many-runs-sim.*

Pure CPU, single process, seconds; no sockets.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from gateway.adapters.placement import Placement, PlacementError, churn, place, run_slots
from gateway.routing.config import RoutingConfig
from gateway.routing.policy import CandidateLoads, RouteRequest, make_router

HERE = Path(__file__).resolve().parent


def rollouts(rng: random.Random, run: str, groups: int) -> list[list[int]]:
    """``groups`` GRPO groups of 8 identical prompts: a run-wide template, then the task."""
    template = [hash(run) % 1000 + t for t in range(64)]
    prompts = []
    for _ in range(groups):
        task = [rng.randrange(32000) for _ in range(rng.randrange(32, 256))]
        prompts += [template + task] * 8
    return prompts


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    replicas = list(range(args.replicas))
    budgets = dict.fromkeys(replicas, args.budget)
    runs = {f"run-{i:02d}": run_slots(args.max_staleness) for i in range(args.runs)}
    router = make_router("prefix", RoutingConfig())
    router.set_members(replicas)
    in_flight = dict.fromkeys(replicas, 0)
    served = dict.fromkeys(replicas, 0)
    finishing: list[int] = []
    placement = Placement.empty(budgets)
    events: list[dict[str, Any]] = []
    place_us: list[float] = []
    decide_us: list[float] = []
    over_budget = 0
    active: dict[str, int] = {}

    def step(label: str, wanted: dict[str, int]) -> None:
        nonlocal placement, over_budget
        t0 = time.perf_counter()
        result = place(placement, wanted, budgets)
        place_us.append((time.perf_counter() - t0) * 1e6)
        new = result.best_effort if isinstance(result, PlacementError) else result
        refused = sorted(result.needs) if isinstance(result, PlacementError) else []
        moved = churn(placement, new)
        placement = new
        over_budget += sum(1 for r in replicas if placement.load(r) > args.budget)
        for run in sorted(wanted):
            homes = placement.ordered_homes(run)
            if not homes:
                continue
            for prompt in rollouts(rng, run, args.groups):
                t1 = time.perf_counter()
                loads = CandidateLoads({i: in_flight[i] for i in homes})
                request = RouteRequest(path="/v1/completions", model=f"{run}~trl-policy-v1",
                                       payload={"prompt": prompt})  # fmt: skip
                decision = router.choose(request, loads)
                router.observe(decision)
                decide_us.append((time.perf_counter() - t1) * 1e6)
                in_flight[decision.replica] += 1
                served[decision.replica] += 1
                finishing.append(decision.replica)
                if len(finishing) > args.in_flight:
                    in_flight[finishing.pop(0)] -= 1
        homes_count = [len(placement.homes(r)) for r in wanted if placement.homes(r)]
        events.append({"event": label, "runs": len(wanted), "placed": len(homes_count),
                       "refused": refused, "churn_pairs": moved,
                       "churn_adapters": moved * run_slots(args.max_staleness),
                       "homes_min": min(homes_count, default=0),
                       "homes_max": max(homes_count, default=0)})  # fmt: skip

    names = sorted(runs)
    for name in names:  # runs join one by one
        active[name] = runs[name]
        step(f"join {name}", dict(active))
    for i in range(args.churn_events):  # then leave and join at random
        if active and (rng.random() < 0.5 or len(active) == len(runs)):
            gone = rng.choice(sorted(active))
            del active[gone]
            step(f"leave {gone}", dict(active))
        else:
            back = rng.choice(sorted(set(runs) - set(active)))
            active[back] = runs[back]
            step(f"join {back}", dict(active))
        del i
    counts = [served[r] for r in replicas]
    return {
        "config": vars(args) | {"slots_per_run": run_slots(args.max_staleness)},
        "events": events,
        "churn_pairs_total": sum(e["churn_pairs"] for e in events),
        "churn_pairs_median": statistics.median(e["churn_pairs"] for e in events),
        "rollouts_per_replica": counts,
        "rollouts_max_over_mean": max(counts) / statistics.mean(counts),
        "over_budget_events": over_budget,
        "placement_us_median": statistics.median(place_us),
        "placement_us_max": max(place_us),
        "decision_us_median": statistics.median(decide_us),
        "decision_us_p99": sorted(decide_us)[int(0.99 * len(decide_us))],
        "decisions": len(decide_us),
    }


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"# Many runs at scale (simulated): {cfg['runs']} runs over {cfg['replicas']} replicas",
        "",
        f"Budget {cfg['budget']} adapter slots per replica; each run needs "
        f"{cfg['slots_per_run']} (max_staleness {cfg['max_staleness']} + 2). Runs join one "
        f"by one, then {cfg['churn_events']} random leaves and joins (seed {cfg['seed']}). "
        f"After each event every placed run sends {cfg['groups']} GRPO groups of 8, routed "
        f"by the real prefix router among its homes ({cfg['in_flight']} in flight).",
        "",
        "| metric | value |",
        "|---|---|",
        f"| placement churn, total ((run, replica) pairs loaded or unloaded) | "
        f"{res['churn_pairs_total']} over {len(res['events'])} events |",
        f"| placement churn per event, median | {res['churn_pairs_median']} pairs |",
        f"| events with a replica over budget | {res['over_budget_events']} |",
        f"| rollouts per replica | {', '.join(map(str, res['rollouts_per_replica']))} |",
        f"| rollouts max / mean | {res['rollouts_max_over_mean']:.2f} |",
        f"| one placement (µs), median / max | {res['placement_us_median']:.0f} / "
        f"{res['placement_us_max']:.0f} |",
        f"| one routing decision incl. home filter (µs), median / p99 | "
        f"{res['decision_us_median']:.1f} / {res['decision_us_p99']:.1f} |",
        "",
        "| event | runs | placed | refused | churn (pairs) | homes min-max |",
        "|---|---|---|---|---|---|",
    ]
    for e in res["events"]:
        lines.append(f"| {e['event']} | {e['runs']} | {e['placed']} | "
                     f"{', '.join(e['refused']) or '-'} | {e['churn_pairs']} | "
                     f"{e['homes_min']}-{e['homes_max']} |")  # fmt: skip
    lines += ["", "Reproduce: `make bench-many-runs-sim` (= `bench/many_runs_sim.py`)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--budget", type=int, default=9, help="adapter slots per replica")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--groups", type=int, default=8, help="GRPO groups per run per event")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--churn-events", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    out_dir, no_write = args.out_dir, args.no_write
    del args.out_dir, args.no_write
    res = simulate(args)
    text = markdown(res)
    print(text)
    if not no_write:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "many-runs-sim.json").write_text(json.dumps(res, indent=1) + "\n")
        (out_dir / "many-runs-sim.md").write_text(text)


if __name__ == "__main__":
    main()
