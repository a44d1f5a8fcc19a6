"""One chaos run: TRL's real ``AsyncGRPOTrainer`` through the gateway for a wall-clock
duration while ``inject.Chaos`` carries out a seeded schedule; then the fleet's end state
and the goals. Shared by ``bench/chaos.py`` (``make bench-chaos``) and
``tests/trl/test_trl_chaos.py`` (CI), which differ only in duration and seed.

The goals (``goals``), each PASS/FAIL:

* ``steps_complete``: TRL's ``train()`` returned without an error after its time bound
  (every step it began, it finished) and trained at least one step;
* ``worker_alive``: TRL's rollout worker (a spawned child of the trainer) is the same
  live process at the first and the last step (TRL ends the run when it dies, so this
  also reads its failure);
* ``no_strays``: every replica holds exactly the run's newest ``max_staleness + 1``
  versions, and nothing else;
* ``nothing_paused``: no replica answers ``/is_paused`` true, and the gateway's
  ``gateway_fleet_paused`` is 0;
* ``learned`` (the long run only, when a learning rule is given): the reward rises by
  ``rollout_testbed.trl.learning``'s rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollout_testbed.chaos.inject import Chaos, fleet_state
from rollout_testbed.chaos.schedule import Fault
from rollout_testbed.trl import harness as H

LORA_NAME = "trl-policy"


def owned_window(output_dir: Path, model_version: int) -> dict[str, str]:
    """The newest ``MAX_STALENESS + 1`` versions TRL published (name -> path TRL sent)."""
    root = output_dir.resolve() / ".vllm_lora"
    lo = max(1, model_version - H.MAX_STALENESS)
    return {f"{LORA_NAME}-v{v}": str(root / f"{LORA_NAME}-v{v}")
            for v in range(lo, model_version + 1)}  # fmt: skip


def run_chaos(
    layer: H.Layer,
    name: str,
    faults: list[Fault],
    *,
    duration_s: float,
    seed: int = 0,
    work: Path | None = None,
    dataset_rows: int = 512,
) -> tuple[H.RunResult, Chaos | None, dict[str, Any]]:
    """Train for ``duration_s`` under ``faults`` (none: the fault-free run of the same
    seed); returns TRL's result, the chaos record and the fleet's end state."""
    work = H.fresh_dir(work or H.TRL_DIR / "chaos" / name)
    out = work / "trl"
    out.mkdir()
    chaos = Chaos(layer, faults, lora_dir=out.resolve() / ".vllm_lora",
                  events=work / "events.jsonl") if faults else None  # fmt: skip
    steps: list[float] = []
    spec = layer.spec(
        name, 100_000, output_dir=out, seed=seed, dataset_rows=dataset_rows,
        record_path=work / "records.jsonl", stop_after_s=duration_s,
        before_call=chaos.before_call if chaos else None,
        on_step_end=chaos.on_step_end if chaos else (lambda s: steps.append(time.time())),
    )  # fmt: skip
    res = H.run_trl(spec, layer.model_dir)
    if chaos is not None:
        notes = chaos.finish()
        if notes:
            print(f"[chaos] finish: {notes}", flush=True)
    state = fleet_state(layer, owned_window(out, res.model_version))
    return res, chaos, state


def goals(
    res: H.RunResult,
    chaos: Chaos | None,
    state: dict[str, Any],
    learned: Callable[[Sequence[float]], tuple[bool, str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each goal: ``{"pass": bool, "detail": str}``."""
    out: dict[str, dict[str, Any]] = {}
    ok = res.error is None and res.global_step > 0
    out["steps_complete"] = {
        "pass": ok,
        "detail": f"{res.global_step} steps in {res.wall_s:.0f} s"
        + (f"; TRL error: {res.error.strip().splitlines()[-1]}" if res.error else ""),
    }
    if chaos is not None and chaos.worker_pids:
        first, last = set(chaos.worker_pids[0]), set(chaos.worker_pids[-1])
        alive = res.error is None and bool(first) and first == last
        detail = f"worker pids at step 1 {sorted(first)}, at the last step {sorted(last)}"
    else:
        alive, detail = res.error is None, "no per-step record (fault-free run)"
    out["worker_alive"] = {"pass": alive, "detail": detail}
    out["no_strays"] = {
        "pass": not state["strays"] and not state["missing"],
        "detail": f"strays {state['strays']}, missing {state['missing']}, owned {state['owned']}",
    }
    paused = state["replica_paused"]
    out["nothing_paused"] = {
        "pass": all(v is False for v in paused.values()) and state["gateway_fleet_paused"] == 0,
        "detail": f"replicas /is_paused {paused}, gateway_fleet_paused "
        f"{state['gateway_fleet_paused']}",
    }
    if learned is not None:
        passed, line = learned(res.rewards())
        out["learned"] = {"pass": passed, "detail": line}
    return out
