"""Reward scoring, executed in the reward worker process.

Kept free of torch and aiohttp imports: the spawned process unpickles these functions by
module path, so whatever this module imports is what that process pays for at start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ping", "score_group"]


def ping() -> bool:
    """Warms the reward process up (spawn + imports) before the first group needs it."""
    return True


def score_group(
    reward_funcs: Sequence[Callable[..., list[float | None]]],
    completions: list[str],
    prompts: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> tuple[list[float], dict[str, float]]:
    """Sum of the reward functions per sample, plus each function's mean.

    As in TRL: ``None`` from a function is ignored for that sample; a sample no function
    could score is NaN (its advantage becomes 0).
    """
    per_func: dict[str, float] = {}
    columns_out: list[list[float]] = []
    for func in reward_funcs:
        vals = func(
            completions=completions, prompts=prompts, completion_ids=completion_ids, **columns
        )
        col = [math.nan if v is None else float(v) for v in vals]
        columns_out.append(col)
        name = getattr(func, "__name__", type(func).__name__)
        scored = [v for v in col if not math.isnan(v)]
        per_func[f"rewards/{name}"] = sum(scored) / len(scored) if scored else math.nan
    totals: list[float] = []
    for i in range(len(completions)):
        vals = [col[i] for col in columns_out if not math.isnan(col[i])]
        totals.append(sum(vals) if vals else math.nan)
    return totals, per_func
