"""The HTTP surface over real sockets: 2 sim replicas behind the gateway."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel
from starlette.types import ASGIApp, Receive, Scope, Send

from tests.cluster import cluster
from tests.conftest import ADMIN_KEY, CLIENT_KEY, UPSTREAM_TOKEN
from tests.eventually import eventually

COMPLETION = {"model": "tiny-base", "prompt": [5, 6, 7, 8], "max_tokens": 4}


async def test_completion_is_routed_and_tagged() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        body = r.json()
        assert len(body["choices"][0]["token_ids"]) == 4
        assert r.headers["x-gateway-replica"] in {"0", "1"}
        assert len(r.headers["x-request-id"]) >= 16
        served = [c.sim(i).stats.requests_by_model["tiny-base"] for i in range(2)]
        assert sum(served) == 1
        assert served[int(r.headers["x-gateway-replica"])] == 1


async def test_request_id_is_propagated() -> None:
    async with cluster(1) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "abc-1"})
        assert r.headers["x-request-id"] == "abc-1"
        bad = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "a b"})
        assert bad.headers["x-request-id"] != "a b"


async def test_streaming_is_relayed_chunk_by_chunk() -> None:
    slow = SimConfig(latency=LatencyModel(decode=0.05))
    async with cluster(1, sim_config=slow) as c, httpx.AsyncClient(base_url=c.url) as client:
        started = time.perf_counter()
        arrivals: list[float] = []
        lines: list[bytes] = []
        payload = {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 20, "stream": True}  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for chunk in r.aiter_bytes():
                arrivals.append(time.perf_counter() - started)
                lines.extend(line for line in chunk.split(b"\n") if line.startswith(b"data: "))
        total = arrivals[-1]
        assert lines[-1] == b"data: [DONE]"
        assert len(lines) >= 20
        # 20 tokens x 50 ms: the first chunk must arrive long before the upstream finishes.
        assert total > 0.8
        assert total - arrivals[0] > 0.5  # buffered, all would come at the end (a stall
        # before the first chunk delays the end as much: a ratio would not survive it)
        assert c.gateway.pool[0].in_flight == 0


async def test_pause_resume_reset_are_broadcast() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        assert [c.sim(i).paused for i in range(2)] == [True, True]
        assert (await client.post("/resume")).status_code == 200
        assert [c.sim(i).paused for i in range(2)] == [False, False]
        assert [c.sim(i).stats.pauses for i in range(2)] == [["keep"], ["keep"]]
        assert (await client.post("/reset_prefix_cache")).status_code == 200


async def test_lora_load_and_unload_reach_every_replica() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        load = {"lora_name": "trl-policy-v1", "lora_path": "/lora/v1", "load_inplace": False}
        r = await client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        assert "added successfully" in r.text
        assert [c.sim(i).stats.loads for i in range(2)] == [["trl-policy-v1"]] * 2
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["tiny-base", "trl-policy-v1"]
        gen = await client.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})
        assert gen.status_code == 200
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
        assert r.status_code == 200  # acknowledged at once, applied once nothing is in flight
        await eventually(lambda: all(c.sim(i).stats.unloads for i in range(2)), "both unloads")
        assert [c.sim(i).stats.unloads for i in range(2)] == [["trl-policy-v1"]] * 2


async def test_server_info_presents_dp1_and_weakest_lora_config() -> None:
    # Replica 1 is weaker than replica 0, as in a mis-sized fleet.
    configs = [SimConfig(), SimConfig(max_loras=3, max_lora_rank=4)]
    async with cluster(2, sim_config=configs) as c, httpx.AsyncClient(base_url=c.url) as client:
        info = (await client.get("/server_info", params={"config_format": "json"})).json()
        cfg = info["vllm_config"]
        assert cfg["parallel_config"]["data_parallel_size"] == 1
        assert cfg["lora_config"]["max_loras"] == 3
        assert cfg["lora_config"]["max_lora_rank"] == 4


async def test_unknown_model_is_vllm_404() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "model": "nope"})
        assert r.status_code == 404
        assert "does not exist" in r.json()["error"]["message"]


async def test_health_fans_in() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        assert (await client.get("/health")).status_code == 200
        c.sim(1).faults.health_status = 503
        await eventually(lambda: not c.gateway.pool[1].up, "replica 1 ejected by its probes")
        r = await client.get("/health")
        assert r.status_code == 503
        assert "down: [1]" in r.json()["error"]["message"]
        # Traffic still flows to the healthy replica.
        for _ in range(4):
            ok = await client.post("/v1/completions", json=COMPLETION)
            assert ok.headers["x-gateway-replica"] == "0"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (orjson.dumps({**COMPLETION, "model": 3}), 400, "model"),
        (orjson.dumps({**COMPLETION, "stream": "yes"}), 400, "stream"),
        (orjson.dumps({**COMPLETION, "n": 0}), 400, "n"),
        (orjson.dumps({**COMPLETION, "max_tokens": "5"}), 400, "max_tokens"),
        (orjson.dumps({"model": "tiny-base"}), 400, "prompt"),
        (b"x" * 5000, 413, None),
    ],
)
async def test_bad_input_gets_openai_error_and_gateway_survives(
    body: bytes, status: int, param: str | None
) -> None:
    async with cluster(1, max_body_bytes=4096) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.post("/v1/completions", content=body)
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
        assert c.sim(0).stats.requests_by_model.total() == 0  # nothing went upstream
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_wrong_method_is_405_with_allow() -> None:
    async with cluster(1) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.get("/v1/completions")
        assert r.status_code == 405
        assert r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == 405


async def test_unroutable_path_is_an_openai_404() -> None:
    async with cluster(1) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.get("/v1/models%0D%0AX-Injected:%201")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "NotFoundError"
        assert "x-injected" not in r.headers


async def test_other_paths_are_forwarded() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        r = await client.post("/tokenize", json={"model": "tiny-base", "prompt": "hello"})
        assert r.status_code == 200
        assert r.json()["count"] > 0
        assert (await client.get("/version")).json()["version"]
        assert (await client.get("/get_world_size")).status_code == 200


class _HeaderRecorder:
    """Wraps a sim app to record the headers each request arrived with."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


async def test_auth_header_is_replaced_by_upstream_token() -> None:
    from rollout_testbed.serve import serve_asgi
    from rollout_testbed.sim.app import create_sim_app

    from gateway.app import create_app
    from gateway.config import load_settings

    recorder = _HeaderRecorder(create_sim_app())
    async with serve_asgi(recorder) as sim_url:
        settings = load_settings(
            {"replicas": [sim_url], "upstream_token": UPSTREAM_TOKEN, "api_key": CLIENT_KEY},
            environ={},
        )
        async with serve_asgi(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as cl:
            r = await cl.post(
                "/v1/completions",
                json=COMPLETION,
                headers={"Authorization": f"Bearer {CLIENT_KEY}", "Connection": "x-hop",
                         "X-Hop": "1", "Keep-Alive": "timeout=5"},
            )  # fmt: skip
            assert r.status_code == 200
    completions = [h for h in recorder.seen if h.get("content-type") == "application/json"]
    assert completions
    upstream = completions[-1]
    assert upstream["authorization"] == f"Bearer {UPSTREAM_TOKEN}"
    assert CLIENT_KEY not in str(recorder.seen)
    assert "x-hop" not in upstream and "keep-alive" not in upstream
    assert upstream["host"] != "testserver" and upstream["host"].startswith("127.0.0.1")
    assert "x-request-id" in upstream


async def test_api_key_and_admin_key_are_enforced() -> None:
    async with (
        cluster(2, api_key=CLIENT_KEY, admin_key=ADMIN_KEY) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        anon = await client.post("/v1/completions", json=COMPLETION)
        assert anon.status_code == 401
        assert anon.json()["error"]["type"] == "AuthenticationError"
        assert CLIENT_KEY not in anon.text
        wrong = await client.post(
            "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-wrong"}
        )
        assert wrong.status_code == 401
        user = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert (
            await client.post("/v1/completions", json=COMPLETION, headers=user)
        ).status_code == 200
        # TRL can only send credentials as http://user:KEY@host, i.e. Basic auth.
        basic = httpx.BasicAuth("trl", CLIENT_KEY)
        r = await client.post("/v1/completions", json=COMPLETION, auth=basic)
        assert r.status_code == 200
        # The client key does not open admin endpoints; the admin key does.
        assert (await client.post("/pause", headers=user)).status_code == 401
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert (await client.post("/pause", headers=admin)).status_code == 200
        assert (await client.post("/resume", headers=admin)).status_code == 200
        # /health and /metrics stay open for probes and Prometheus.
        assert (await client.get("/health")).status_code == 200
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        status = await client.get("/gateway/status", headers=user)
        for secret in (CLIENT_KEY, ADMIN_KEY):
            assert secret not in metrics.text
            assert secret not in status.text


async def test_retry_before_first_byte_when_a_replica_dies() -> None:
    async with cluster(2, health_interval_s=60) as c, httpx.AsyncClient(base_url=c.url) as client:
        # Kill replica 1 between requests: its port now refuses connections, and the pool
        # does not know yet (the next health probe is a minute away).
        c.gateway.pool[0].in_flight = 1  # make least-loaded pick replica 1 first
        await c.replicas[1].stop()
        results = await asyncio.gather(
            *(client.post("/v1/completions", json=COMPLETION) for _ in range(8))
        )
        c.gateway.pool[0].in_flight = 0
        assert [r.status_code for r in results] == [200] * 8
        assert {r.headers["x-gateway-replica"] for r in results} == {"0"}
        assert not c.gateway.pool[1].up
        metrics = (await client.get("/metrics")).text
        assert 'gateway_replica_ejections_total{cause="passive",replica="1"} 1.0' in metrics
        retries = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("gateway_upstream_retries_total ")
        )
        assert retries >= 1
        # Bring it back on the same port: the next health round re-admits it.
        await c.replicas[1].start()
        await c.gateway.health.round()
        assert c.gateway.pool[1].up


async def test_all_replicas_down_is_503() -> None:
    async with cluster(1, health_interval_s=60) as c, httpx.AsyncClient(base_url=c.url) as client:
        await c.replicas[0].stop()
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503
        assert c.replica_urls[0] not in r.text
        r = await client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "No healthy replica."
