"""Pause/resume semantics, fault injection (Python and /sim HTTP), counters, health."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel
from rollout_testbed.sim.testing import SimURL, running_sim

from tests.eventually import eventually

BODY = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}


async def test_pause_keep_holds_new_requests_until_resume(
    sim: SimURL, client: httpx.AsyncClient
) -> None:
    r = await client.post("/pause", params={"mode": "keep"})
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    task = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await eventually(lambda: sim.sim.waiting == 1, "the request held (waiting)")
    metrics = (await client.get("/metrics")).text
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny-base"} 1.0' in metrics
    assert not task.done()
    assert (await client.post("/resume")).json() == {"status": "resumed"}
    r = await task
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/is_paused")).json() == {"is_paused": False}
    assert sim.sim.stats.pauses == ["keep"] and sim.sim.stats.resumes == 1


async def _slow_stream(url: SimURL, pause_mode: str, max_tokens: int) -> list[str]:
    """Start a slow stream, pause with ``pause_mode`` after its first chunk, resume, and
    return the finish_reasons seen."""
    reasons: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        body = {**BODY, "max_tokens": max_tokens, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            await anext(lines)
            pause = await client.post("/pause", params={"mode": pause_mode})
            assert pause.status_code == 200
            if pause_mode == "keep":
                assert url.sim.running == 1  # frozen, not finished
                await client.post("/resume")
            async for line in lines:
                if line.startswith("data: {"):
                    reasons.append(line.split('"finish_reason":')[1].split(",")[0])
        if pause_mode != "keep":
            await client.post("/resume")
    return reasons


@pytest.mark.parametrize(
    ("mode", "last"), [("keep", '"length"'), ("abort", '"abort"'), ("wait", '"length"')]
)
async def test_pause_modes_on_in_flight_stream(mode: str, last: str) -> None:
    cfg = SimConfig(latency=LatencyModel(decode=0.01))
    async with running_sim(cfg) as url:
        reasons = await _slow_stream(url, mode, max_tokens=8)
        assert reasons[-1] == last
        assert url.sim.running == 0


async def test_pause_clear_cache(sim: SimURL, client: httpx.AsyncClient) -> None:
    prompt = {"prompt": list(range(8)), "max_tokens": 1}
    await client.post("/v1/completions", json=prompt)
    await client.post("/pause", params={"mode": "keep"})
    await client.post("/resume")
    assert len(sim.sim.cache) == 2  # keep never clears
    await client.post("/pause", params={"mode": "abort", "clear_cache": "false"})
    await client.post("/resume")
    assert len(sim.sim.cache) == 2
    await client.post("/pause")  # default: abort + clear_cache
    await client.post("/resume")
    assert len(sim.sim.cache) == 0


async def test_bad_pause_mode_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/pause", params={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.mode"


async def test_load_faults_over_http(sim: SimURL, client: httpx.AsyncClient) -> None:
    r = await client.post("/sim/faults", json={"load_not_found": 2, "load_error": 1})
    assert r.status_code == 200 and r.json()["load_not_found"] == 2
    load = {"lora_name": "v1", "lora_path": "/mnt/v1"}
    statuses = [
        (await client.post("/v1/load_lora_adapter", json=load)).status_code for _ in range(4)
    ]
    assert statuses == [404, 404, 500, 200]
    assert sim.sim.stats.loads == ["v1"] * 4
    stats = (await client.get("/sim/stats")).json()
    assert stats["adapters"] == {"v1": "/mnt/v1"} and stats["loads"] == ["v1"] * 4


async def test_load_not_found_body_matches_vllm(sim: SimURL, client: httpx.AsyncClient) -> None:
    sim.sim.faults.load_not_found = 1
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": "/p"})
    assert r.json()["error"] == {
        "message": "Loading lora v failed: No adapter found for /p",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


async def test_permanent_fault_until_cleared(sim: SimURL, client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"completion_error": -1, "completion_error_status": 503})
    for _ in range(2):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "InternalServerError"
    assert (await client.delete("/sim/faults")).json()["completion_error"] == 0
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert sim.sim.stats.requests_by_model["tiny-base"] == 3


async def test_hang_until_cleared(sim: SimURL, client: httpx.AsyncClient) -> None:
    sim.sim.faults.completion_hang = 1
    task = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await eventually(lambda: sim.sim.stats.requests_by_model["tiny-base"] == 1, "the request in")
    assert not task.done()
    sim.sim.clear_faults()
    assert (await task).status_code == 200


async def test_a_load_hangs_until_cleared_and_then_lands(
    sim: SimURL, client: httpx.AsyncClient
) -> None:
    """``load_hang``: a fan-out held mid-way for as long as a test needs (no sleep to race)."""
    await client.post("/sim/faults", json={"load_hang": 1})
    body = {"lora_name": "a", "lora_path": "/a"}
    task = asyncio.create_task(client.post("/v1/load_lora_adapter", json=body))
    await eventually(lambda: sim.sim.stats.loads == ["a"], "the load in")
    await asyncio.sleep(0)  # the handler runs on this loop: give it every chance to finish
    assert not task.done() and "a" not in sim.sim.adapters
    await client.delete("/sim/faults")
    assert (await task).status_code == 200
    assert "a" in sim.sim.adapters
    # One load only: the next one is not held.
    body = {"lora_name": "b", "lora_path": "/b"}
    assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200


async def test_health_fault_and_load_delay(sim: SimURL, client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    await client.post("/sim/faults", json={"health_status": 503, "load_delay_s": 0.01})
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    assert r.status_code == 200


async def test_bad_fault_updates_are_400(client: httpx.AsyncClient) -> None:
    bodies: list[Any] = [
        {"nope": 1},
        {"load_delay_s": "x"},
        {"load_error": 1.5},
        {"health_status": 42},
        [1],
    ]
    for body in bodies:
        r = await client.post("/sim/faults", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, body
    r = await client.post("/sim/faults", content=b"junk")
    assert r.status_code == 400


async def test_unload_keeps_in_flight_requests(client: httpx.AsyncClient) -> None:
    cfg = SimConfig(latency=LatencyModel(decode=0.01))
    async with running_sim(cfg) as url, httpx.AsyncClient(base_url=url) as c:
        await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        task = asyncio.create_task(
            c.post("/v1/completions", json={**BODY, "model": "a", "max_tokens": 10})
        )
        await eventually(lambda: url.sim.running == 1, "the request generating")
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 200
        r = await task
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10


async def test_server_info_and_dev_endpoints(client: httpx.AsyncClient) -> None:
    info = (await client.get("/server_info", params={"config_format": "json"})).json()
    cfg = info["vllm_config"]
    assert cfg["lora_config"] == {
        "max_lora_rank": 8,
        "max_loras": 6,
        "max_cpu_loras": 6,
        "fully_sharded_loras": False,
        "lora_dtype": "auto",
    }
    assert cfg["parallel_config"]["data_parallel_size"] == 1
    assert cfg["model_config"]["max_model_len"] == 256
    assert isinstance((await client.get("/server_info")).json()["vllm_config"], str)
    assert (await client.get("/get_world_size")).json() == {"world_size": 1}
    assert (await client.get("/version")).json() == {"version": "0.32.0"}
    r = await client.get("/no/such/path")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


async def test_abort_after_keep_does_not_deadlock() -> None:
    cfg = SimConfig(latency=LatencyModel(decode=0.01))
    async with running_sim(cfg) as url, httpx.AsyncClient(base_url=url) as client:
        body = {**BODY, "max_tokens": 50, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            await anext(lines)
            await client.post("/pause", params={"mode": "keep"})
            await client.post("/pause", params={"mode": "abort"})  # frozen request aborts
            rest = [line async for line in lines if line.startswith("data: {")]
        assert '"finish_reason":"abort"' in rest[-1]
        assert url.sim.running == 0
