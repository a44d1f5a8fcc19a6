"""A rollout the gateway answers with an error is counted like any other answer, so the
5xx-rate alert (``RolloutGatewayHighErrorRate``) sees the gateway's own 502/503/504 (the
chaos run found them missing)."""

from __future__ import annotations

import httpx

from tests.cluster import cluster


def routed(text: str, status_class: str) -> float:
    label = f'gateway_requests_total{{route="routed",status_class="{status_class}"}} '
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(label)
    )


async def test_gateway_errors_on_rollouts_are_counted() -> None:
    async with cluster(1) as c, httpx.AsyncClient(base_url=c.url, timeout=10) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        assert (await client.post("/v1/completions", json={**body, "model": "tiny-base"})
                ).status_code == 200  # fmt: skip
        assert (await client.post("/v1/completions", json={**body, "model": "nope-v1"})
                ).status_code == 404  # fmt: skip
        assert (await client.post("/v1/completions", json={**body, "n": 0})).status_code == 400
        await c.replicas[0].stop()  # refused connections: ejected, then 503
        statuses = [(await client.post("/v1/completions", json=body)).status_code for _ in range(3)]
        assert set(statuses) <= {502, 503} and statuses[-1] == 503
        text = (await client.get("/metrics")).text
        assert routed(text, "2xx") == 1
        assert routed(text, "4xx") == 2
        assert routed(text, "5xx") == 3
