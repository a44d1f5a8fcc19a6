"""Assertions shared by the TRL layer's tests (each reads the replicas themselves)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from rollout_testbed.trl.harness import MAX_STALENESS, Layer, RunResult, replica_adapters, wait_for
from rollout_testbed.trl.learning import Z_RUN, judge

LORA_NAME = "trl-policy"
# Every learning check's line, pass or fail: the layer prints them in pytest's terminal
# summary (conftest.py), so a passing run's margin is on record too (``-q`` drops prints).
LEARNING: list[str] = []


def lora_dir(res: RunResult) -> str:
    """Where TRL writes adapters: ``os.path.abspath(output_dir)/.vllm_lora`` (its own rule)."""
    return os.path.join(os.path.abspath(res.spec.output_dir), ".vllm_lora")


def window(res: RunResult, staleness: int = MAX_STALENESS) -> dict[str, str]:
    """The newest ``staleness + 1`` versions TRL published, at the paths TRL sent."""
    top = res.model_version
    return {
        f"{LORA_NAME}-v{v}": os.path.join(lora_dir(res), f"{LORA_NAME}-v{v}")
        for v in range(max(1, top - staleness), top + 1)
    }


def assert_completed(res: RunResult) -> None:
    """The run finished every step and TRL synced by adapter only, with no failed call."""
    assert res.error is None, f"{res.spec.name}: TRL run failed:\n{res.error}"
    assert res.global_step == res.spec.max_steps, (res.global_step, res.spec.max_steps)
    assert res.lora_sync, "TRL did not choose adapter-only sync"
    assert res.weight_transfer == "NoneType", res.weight_transfer  # no NCCL client built
    failed = [c for c in res.calls if c.error]
    assert not failed, f"failed control calls: {failed}"


def assert_loads(res: RunResult, first_version: int) -> list[str]:
    """TRL loaded first_version, first_version + 1, ... up to its final version, in order."""
    names = [c.arg for c in res.control("load_lora_adapter")]
    want = [f"{LORA_NAME}-v{v}" for v in range(first_version, res.model_version + 1)]
    assert names == want, f"loads {names} != {want}"
    return names


def assert_fleet_holds_window(layer: Layer, res: RunResult, replicas: list[int]) -> None:
    """Each replica's own /v1/models lists exactly the newest S+1 versions (and the gateway
    lists the same); bounded wait for the gateway's drained unloads to land."""
    want = window(res)

    def exact() -> bool:
        return all(replica_adapters(layer.urls[i]) == want for i in replicas)

    try:
        wait_for(exact, 20, "replicas to hold exactly the newest versions")
    except AssertionError:
        held = {i: replica_adapters(layer.urls[i]) for i in replicas}
        raise AssertionError(f"want {sorted(want)} on replicas {replicas}, held {held}") from None
    assert layer.gateway.live_adapters() == sorted(want)


def assert_learned(rewards: Sequence[float], what: str, *, z: float = Z_RUN) -> float:
    """The policy learned, by ``rollout_testbed.trl.learning.judge`` (the rule and its error
    rates); returns the z. The line goes to ``LEARNING`` and stdout, pass or fail."""
    verdict = judge(rewards, what, z=z)
    LEARNING.append(verdict.line)
    print(verdict.line)
    assert verdict.passed, (what, list(rewards), verdict.line)
    return verdict.z


def report(res: RunResult, **extra: Any) -> dict[str, Any]:
    """Print (for the test log) and return the run's summary plus ``extra``."""
    summary = {**res.summary(), **extra}
    print(f"\n{res.spec.name}: {json.dumps(summary)}")
    return summary
