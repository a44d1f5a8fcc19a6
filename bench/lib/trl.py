"""What the TRL benchmarks (``bench/trl_side_by_side.py``, ``bench/trl_many_runs.py``) do
between modes, on the replicas directly: each mode must start from the same clean fleet,
or the previous mode's adapters and cached prefixes would flatter the next.

Imported only by scripts that run with the vLLM venv's python (``rollout_testbed.trl``).
"""

from __future__ import annotations

from rollout_testbed.trl import harness as H
from rollout_testbed.trl import many_runs as M


def clean_fleet(urls: list[str]) -> None:
    """Every replica resumed, its adapters unloaded and its prefix cache reset, directly."""
    for url in urls:
        H.post(url + "/resume")
        H.post(url + "/reset_prefix_cache")
    M.unload_all(urls)
    H.wait_for(lambda: not any(H.replica_adapters(u) for u in urls), 30, "empty replicas")


def last_line(text: str) -> str:
    """The last non-blank line of a child's output: the error a mode's row reports."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""
