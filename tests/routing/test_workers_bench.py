"""``bench/workers_routing.py`` on a tiny workload (a few seconds): its worker pool,
then its fleet variants.

The unit tests (``test_fleet.py``) pin the mechanism; this pins the measured claim on the
bench's own model: N workers with ``set_workers(N)`` and one shared 50 ms snapshot keep a
GRPO group on one replica where the per-worker routers split it, and one worker after
``set_workers(1)`` is the one-process router exactly.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def wr() -> ModuleType:
    return load_bench("workers_routing")


def test_one_worker_is_the_prefix_policy(wr: ModuleType) -> None:
    sim = wr.sim
    groups = sim.Workload("a", 24, seed=5)
    base = sim.simulate(sim.make_policy("prefix", 2), groups, 2, 8)
    row = wr.run_one("a", groups, 2, 1, "local", 0, 1.0)
    assert row["reasons"] == dict(base.reasons)
    assert row["hit_rate"] == sim.summarize(base, 1.0)["hit_rate"]


def test_pool_accounts_and_replays_every_request(wr: ModuleType) -> None:
    groups = wr.sim.Workload("a", 24, seed=5)
    row = wr.run_one("a", groups, 2, 2, "local", 1, 1.0)  # asserts every count returns to 0
    assert row["requests"] == 24 * wr.sim.G
    assert row["replay_requests"] == row["requests"]


def test_one_worker_with_set_workers_is_the_prefix_policy(wr: ModuleType) -> None:
    groups = wr.sim.Workload("a", 32, seed=5)
    local = wr.run_one("a", groups, 4, 1, "local", 0, 1.0)
    for variant in wr.FLEET:
        fleet = wr.run_one("a", groups, 4, 1, variant, 0, 1.0)
        for k in ("reasons", "hit_rate", "served_max_over_mean", "colocation"):
            assert fleet[k] == local[k], (variant, k)


@pytest.mark.parametrize(("workers", "groups"), [(2, 64), (8, 256)])
def test_fleet_snapshot_keeps_groups_whole(wr: ModuleType, workers: int, groups: int) -> None:
    """Past template warm-up (at 8 workers each worker needs ~48 groups to see a template's
    32 successors, hence the longer run) >= 95 % of groups on one replica."""
    work = wr.sim.Workload("a", groups, seed=5)
    before = wr.run_one("a", work, 4, workers, "local", 1, 1.0)
    after = wr.run_one("a", work, 4, workers, "fleet-50ms", 1, 1.0)
    assert after["requests"] == groups * wr.sim.G  # and every count returned to 0 (asserted)
    assert after["groups_whole_after_warmup"] >= 0.95
    assert after["groups_whole_after_warmup"] > before["groups_whole_after_warmup"]
    assert after["replay_requests"] == after["requests"]
    assert after["inflight_max_over_mean"] <= before["inflight_max_over_mean"] + 0.1


def test_tables_models(wr: ModuleType) -> None:
    """The snapshot models: one table is the same object for every worker; a late one lags
    a period."""
    t = wr._Tables("50ms", 4, 2, seed=0)
    t.live[0] = 5
    t.tick(0.06)  # the 50 ms boundary: a snapshot of the counts then
    t.live[0] = 9
    first = t.for_worker(0)
    assert first == {0: 5, 1: 0} and all(t.for_worker(w) is first for w in range(4))
    late = wr._Tables("50ms-late", 4, 2, seed=0)
    late.live[1] = 3
    late.tick(0.06)
    assert late.for_worker(0) == {0: 0, 1: 0}  # still the snapshot taken at 0
