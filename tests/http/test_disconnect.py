"""A client that goes away must cancel the upstream request and leave no in-flight count."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from tests.cluster import Cluster, cluster

SLOW = SimConfig(latency=LatencyModel(decode=0.05))  # 200 tokens = 10 s if not cancelled
# The lean server protocol signals a lost connection itself; with a query string the
# connection is uvicorn's and the gateway watches ASGI ``receive`` instead.
BOTH_SERVERS = pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/completions?via=uvicorn"], ids=["lean", "uvicorn"]
)


async def _settled(c: Cluster, timeout: float = 3.0) -> bool:
    """True once the gateway and the replica both dropped the request."""
    for _ in range(int(timeout / 0.05)):
        if c.gateway.pool[0].in_flight == 0 and c.sim(0).running == 0:
            return True
        await asyncio.sleep(0.05)
    return False


@BOTH_SERVERS
async def test_stream_disconnect_cancels_upstream(path: str) -> None:
    body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    async with cluster(1, sim_config=SLOW) as c, httpx.AsyncClient(base_url=c.url) as client:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # first chunk, then hang up
        assert c.sim(0).running in (0, 1)
        assert await _settled(c), "upstream generation kept running after the client left"
        metrics = (await client.get("/metrics")).text
        assert "gateway_client_disconnects_total 1.0" in metrics


@BOTH_SERVERS
async def test_buffered_disconnect_cancels_upstream(path: str) -> None:
    body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 200}
    async with cluster(1, sim_config=SLOW) as c:
        # 0.5 s to read (the generation takes 10 s); connecting and sending may take longer
        async with httpx.AsyncClient(
            base_url=c.url, timeout=httpx.Timeout(5.0, read=0.5)
        ) as client:
            try:
                await client.post(path, json=body)
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("the 10 s generation cannot finish within 0.5 s")
        assert await _settled(c), "upstream generation kept running after the client left"


async def test_many_disconnects_leave_no_leak() -> None:
    body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    async with cluster(1, sim_config=SLOW) as c:

        async def hang_up() -> None:
            async with (
                httpx.AsyncClient(base_url=c.url) as client,
                client.stream("POST", "/v1/completions", json=body) as r,
            ):
                async for _ in r.aiter_bytes():
                    break

        await asyncio.gather(*(hang_up() for _ in range(40)))
        assert await _settled(c, timeout=5.0)
        async with httpx.AsyncClient(base_url=c.url) as client:
            ok = await client.post("/v1/completions", json={**body, "stream": False,
                                                              "max_tokens": 2})  # fmt: skip
            assert ok.status_code == 200
