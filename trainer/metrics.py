"""Metric sink with TRL's reduction rules, a JSONL writer, and a Prometheus text parser.

A value is a float (gauge/counter) or a ``(numerator, denominator)`` pair (a rate, reduced
as Σnum/Σden, never as a mean of ratios). Per TRL 1.16 ``_reduce_metric``: a ``total``
word in the last path segment sums (producers push deltas), ``max``/``min`` words take
the extremum, anything else is a window mean.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

__all__ = ["JsonlWriter", "MetricSink", "parse_prometheus", "reduce_metric"]

MetricValue = float | tuple[float, float]


def reduce_metric(key: str, values: list[MetricValue]) -> float:
    if not values:
        return math.nan
    if isinstance(values[0], tuple):
        num = sum(float(v[0]) for v in values if isinstance(v, tuple))
        den = sum(float(v[1]) for v in values if isinstance(v, tuple))
        return num / den if den else math.nan
    floats = [float(v) for v in values if not isinstance(v, tuple)]
    words = key.split("/")[-1].split("_")
    if "total" in words:
        return sum(floats)
    if "max" in words:
        return max(floats)
    if "min" in words:
        return min(floats)
    return sum(floats) / len(floats)


class MetricSink:
    """Thread-safe: the rollout thread pushes, the learner drains once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, list[MetricValue]] = defaultdict(list)

    def add(self, key: str, value: MetricValue) -> None:
        with self._lock:
            self._values[key].append(value)

    def update(self, values: dict[str, MetricValue]) -> None:
        with self._lock:
            for key, value in values.items():
                self._values[key].append(value)

    def drain(self) -> dict[str, float]:
        with self._lock:
            values, self._values = self._values, defaultdict(list)
        out: dict[str, float] = {}
        for key, vals in values.items():
            valid = [v for v in vals if isinstance(v, tuple) or not math.isnan(v)]
            if valid:
                out[key] = reduce_metric(key, valid)
        return out


class JsonlWriter:
    """One JSON object per line, flushed per record so a killed run keeps its history."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = self.path.open("a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}  # fmt: skip
        self._fh.write(json.dumps(clean, sort_keys=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{metric: [(labels, value), ...]}`` from Prometheus text exposition format."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out[m.group(1)].append((labels, value))
    return dict(out)
