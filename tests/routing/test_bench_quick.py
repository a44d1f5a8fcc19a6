"""Smoke-run ``bench/routing.py --quick`` in-process and assert the issue's targets on (a)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    data: dict[str, Any] = load_bench("routing").run(quick=True)
    return data


@pytest.mark.parametrize("n", [2, 4])
def test_grpo_targets(quick: dict[str, Any], n: int) -> None:
    ours = quick["runs"][f"a/N={n}"]["prefix"]
    assert ours["colocation"] >= 0.99
    assert ours["spill"] <= 0.01
    assert ours["hit_vs_oracle"] >= 0.98
    assert ours["served_max_over_mean"] <= 1.25


def test_other_workloads(quick: dict[str, Any]) -> None:
    assert quick["runs"]["b/N=2"]["prefix"]["continuation_same_replica"] >= 0.99
    assert quick["runs"]["c/N=2"]["prefix"]["served_max_over_mean"] <= 1.25
    for n, moved in quick["keys_moved"].items():
        assert moved["moved_fraction"] <= 1.2 / int(n)
