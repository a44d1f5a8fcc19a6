"""A client that goes away must cancel the upstream request and leave no in-flight count."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from tests.cluster import Cluster, cluster
from tests.eventually import eventually

SLOW = SimConfig(latency=LatencyModel(decode=0.05))  # 200 tokens = 10 s if not cancelled
# The lean server protocol signals a lost connection itself; with a query string the
# connection is uvicorn's and the gateway watches ASGI ``receive`` instead.
BOTH_SERVERS = pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/completions?via=uvicorn"], ids=["lean", "uvicorn"]
)


async def _finished(c: Cluster) -> float:
    """Generations the replica ran to their end (``max_tokens``), by its own metric."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(c.replica_urls[0] + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total")
               and 'finished_reason="length"' in line)  # fmt: skip


async def _settled(c: Cluster) -> None:
    """Wait until the gateway and the replica both dropped the request, then check that
    the replica's generation was cut short: one left running would end too (10 s), but
    counted as finished -- so no clock decides whether it was cancelled."""
    await eventually(
        lambda: c.gateway.pool[0].in_flight == 0 and c.sim(0).running == 0,
        "the gateway and the replica to drop the request",
    )
    assert await _finished(c) == 0, "upstream generation kept running after the client left"


@BOTH_SERVERS
async def test_stream_disconnect_cancels_upstream(path: str) -> None:
    body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    async with cluster(1, sim_config=SLOW) as c, httpx.AsyncClient(base_url=c.url) as client:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # first chunk, then hang up
            assert c.sim(0).running == 1  # the generation is under way as the client leaves
        await _settled(c)
        metrics = (await client.get("/metrics")).text
        assert "gateway_client_disconnects_total 1.0" in metrics


@BOTH_SERVERS
async def test_buffered_disconnect_cancels_upstream(path: str) -> None:
    body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 200}
    async with cluster(1, sim_config=SLOW) as c:
        async with httpx.AsyncClient(base_url=c.url) as client:
            waiting = asyncio.create_task(client.post(path, json=body))
            # The client leaves once the replica is generating (not after a read timeout,
            # which a slow machine could hit before the request even got there).
            await eventually(lambda: c.sim(0).running == 1, "the replica generating")
            waiting.cancel()  # httpx closes a connection whose request was cancelled
            with pytest.raises(asyncio.CancelledError):
                await waiting
        await _settled(c)


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
        await _settled(c)
        async with httpx.AsyncClient(base_url=c.url) as client:
            ok = await client.post("/v1/completions", json={**body, "stream": False,
                                                              "max_tokens": 2})  # fmt: skip
            assert ok.status_code == 200
        assert await _finished(c) == 1  # the metric counts a generation run to its end
