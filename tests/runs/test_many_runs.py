"""Several runs share two sim replicas through one gateway (real sockets, in-process):
their own names, keys, homes, pause and staleness window."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from gateway.app import create_app
from gateway.config import ReplicaSpec, load_settings
from gateway.runs.table import owner_of
from gateway.runs.tenancy import Tenant
from tests.cluster import Cluster, cluster, sims
from tests.eventually import eventually

RUNS = ("run-a", "run-b", "run-c")
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}


def run_specs(root: Path, names: tuple[str, ...] = RUNS, staleness: int = 1) -> list[Any]:
    specs = []
    for name in names:
        (root / name).mkdir(exist_ok=True)
        specs.append({"name": name, "key": f"key-{name}", "adapter_root": str(root / name),
                      "max_staleness": staleness})  # fmt: skip
    return specs


def as_run(c: Cluster, name: str) -> httpx.AsyncClient:
    """What TRL does with ``http://NAME:KEY@gateway``: Basic auth."""
    return httpx.AsyncClient(base_url=c.url, auth=(name, f"key-{name}"), timeout=10)


@asynccontextmanager
async def shared(tmp_path: Path, **settings: Any) -> AsyncIterator[Cluster]:
    # 2 replicas of 6 slots, 3 runs of 3 slots (max_staleness 1): only 4 (run, replica)
    # pairs fit, so at least two runs are homed on one replica only.
    settings = {"runs": run_specs(tmp_path), "lora_slots_per_replica": 6, **settings}
    async with cluster(2, **settings) as c:
        yield c


def load(root: Path, run: str, version: int) -> dict[str, Any]:
    return {"lora_name": f"trl-policy-v{version}", "lora_path": f"{root}/{run}/v{version}"}


def replica_names(c: Cluster, index: int) -> list[str]:
    return sorted(c.sim(index).adapters)


def homes(c: Cluster) -> dict[str, set[int]]:
    return {t.name: set(t.homes) for t in c.gateway.tenancy}


async def test_runs_publish_the_same_names_without_colliding(tmp_path: Path) -> None:
    async with shared(tmp_path) as c:
        placed = homes(c)
        assert all(placed.values()) and sum(map(len, placed.values())) == 4, placed
        for version in (1, 2, 3):  # a staleness window of 2 versions per run
            for name in RUNS:
                async with as_run(c, name) as client:
                    r = await client.post(
                        "/v1/load_lora_adapter", json=load(tmp_path, name, version)
                    )
                    assert r.status_code == 200, r.text
                    assert (
                        r.text
                        == f"Success: LoRA adapter 'trl-policy-v{version}' added successfully."
                    )
        await eventually(lambda: all(len(replica_names(c, i)) <= 6 for i in (0, 1)),
                         "evictions back within 6 adapters per replica")  # fmt: skip
        for index in (0, 1):
            names = replica_names(c, index)
            assert len(names) <= 6, names  # the budget
            for name in names:  # every name is exactly one run's, and on its homes only
                assert owner_of(name) in RUNS and index in placed[str(owner_of(name))], name
        for name in RUNS:
            async with as_run(c, name) as client:
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == ["tiny-base", "trl-policy-v2", "trl-policy-v3"]
                gen = await client.post("/v1/completions",
                                        json={**COMPLETION, "model": "trl-policy-v3"})  # fmt: skip
                assert gen.status_code == 200, gen.text
                assert gen.json()["model"] == "trl-policy-v3"  # its own name, not the replica's
                assert int(gen.headers["x-gateway-replica"]) in placed[name]
                info = (await client.get("/server_info", params={"config_format": "json"})).json()
                assert info["vllm_config"]["lora_config"]["max_loras"] == 3  # its share
        for index in (0, 1):
            expected = {f"{run}~trl-policy-v{v}" for run in RUNS if index in placed[run]
                        for v in (2, 3)}  # fmt: skip
            await eventually(partial(_holds, c, index, expected),
                             f"replica {index} holding {sorted(expected)}")  # fmt: skip


async def test_streams_carry_the_runs_own_name(tmp_path: Path) -> None:
    async with shared(tmp_path) as c, as_run(c, "run-b") as client:
        assert (
            await client.post("/v1/load_lora_adapter", json=load(tmp_path, "run-b", 1))
        ).is_success
        body = {**COMPLETION, "model": "trl-policy-v1", "stream": True, "max_tokens": 5}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = b"".join([chunk async for chunk in r.aiter_bytes()])
        assert b"run-b~" not in text and text.count(b'"model":"trl-policy-v1"') >= 5
        assert text.endswith(b"data: [DONE]\n\n")


async def test_a_run_sees_and_controls_only_its_own_names(tmp_path: Path) -> None:
    async with shared(tmp_path) as c:
        async with as_run(c, "run-a") as a:
            assert (
                await a.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", 1))
            ).is_success
        async with as_run(c, "run-b") as b:
            models = (await b.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["tiny-base"]
            gen = await b.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})
            assert gen.status_code == 404, gen.text  # run-a's adapter is not run-b's
            assert gen.json()["error"]["message"] == "The model `trl-policy-v1` does not exist."
            r = await b.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
            assert r.status_code == 404 and "run-a" not in r.text
            outside = {"lora_name": "trl-policy-v1", "lora_path": f"{tmp_path}/run-a/v1"}
            r = await b.post("/v1/load_lora_adapter", json=outside)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        async with as_run(c, "run-a") as a:  # run-a's adapter is untouched
            gen = await a.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})
            assert gen.status_code == 200


@pytest.mark.parametrize(
    "auth",
    [None, ("run-a", "wrong"), ("run-b", "key-run-a"), ("", "nope")],
    ids=["none", "wrong-key", "other-runs-key", "unknown-key"],
)
async def test_requests_without_a_runs_key_are_refused(tmp_path: Path, auth: Any) -> None:
    async with shared(tmp_path) as c, httpx.AsyncClient(base_url=c.url, auth=auth) as client:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("POST", "/pause"), ("POST", "/v1/load_lora_adapter")):  # fmt: skip
            r = await client.request(method, path, json={**COMPLETION, "model": "tiny-base"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert "key-run" not in r.text
        assert (await client.get("/health")).status_code == 200  # probes stay open


async def test_one_runs_pause_does_not_stop_another_run(tmp_path: Path) -> None:
    async with shared(tmp_path) as c, as_run(c, "run-a") as a, as_run(c, "run-b") as b:
        body = {**COMPLETION, "model": "tiny-base"}
        assert (await a.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        sent_before = _sent_to_replicas(c)
        held = asyncio.ensure_future(a.post("/v1/completions", json=body))
        # Positive markers first: run-a's rollout is in the gateway (counted), and then a
        # whole run-b rollout went through the same gateway and a replica. A run-a rollout
        # that was not held would have reached its replica by then, in far fewer steps.
        await eventually(lambda: _run(c, "run-a").in_flight == 1, "run-a's rollout admitted")
        assert (await b.post("/v1/completions", json=body)).status_code == 200  # not frozen
        assert _sent_to_replicas(c) == sent_before + 1  # run-b's only
        assert not held.done()  # run-a's new rollout waits for run-a's /resume
        assert c.gateway.status()["runs"][0]["paused"] is True
        assert not any(c.sim(i).paused for i in (0, 1))  # no replica was paused
        assert (await a.post("/resume")).status_code == 200
        assert (await asyncio.wait_for(held, 5)).status_code == 200


async def test_fleet_pause_is_the_naive_global_pause(tmp_path: Path) -> None:
    async with shared(tmp_path, run_pause="fleet") as c, as_run(c, "run-a") as a:
        assert (await a.post("/pause", params={"mode": "keep"})).status_code == 200
        assert all(c.sim(i).paused for i in (0, 1))  # every replica: every run frozen
        assert (await a.post("/resume")).status_code == 200
        assert not any(c.sim(i).paused for i in (0, 1))


async def test_pause_wait_returns_when_the_runs_rollouts_are_done(tmp_path: Path) -> None:
    slow = SimConfig(latency=LatencyModel(decode=0.25))  # 2 tokens: 0.5 s
    async with shared(tmp_path, sim_config=slow) as c, as_run(c, "run-a") as a:
        body = {**COMPLETION, "model": "tiny-base"}
        running = asyncio.ensure_future(a.post("/v1/completions", json=body))
        await eventually(lambda: _run(c, "run-a").in_flight == 1, "run-a's rollout admitted")
        assert (await a.post("/pause", params={"mode": "wait"})).status_code == 200
        assert running.done() and (await running).status_code == 200
        r = await a.post("/pause", params={"mode": "sideways"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
        assert (await a.post("/resume")).status_code == 200


async def test_a_run_that_cannot_fit_gets_a_clear_error_naming_the_budget(tmp_path: Path) -> None:
    # one replica of 6 slots; three runs of 3: the third cannot be placed
    specs = run_specs(tmp_path)
    async with cluster(1, runs=specs, lora_slots_per_replica=6) as c:
        unplaced = [t.name for t in c.gateway.tenancy if not t.homes]
        assert len(unplaced) == 1
        async with as_run(c, unplaced[0]) as client:
            r = await client.post("/v1/load_lora_adapter", json=load(tmp_path, unplaced[0], 1))
            assert r.status_code == 507, r.text
            message = r.json()["error"]["message"]
            assert "needs 3 adapter slots" in message and "budget is 6" in message
            info = (await client.get("/server_info", params={"config_format": "json"})).json()
            assert info["vllm_config"]["lora_config"]["max_loras"] < 3  # TRL's check fails too
            gen = await client.post("/v1/completions", json={**COMPLETION, "model": "tiny-base"})
            assert gen.status_code == 507
        assert c.sim(0).stats.loads == []  # nothing half-placed


async def test_leftovers_no_run_owns_are_swept_at_start(tmp_path: Path) -> None:
    """Replicas that served a single-run gateway hold its adapters; once they are shared
    by runs, those take nobody's slot."""
    async with sims(2) as replicas:
        urls = [r.url for r in replicas]
        single = create_app(load_settings({"replicas": urls}, environ={}))
        async with serve_asgi(single) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"lora_name": "trl-policy-v1", "lora_path": "/x"}
            assert (await client.post("/v1/load_lora_adapter", json=body)).is_success
        assert all("trl-policy-v1" in r.app.state.sim.adapters for r in replicas)
        overrides = {"replicas": urls, "runs": run_specs(tmp_path), "lora_slots_per_replica": 6}
        shared_app = create_app(load_settings(overrides, environ={}))
        async with serve_asgi(shared_app):
            assert not any(r.app.state.sim.adapters for r in replicas)


async def test_per_run_metrics_and_status(tmp_path: Path) -> None:
    async with shared(tmp_path, admin_key="the-admin") as c, as_run(c, "run-c") as client:
        assert (
            await client.post("/v1/load_lora_adapter", json=load(tmp_path, "run-c", 1))
        ).is_success
        body = {**COMPLETION, "model": "trl-policy-v1"}
        assert (await client.post("/v1/completions", json=body)).is_success
        own = (await client.get("/gateway/status")).json()  # a run sees itself only
        assert [r["name"] for r in own["runs"]] == ["run-c"]
        assert own["runs"][0]["live"] == ["trl-policy-v1"] and own["lora_slots_per_replica"] == 6
        assert "run-a" not in str(own) and "run-c~" not in str(own)
        admin = httpx.AsyncClient(base_url=c.url, headers={"authorization": "Bearer the-admin"})
        async with admin:
            every = (await admin.get("/gateway/status")).json()
        assert [r["name"] for r in every["runs"]] == list(RUNS)
        metrics = (await client.get("/metrics")).text
        assert 'gateway_run_requests_total{run="run-c"} 1.0' in metrics
        assert 'gateway_run_live_adapters{run="run-c"} 1.0' in metrics
        assert 'gateway_run_home_replicas{run="run-a"}' in metrics
        assert "key-run" not in metrics and "the-admin" not in metrics


def _holds(c: Cluster, index: int, names: set[str]) -> bool:
    return set(replica_names(c, index)) == names


def _run(c: Cluster, name: str) -> Tenant:
    return c.gateway.tenancy.tenants[name]


def _sent_to_replicas(c: Cluster) -> int:
    """Completions the sims received, all runs together."""
    return sum(c.sim(i).stats.requests_by_model.total() for i in range(len(c.replicas)))


async def test_replicas_leaving_and_joining_re_place_the_runs(tmp_path: Path) -> None:
    """Discovery's membership changes: the runs are re-placed with the budget held, a run
    that no longer fits is told so, and a gained home gets its run's live versions
    replayed before it serves that run."""
    async with shared(tmp_path) as c:
        for name in RUNS:
            async with as_run(c, name) as client:
                assert (await client.post("/v1/load_lora_adapter",
                                          json=load(tmp_path, name, 1))).is_success  # fmt: skip
        gw = c.gateway
        specs = [ReplicaSpec(url=u) for u in c.replica_urls]
        await gw.health.apply_membership(specs[:1])  # replica 1 leaves
        placed = homes(c)
        assert sorted(len(h) for h in placed.values()) == [0, 1, 1]  # 6 slots: two runs fit
        assert all(h <= {0} for h in placed.values())
        left_out = next(name for name, h in placed.items() if not h)
        async with as_run(c, left_out) as client:
            r = await client.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})
            assert r.status_code == 507 and "budget is 6" in r.json()["error"]["message"]
        await gw.health.apply_membership(specs)  # it comes back (as a new member)
        await gw.health.round()
        placed = homes(c)
        assert all(placed.values()) and sum(map(len, placed.values())) == 4
        for name in RUNS:
            async with as_run(c, name) as client:
                r = await client.post("/v1/completions",
                                      json={**COMPLETION, "model": "trl-policy-v1"})  # fmt: skip
                assert r.status_code == 200, (name, r.text)
        index = max(r.index for r in gw.pool.replicas)
        owners = {owner_of(n) for n in c.sim(1).adapters}
        assert owners == {t.name for t in gw.tenancy if index in t.homes}


async def test_a_budget_above_the_replicas_max_loras_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the sims report max_loras 6 (SimConfig's default); the default budget is that
    async with cluster(1, runs=run_specs(tmp_path, ("run-a",))) as c:
        assert c.gateway.tenancy.budget == 6
    caplog.clear()
    async with cluster(1, runs=run_specs(tmp_path, ("run-a",)), lora_slots_per_replica=9):
        pass
    assert any("more than a replica's max_loras=6" in r.getMessage() for r in caplog.records)
