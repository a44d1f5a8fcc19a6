"""The learning rule the TRL layer asserts and ``bench/chaos.py`` reports
(``rollout_testbed.trl.learning.judge``): judged here on made-up rewards, so that a change
to the rule shows in the fast layer, not only after a 17-minute TRL layer."""

from __future__ import annotations

import math

from rollout_testbed.trl.learning import STEPS, Z_EACH, Z_RUN, judge


def rising(steps: int, start: float, end: float) -> list[float]:
    """Rewards that climb steadily, with a small alternating wobble (so the variance > 0)."""
    return [start + (end - start) * i / (steps - 1) + (0.002 if i % 2 else -0.002)
            for i in range(steps)]  # fmt: skip


def test_a_run_that_learns_passes_with_its_z_in_the_line() -> None:
    verdict = judge(rising(STEPS, 0.01, 0.2), "happy")
    assert verdict.passed and verdict.z > Z_RUN
    assert verdict.line.startswith("happy: reward first 10 ")
    assert f"z {verdict.z:.1f}" in verdict.line and "needs z > 3" in verdict.line


def test_a_flat_run_fails_and_noise_alone_does_not_pass() -> None:
    flat = judge([0.05 + (0.01 if i % 3 else -0.01) for i in range(STEPS)], "flat")
    assert not flat.passed and abs(flat.z) < 1
    falling = judge(rising(STEPS, 0.2, 0.01), "falling")
    assert not falling.passed and falling.z < 0


def test_the_bar_is_the_z_asked_for() -> None:
    """A rise that clears 2.5 standard errors but not 3: each run of several passes, a run
    alone does not."""
    rewards = [0.0, 0.02] * 5 + [0.01] * (STEPS - 20) + [0.0126, 0.0326] * 5
    verdict = judge(rewards, "borderline")
    assert Z_EACH < verdict.z < Z_RUN
    assert judge(rewards, "each", z=Z_EACH).passed
    assert not judge(rewards, "alone", z=Z_RUN).passed


def test_too_short_a_run_fails_rather_than_overlap_its_windows() -> None:
    verdict = judge(rising(19, 0.01, 0.9), "short")
    assert not verdict.passed and "only 19 steps" in verdict.line


def test_identical_windows_score_zero_and_a_noiseless_rise_is_infinite() -> None:
    assert judge([0.1] * STEPS, "same").z == 0.0
    steady = judge([0.0] * 10 + [0.5] * (STEPS - 20) + [1.0] * 10, "steps")
    assert steady.passed and math.isinf(steady.z)
