"""Smoke-test ``bench/workers_routing.py``'s worker pool on a tiny workload (< 1 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "workers_routing.py"


@pytest.fixture(scope="module")
def wr() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_workers_routing", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_workers_routing"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_one_worker_is_the_prefix_policy(wr: ModuleType) -> None:
    sim = wr.sim
    groups = sim.Workload("a", 24, seed=5)
    base = sim.simulate(sim.make_policy("prefix", 2), groups, 2, 8)
    row = wr.run_one("a", groups, 2, 1, "local", 0, 1.0)
    assert row["reasons"] == dict(base.reasons)
    assert row["hit_rate"] == sim.summarize(base, 1.0)["hit_rate"]


@pytest.mark.parametrize("variant", ["local", "shared-templates", "shared"])
def test_pool_accounts_and_shared_index_agrees(wr: ModuleType, variant: str) -> None:
    groups = wr.sim.Workload("a", 24, seed=5)
    row = wr.run_one("a", groups, 2, 2, variant, 1, 1.0)  # asserts every count returns to 0
    assert row["requests"] == 24 * wr.sim.G
    if variant == "shared":
        assert row["colocation"] >= 0.99
    else:
        assert row["replay_requests"] == (row["requests"] if variant == "local" else 0)
