"""A vLLM replica's ``vllm:*`` counters, each summed over its labels, from ``/metrics``.

What the benchmarks on real or simulated replicas read before and after a window (prefix
cache queries and hits, above all) to take the difference: one parser, so that two
results' hit rates are read the same way.
"""

from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def counters(url: str) -> dict[str, float]:
    """``{name: value summed over labels}`` of every ``vllm:`` sample the replica exports."""
    return summed(httpx.get(url + "/metrics", timeout=30).text)


def summed(text: str) -> dict[str, float]:
    """``{name: value summed over labels}`` of the ``vllm:`` samples in a Prometheus text."""
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    return out
