"""The adapter facade over real sockets: ``AdapterManager`` -> ``Upstream`` -> sim replicas."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.state import SimState

from gateway.adapters.checks import check_capacity, parse_models
from gateway.adapters.manager import AdapterManager
from gateway.adapters.state import AdapterPolicy, ReplicaState
from gateway.config import load_settings
from gateway.errors import BadRequest, BroadcastFailed, NotFound, UpstreamTimeout
from gateway.fleet.replicas import ReplicaPool
from gateway.http.upstream import Upstream, make_session
from tests.cluster import SimReplica

FAST = AdapterPolicy(
    max_staleness=1,
    load_deadline_s=2.0,
    retry_initial_s=0.01,
    retry_max_s=0.05,
    unload_grace_s=0.05,
)


@dataclass
class Rig:
    manager: AdapterManager
    replicas: list[SimReplica]

    def sim(self, i: int) -> SimState:
        state: SimState = self.replicas[i].app.state.sim
        return state

    def held(self, i: int) -> dict[str, str]:
        return {a.name: a.path for a in self.sim(i).adapters.values()}


@contextlib.asynccontextmanager
async def rig(
    n: int = 2, policy: AdapterPolicy = FAST, roots: tuple[Path, ...] = (), rebuild: bool = True
) -> AsyncIterator[Rig]:
    replicas = [SimReplica(create_sim_app(SimConfig(max_loras=4))) for _ in range(n)]
    for r in replicas:
        await r.start()
    settings = load_settings(
        {"replicas": [r.url for r in replicas], "connect_timeout_s": 5.0}, environ={}
    )
    upstream = Upstream(ReplicaPool.from_settings(settings), lambda: make_session(settings))
    manager = AdapterManager(
        upstream, range(n), policy=policy, call_timeout_s=5.0, adapter_roots=roots
    )
    try:
        if rebuild:
            await manager.rebuild()
        yield Rig(manager, replicas)
    finally:
        await manager.aclose()
        await upstream.aclose()
        for r in replicas:
            with contextlib.suppress(Exception):
                await r.stop()


def body(v: int, root: str = "/runs/a") -> dict[str, object]:
    return {"lora_name": f"pol-v{v}", "lora_path": f"{root}/pol-v{v}", "load_inplace": False}


async def test_load_goes_live_everywhere_with_vllm_reply() -> None:
    async with rig() as t:
        reply = await t.manager.load(body(1))
        assert reply == (200, "text/plain; charset=utf-8",
                         b"Success: LoRA adapter 'pol-v1' added successfully.")  # fmt: skip
        assert t.held(0) == t.held(1) == {"pol-v1": "/runs/a/pol-v1"}
        assert t.manager.candidates("pol-v1") == {0, 1}
        assert t.manager.candidates("tiny-base") is None  # learnt from /v1/models
        assert t.manager.candidates("pol-v9") == frozenset()
        assert [a.name for a in t.manager.live_adapters()] == ["pol-v1"]


async def test_mount_lag_three_times_then_ok() -> None:
    async with rig() as t:
        t.sim(1).faults.load_not_found = 3
        reply = await t.manager.load(body(1))
        assert reply.status == 200
        assert t.sim(1).stats.loads.count("pol-v1") == 4
        assert t.sim(0).stats.loads.count("pol-v1") == 1
        assert t.manager.snapshot().counts["load.retry_not_found"] == 3


async def test_engine_error_rolls_back_and_names_the_replica() -> None:
    async with rig(3) as t:
        t.sim(1).faults.load_error = 1
        with pytest.raises(BroadcastFailed) as info:
            await t.manager.load(body(1))
        message = info.value.message
        assert "replica 1" in message and "HTTP 500" in message
        assert "Rolled back on replicas 0, 2" in message
        assert "127.0.0.1" not in message
        assert all(t.held(i) == {} for i in range(3))
        assert t.manager.candidates("pol-v1") == frozenset()


async def test_mount_lag_past_deadline_is_504_not_404() -> None:
    policy = AdapterPolicy(load_deadline_s=0.2, retry_initial_s=0.02, retry_max_s=0.05)
    async with rig(policy=policy) as t:
        t.sim(0).faults.load_not_found = -1
        with pytest.raises(UpstreamTimeout) as info:
            await t.manager.load(body(1))
        assert info.value.status == 504
        assert "replica 0" in info.value.message
        assert t.held(1) == {}


async def test_duplicate_name_is_reloaded_in_place() -> None:
    async with rig() as t:
        await t.manager.load(body(1))
        reply = await t.manager.load(body(1, root="/runs/b"))  # a new run, same name
        assert reply.status == 200
        assert t.held(0) == t.held(1) == {"pol-v1": "/runs/b/pol-v1"}
        assert t.sim(0).stats.unloads == []  # never unloaded: no 404 gap


async def test_unload_is_immediate_and_applied_after_drain() -> None:
    async with rig() as t:
        await t.manager.load(body(1))
        assert t.manager.request_started("pol-v1", 0)
        reply = await t.manager.unload({"lora_name": "pol-v1"})
        assert reply.content == b"Success: LoRA adapter 'pol-v1' removed successfully."
        await t.manager.executor.wait_until(lambda: "pol-v1" not in t.held(1))
        assert "pol-v1" in t.held(0)  # a request is in flight there
        t.manager.request_finished("pol-v1", 0)
        t.manager.tick()
        await t.manager.executor.wait_until(lambda: "pol-v1" not in t.held(0))
        assert (await t.manager.unload({"lora_name": "pol-v1"})).status == 200
        with pytest.raises(NotFound):
            await t.manager.unload({"lora_name": "never-loaded"})


async def test_staleness_window_is_enforced_by_the_gateway() -> None:
    async with rig() as t:
        for v in range(1, 5):
            await t.manager.load(body(v))
        await t.manager.executor.wait_until(lambda: len(t.held(0)) == len(t.held(1)) == 2)
        assert set(t.held(0)) == set(t.held(1)) == {"pol-v3", "pol-v4"}


async def test_restarted_replica_is_reconciled_before_admission() -> None:
    async with rig() as t:
        await t.manager.load(body(1))
        await t.manager.load(body(2))
        await t.replicas[1].stop()
        t.sim(1).adapters.clear()  # vLLM restarts empty
        await t.manager.sync_replicas([0])
        assert t.manager.candidates("pol-v2") == {0}
        await t.replicas[1].start()
        await t.manager.sync_replicas([0, 1])
        assert t.manager.snapshot().replicas[1].state is ReplicaState.UP
        assert t.held(1) == {"pol-v1": "/runs/a/pol-v1", "pol-v2": "/runs/a/pol-v2"}
        assert t.manager.candidates("pol-v2") == {0, 1}


async def test_unreachable_replica_does_not_fail_the_load() -> None:
    async with rig() as t:
        await t.replicas[1].stop()
        reply = await t.manager.load(body(1))  # the health loop has not noticed yet
        assert reply.status == 200
        assert t.manager.candidates("pol-v1") == {0}
        assert t.manager.snapshot().replicas[1].state is ReplicaState.DOWN


async def test_gateway_restart_rebuilds_from_replicas() -> None:
    async with rig() as t:
        for v in (1, 2):
            await t.manager.load(body(v))
        t.sim(1).adapters.pop("pol-v1")  # partial state, e.g. a crash mid-fan-out
        fresh = AdapterManager(t.manager._upstream, range(2), policy=FAST, call_timeout_s=5.0)
        try:
            await fresh.rebuild()
            assert [a.name for a in fresh.live_adapters()] == ["pol-v1", "pol-v2"]
            assert t.held(1) == {"pol-v1": "/runs/a/pol-v1", "pol-v2": "/runs/a/pol-v2"}
            assert fresh.candidates("pol-v1") == {0, 1}
        finally:
            await fresh.aclose()


async def test_adapter_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "pol-v1").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "sneaky").symlink_to(outside)
    async with rig(roots=(root,)) as t:
        assert (await t.manager.load(body(1, root=str(root)))).status == 200
        for path in (str(outside), str(root / "sneaky"), f"{root}/../elsewhere", "relative/x"):
            with pytest.raises(BadRequest):
                await t.manager.load({"lora_name": "pol-v2", "lora_path": path})
        assert t.sim(0).stats.loads == ["pol-v1"]  # nothing else went upstream


@pytest.mark.parametrize(
    "payload",
    [{}, {"lora_name": "x"}, {"lora_name": 3, "lora_path": "/p"},
     {"lora_name": "x", "lora_path": "/p", "load_inplace": "yes"}],
)  # fmt: skip
async def test_bad_load_bodies(payload: dict[str, object]) -> None:
    async with rig(1) as t:
        with pytest.raises(BadRequest):
            await t.manager.load(payload)
        assert t.sim(0).stats.loads == []


def test_parse_models_and_capacity() -> None:
    content = orjson.dumps(
        {"data": [{"id": "base", "root": "/m", "parent": None},
                  {"id": "pol-v1", "root": "/a/pol-v1", "parent": "base"}]}
    )  # fmt: skip
    adapters, bases = parse_models(content)
    assert [(a.name, a.path) for a in adapters] == [("pol-v1", "/a/pol-v1")]
    assert bases == ["base"]
    infos = {
        0: {"vllm_config": {"lora_config": {"max_loras": 3, "max_cpu_loras": None}}},
        1: {"vllm_config": {"lora_config": None}},
        2: {"vllm_config": {"lora_config": {"max_loras": 8, "max_cpu_loras": 8}}},
    }
    warnings = check_capacity(infos, max_staleness=2)
    assert len(warnings) == 3 and all("replica 2" not in w for w in warnings)
    assert check_capacity(infos, max_staleness=None) == []


async def test_status_is_json_ready() -> None:
    async with rig() as t:
        await t.manager.load(body(1))
        status = t.manager.status()
        orjson.dumps(status)
        assert status["live_versions"] == {"pol": 1}


async def test_sim_over_http_sanity() -> None:
    """The rig's replicas really are vLLM-shaped: /v1/models lists what we loaded."""
    async with rig(1) as t:
        await t.manager.load(body(1))
        async with httpx.AsyncClient(base_url=t.replicas[0].url) as client:
            models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-base", "pol-v1"]
