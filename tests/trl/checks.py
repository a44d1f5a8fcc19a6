"""Assertions shared by the TRL layer's tests (each reads the replicas themselves)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from statistics import mean
from statistics import variance as var
from typing import Any

from rollout_testbed.trl.harness import MAX_STALENESS, Layer, RunResult, replica_adapters, wait_for

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


# The learning rule and its two error rates (see ``assert_learned``).
Z_RUN = 3.0  # one run alone, and several runs' per-step means together
Z_EACH = 2.0  # each of several runs sharing the fleet
GAIN = 1.25  # last 10 steps' mean over the first 10's


def assert_learned(
    rewards: Sequence[float], what: str, *, z: float = Z_RUN, gain: float = GAIN
) -> float:
    """The policy learned: the last 10 steps' mean reward is above the first 10 steps' by
    more than ``z`` standard errors (Welch) and by at least ``gain`` times; returns the z.

    Its error rates, stated so that a failure can be weighed:

    - **False pass** (a run that does not learn, e.g. rollouts served by the wrong
      weights, passes): its z is about N(0, 1), so P(z > 3) = 0.13 % for one run; for
      three runs each must pass z > 2 (2.3 % each) *and* their mean z > 3.
    - **False failure** (a run that learns as CI's runs do, fails): estimated from the
      margins CI recorded, seven happy-path runs (gains 10.1, 6.4, 3.34, 3.62, 2.42, 2.48,
      3.71; z 7.4-15.2) and ten runs of the three-run test (gains 3.1-52.7, z 6.2-20.7).
      The gain decides it: log-normal fits give P(gain < 1.25) of about 1.2 % for the
      happy path (mean ln 1.40, sd 0.52) and 0.15 % for each shared run (mean ln 2.70,
      sd 0.84); P(z < 3) is about 0.2 % (mean 10.4, sd 2.6). So about 1.5 % for the
      happy path in each TRL layer and about 0.5 % for the three-run test. Until
      ``54f9c9a`` the happy path needed 1.5x, a 2.8 % false failure by the same fit.
    """
    first, last = rewards[:10], rewards[-10:]
    rise, se = mean(last) - mean(first), math.sqrt(var(first) / 10 + var(last) / 10)
    score = rise / se if se else math.copysign(math.inf, rise) if rise else 0.0
    line = (f"{what}: reward first 10 {mean(first):.4f} -> last 10 {mean(last):.4f} "
            f"({mean(last) / mean(first) if mean(first) else math.inf:.2f}x, z {score:.1f}; "
            f"needs z > {z:g} and {gain:g}x)")  # fmt: skip
    LEARNING.append(line)
    print(line)
    assert rise > z * se and mean(last) > gain * mean(first), (what, list(rewards), rise, se)
    return score


def report(res: RunResult, **extra: Any) -> dict[str, Any]:
    """Print (for the test log) and return the run's summary plus ``extra``."""
    summary = {**res.summary(), **extra}
    print(f"\n{res.spec.name}: {json.dumps(summary)}")
    return summary
