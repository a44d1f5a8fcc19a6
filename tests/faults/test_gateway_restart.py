"""Fault 5: the gateway is SIGKILLed mid-run and restarted on the same port.

The gateway keeps no state of its own: the restarted process rebuilds its adapter registry
from the replicas' ``/v1/models``. Proven here with real processes: after the restart the
trainer's next calls succeed (rollouts, the next adapter version, staleness eviction), no
adapter is lost or loaded twice, and a restart in the middle of an adapter fan-out (one
replica has the new version, the other is still loading it) converges to the version
being on every replica -- never routable on only some.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from tests.eventually import eventually
from tests.faults.procs import Fleet, Load, fleet

LATENCY = "decode=0.01"


async def _model_ids(f: Fleet) -> list[str]:
    r = await f.client.get("/v1/models")
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


async def _holding(f: Fleet, name: str) -> list[int]:
    return [i for i in range(len(f.sims)) if name in await f.held(i)]


async def _idle(f: Fleet) -> bool:
    stats = [await f.sim_stats(i) for i in range(len(f.sims))]
    return all(s["running"] == 0 and s["waiting"] == 0 for s in stats)


async def _complete(f: Fleet, model: str) -> int:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
    return (await f.client.post("/v1/completions", json=body)).status_code


async def test_gateway_sigkill_mid_run_rebuilds_from_replicas(tmp_path: Path) -> None:
    async with fleet(tmp_path, 2, latency=LATENCY, gateway_args=["--max-staleness", "1"]) as f:
        for v in (1, 2):
            assert (await f.load(f"pol-v{v}")).status_code == 200
        load = Load(f, workers=8, models=["tiny-base", "pol-v2"], seed=5, request_timeout=10)
        try:
            await eventually(lambda: _busy(f), "rollouts in flight on the replicas")
            before: list[dict[str, Any]] = [await f.sim_stats(i) for i in range(2)]
            await f.restart_gateway(kill=True)
        finally:
            cut = await load.stop()
        # Rollouts in flight died with the gateway: the client saw an error, not a hang,
        # and the replicas aborted the orphaned generations.
        assert any(o.error for o in cut), "no rollout was cut by the kill"
        assert all(o.ended is not None and o.ended - o.started < 10 for o in cut)
        await eventually(lambda: _idle(f), "replicas to abort orphaned generations")

        # Rebuilt, nothing lost or loaded twice.
        ids = await _model_ids(f)
        assert Counter(ids) == {"tiny-base": 1, "pol-v1": 1, "pol-v2": 1}, ids
        for i in range(2):
            stats = await f.sim_stats(i)
            assert stats["adapters"] == {"pol-v1": "/adapters/pol-v1",
                                         "pol-v2": "/adapters/pol-v2"}  # fmt: skip
            assert stats["loads"] == before[i]["loads"] == ["pol-v1", "pol-v2"], stats
            assert stats["unloads"] == before[i]["unloads"] == [], stats
        assert await f.routable("pol-v2") == [0, 1]

        # The trainer's next calls succeed: rollouts, the next version, eviction of v1.
        again = Load(f, workers=4, models=["tiny-base", "pol-v2"], seed=6)
        try:
            await eventually(lambda: _served_at_least(again, 40), "40 rollouts")
        finally:
            after = await again.stop()
        assert {o.status for o in after} == {200} and not [o for o in after if o.error]
        assert (await f.load("pol-v3")).status_code == 200
        assert await _complete(f, "pol-v3") == 200
        await eventually(
            lambda: _holds_exactly(f, {"pol-v2", "pol-v3"}), "pol-v1 evicted everywhere"
        )
        # retired: served by the oldest live version (docs/adapters.md, "Retired versions")
        assert await _complete(f, "pol-v1") == 200
        assert await _complete(f, "pol-v9") == 404  # never published
        assert Counter(await _model_ids(f)) == {"tiny-base": 1, "pol-v2": 1, "pol-v3": 1}
        assert f.gateway_errors() == []


async def test_gateway_sigkill_mid_fan_out_converges(tmp_path: Path) -> None:
    async with fleet(tmp_path, 2, gateway_args=["--max-staleness", "2"]) as f:
        assert (await f.load("pol-v1")).status_code == 200
        await f.faults(1, load_hang=1)  # replica 1 holds the load until cleared
        loading = asyncio.create_task(f.load("pol-v2"))
        await eventually(lambda: _has(f, 0, "pol-v2"), "replica 0 to hold pol-v2")
        await eventually(lambda: _asked(f, 1, "pol-v2"), "replica 1 to have the load call")
        assert "pol-v2" not in await f.held(1)  # replica 1 is still loading it
        f.gateway.kill()  # mid fan-out: pol-v2 is on replica 0 only
        outcome = await asyncio.gather(loading, return_exceptions=True)
        assert isinstance(outcome[0], Exception), "the trainer's load cannot have succeeded"
        await f.clear_faults(1)
        await f.restart_gateway(kill=False)

        # Never routable on only some replicas, until it is on all of them.
        async def converged() -> bool:
            routable = await f.routable("pol-v2")
            holding = await _holding(f, "pol-v2")
            assert set(routable) <= set(holding), (routable, holding)
            return routable == holding == [0, 1]

        await eventually(converged, "pol-v2 on both replicas", interval=0.05)
        # TRL retries a failed load with the same name and path: that must succeed too,
        # and leave exactly one copy per replica.
        assert (await f.load("pol-v2")).status_code == 200
        assert await _complete(f, "pol-v2") == 200
        assert Counter(await _model_ids(f)) == {"tiny-base": 1, "pol-v1": 1, "pol-v2": 1}
        for i in range(2):
            assert set(await f.held(i)) == {"pol-v1", "pol-v2"}
        assert f.gateway_errors() == []


async def _busy(f: Fleet) -> bool:
    stats = [await f.sim_stats(i) for i in range(2)]
    return all(s["running"] >= 1 for s in stats)


async def _asked(f: Fleet, index: int, name: str) -> bool:
    return name in (await f.sim_stats(index))["loads"]


async def _has(f: Fleet, index: int, name: str) -> bool:
    return name in await f.held(index)


async def _holds_exactly(f: Fleet, names: set[str]) -> bool:
    return [set(await f.held(i)) for i in range(len(f.sims))] == [names] * len(f.sims)


async def _served_at_least(load: Load, n: int) -> bool:
    return len(load.outcomes) >= n
