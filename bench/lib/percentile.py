"""The percentile most benchmarks quote: the value at rank ``int(q * n)`` of the sorted
sample (``q`` a fraction: 0.99 for p99), the highest value once ``q * n`` reaches ``n``.

One definition, so that two results' p99 mean the same thing. ``bench/soak.py``,
``bench/adapters.py`` and ``bench/lib/load.py`` keep their own (nearest rank, and
interpolated rank): their committed results were computed so, and changing the rule would
change figures the docs quote.
"""

from __future__ import annotations

from collections.abc import Iterable


def pct(values: Iterable[float], q: float) -> float:
    """The ``q`` percentile (0 <= q <= 1) of ``values``, in any order; ValueError if empty."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def pct_or_none(values: Iterable[float], q: float, digits: int) -> float | None:
    """``pct`` rounded to ``digits``, or None for no values (a JSON result's ``null``)."""
    xs = list(values)
    return round(pct(xs, q), digits) if xs else None
