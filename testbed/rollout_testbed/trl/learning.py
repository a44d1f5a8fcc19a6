"""Did a TRL run's policy learn? The one rule, for the TRL layer and the chaos benchmark.

The TRL layer asserts it (``tests/trl/checks.py``) and ``bench/chaos.py`` reports it as a
goal. It lives here, in the package both already import, so that a benchmark's verdict and
CI's cannot drift apart and ``bench/`` need not import ``tests/``. Standard library only:
it is judged on a list of rewards, no trainer needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from statistics import variance as var

Z_RUN = 3.0  # one run alone, and several runs' per-step means together
Z_EACH = 2.5  # each of several runs sharing the fleet
STEPS = 60  # every learning run's length in the TRL layer: the rates below are at 60 steps
WINDOW = 10  # steps compared at each end


@dataclass(frozen=True)
class Verdict:
    """The rule's answer: whether it passed, the run's z, and one line for the record."""

    passed: bool
    z: float
    line: str


def judge(rewards: Sequence[float], what: str, *, z: float = Z_RUN) -> Verdict:
    """The policy learned: the last 10 steps' mean reward is above the first 10 steps' by
    more than ``z`` standard errors (Welch). The gain (last over first) is in the line for
    the record, not judged. Fewer than 20 steps fail: the two windows would overlap.

    Its error rates, stated so that a failure can be weighed:

    - **False pass** (a run that does not learn, e.g. rollouts served by the wrong
      weights, passes): its z is about N(0, 1), so P(z > 3) = 0.13 % for one run, and
      P(z > 2.5) = 0.62 % for each of several runs (whose per-step means must also clear
      3). A gain floor would not lower either: under that null z binds first.
    - **False failure** (a run that learns as CI's runs do, fails): what decides it is
      how late a run on the tiny model takes off, and the reward grows about e-fold every
      10 steps once it does. At 50 steps eleven recorded happy-path gains (1.99-27.3x)
      fit a log-normal with mean ln 1.59, sd 0.79: the 1.25x floor that rule had failed
      4.1 % of runs, twice per CI run. At 60 steps (``STEPS``) the recorded z of the
      three-run test's runs (6.2-20.7, eight known values) fit a log-normal with mean
      ln 2.33, sd 0.40: P(z < 3) = 0.10 %, P(z < 2.5) = 0.02 %. Per CI run: the
      happy-path run 0.10 %, the three runs 0.06 %, their per-step means under 0.01 %:
      about 0.16 % (0.26 % while a second layer ran the happy path again).
    """
    if len(rewards) < 2 * WINDOW:
        return Verdict(False, 0.0, f"{what}: only {len(rewards)} steps (the rule needs 20)")
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    rise, se = mean(last) - mean(first), math.sqrt(var(first) / WINDOW + var(last) / WINDOW)
    score = rise / se if se else math.copysign(math.inf, rise) if rise else 0.0
    line = (f"{what}: reward first 10 {mean(first):.4f} -> last 10 {mean(last):.4f} "
            f"({mean(last) / mean(first) if mean(first) else math.inf:.2f}x, z {score:.1f}; "
            f"needs z > {z:g})")  # fmt: skip
    return Verdict(rise > z * se, score, line)
