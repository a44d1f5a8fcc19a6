"""Paired rounds: every variant (front, tree, configuration) measured once per round, the
order rotated from round to round (ABC, BCA, CAB), and figures taken as medians over
rounds, ratios per round first.

Why: on a shared 2-core VM the host's noise drifts over minutes. Variants measured side by
side within a round see the same noise, so a ratio taken per round cancels most of it; the
rotation keeps any variant from always running first (cold) or last (after the others
heated the machine).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def med(values: Iterable[float]) -> float:
    """Median to 4 places, NaN values dropped (NaN if none is left)."""
    vals = [float(v) for v in values if v == v]
    return round(statistics.median(vals), 4) if vals else float("nan")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order: ``items`` rotated left by ``r``."""
    if not items:
        return []
    k = r % len(items)
    return [*items[k:], *items[:k]]


@dataclass
class Budget:
    """Wall-clock seconds for a whole run; ``reserve`` is kept for what follows the rounds."""

    seconds: float
    reserve: float = 0.0
    t0: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.reserve - self.elapsed()


def paired_rounds(
    items: Sequence[T],
    rounds: int,
    budget: Budget | None = None,
    log: list[dict[str, Any]] | None = None,
    key: Callable[[T], Any] = lambda item: item,
) -> Iterator[tuple[int, list[T], dict[str, Any]]]:
    """``(r, order, note)`` for each round, as long as ``budget`` leaves time for one more of
    the longest so far (the first round always runs). ``note`` (round, order by ``key``,
    then its duration and the load average at its end) goes to ``log``; the caller may add
    to it."""
    longest = 0.0
    for r in range(rounds):
        if r and budget is not None and budget.left() < longest:
            print(f"budget reached: stopping after {r} rounds", file=sys.stderr)
            return
        t, order = time.monotonic(), rotated(items, r)
        note: dict[str, Any] = {"round": r + 1, "order": [key(i) for i in order]}
        yield r, order, note
        longest = max(longest, time.monotonic() - t)
        note.update(
            duration_s=round(time.monotonic() - t, 1),
            loadavg_at_end=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        )
        if log is not None:
            log.append(note)


def ratio_per_round(
    rounds: Sequence[dict[str, Any]], a: str, b: str, value: Callable[[Any], float]
) -> float:
    """Median over the rounds holding both ``a`` and ``b`` of value(a) / value(b)."""
    return med(value(r[a]) / value(r[b]) for r in rounds if a in r and b in r and value(r[b]))
