"""Configurable limits, each answered with its status, an OpenAI error and a metric."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from gateway.api.requests import _openers_exceed
from tests.cluster import cluster
from tests.eventually import eventually

BODY = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 4}
_BRACKETS = bytes(b"[{]}a1, "[i % 8] for i in range(256))  # any byte -> a JSON-ish one


def rejected(metrics: str, reason: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'gateway_rejected_requests_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_header_count_and_size() -> None:
    async with (
        cluster(1, max_header_count=20, max_header_bytes=2048) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        many = {f"x-h{i}": "v" for i in range(30)}
        r = await client.post("/v1/completions", json=BODY, headers=many)
        assert r.status_code == 431
        assert r.json()["error"]["type"] == "RequestHeaderFieldsTooLarge"
        r = await client.get("/v1/models", headers={"x-big": "a" * 4096})
        assert r.status_code == 431
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert rejected(metrics, "header_count") == 1
        assert rejected(metrics, "header_bytes") == 1
        assert c.sim(0).stats.requests_by_model.total() == 1  # refused ones never left


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("n", 9, "n"), ("max_tokens", 65, "max_tokens"), ("max_completion_tokens", 65, None)],
)
async def test_generation_ceilings(field: str, value: int, param: str | None) -> None:
    async with (
        cluster(1, max_n=8, max_tokens_limit=64) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        path = "/v1/completions"
        body: dict[str, object] = {**BODY, field: value}
        if field == "max_completion_tokens":
            path = "/v1/chat/completions"
            body = {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}],
                    field: value}  # fmt: skip
        r = await client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == (param or field)
        ok = {**body, field: value - 1}
        assert (await client.post(path, json=ok)).status_code == 200
        assert rejected((await client.get("/metrics")).text, field) == 1


async def test_json_depth() -> None:
    async with cluster(1, max_json_depth=8) as c, httpx.AsyncClient(base_url=c.url) as client:
        nested: object = 1
        for _ in range(10):
            nested = [nested]
        r = await client.post("/v1/completions", json={**BODY, "extra": nested})
        assert r.status_code == 400
        assert "deeper than 8" in r.json()["error"]["message"]
        # Many containers but shallow: the bracket pre-count is exceeded, the walk passes.
        wide = {**BODY, "prompt": [[1, 2]] * 50}
        assert (await client.post("/v1/completions", json=wide)).status_code == 200
        # orjson's own recursion limit (1024) is a 400 too, not a 500.
        deep = b'{"a":' + b"[" * 2000 + b"]" * 2000 + b"}"
        r = await client.post("/v1/completions", content=deep,
                              headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400
        assert rejected((await client.get("/metrics")).text, "json_depth") == 1


@given(body=st.binary(max_size=200).map(lambda b: b.translate(_BRACKETS)), limit=st.integers(0, 30))
def test_opener_bound_is_the_bracket_count(body: bytes, limit: int) -> None:
    assert _openers_exceed(body, limit) == (body.count(b"[") + body.count(b"{") > limit)


SLOW = SimConfig(latency=LatencyModel(decode=0.02))  # 25 tokens = 0.5 s


async def test_global_in_flight_cap_answers_429_with_retry_after() -> None:
    async with (
        cluster(1, SLOW, max_in_flight=3) as c,
        httpx.AsyncClient(base_url=c.url, timeout=10) as client,
    ):
        # The replica holds what it gets (a keep-pause): the three admitted requests stay in
        # flight until every other one was answered, however slow the machine.
        await c.sim(0).pause("keep")
        sent = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(8)]
        await eventually(
            lambda: c.sim(0).waiting == 3 and sum(t.done() for t in sent) == 5,
            "three requests held by the replica and five answered",
        )
        c.sim(0).resume()
        results = await asyncio.gather(*sent)
        codes = sorted(r.status_code for r in results)
        assert codes == [200] * 3 + [429] * 5, codes  # the cap, exactly
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "RateLimitError"
        # Control endpoints are never refused, and the count returns to zero.
        assert (await client.get("/health")).status_code == 200
        assert c.gateway.ledger.admission.in_flight == 0
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


async def test_per_client_cap_is_per_credential() -> None:
    async with (
        cluster(1, SLOW, max_in_flight_per_client=1, api_key="k1") as c,
        httpx.AsyncClient(base_url=c.url, timeout=10) as client,
    ):
        a = {"authorization": "Bearer k1"}
        # The replica holds the first request (a keep-pause) until the test says so: it is
        # in flight for as long as the second takes, however slow the machine.
        await c.sim(0).pause("keep")
        first = asyncio.create_task(client.post("/v1/completions", json=BODY, headers=a))
        await eventually(lambda: c.sim(0).waiting == 1, "the first request held by the replica")
        second = await client.post("/v1/completions", json=BODY, headers=a)
        assert second.status_code == 429
        assert "this client" in second.json()["error"]["message"]
        assert c.sim(0).waiting == 1  # the refused one never reached the replica
        c.sim(0).resume()
        assert (await first).status_code == 200
        assert c.gateway.ledger.admission.clients() == 0
        metrics = (await client.get("/metrics")).text
        assert rejected(metrics, "client_in_flight") == 1


async def test_streams_hold_their_slot_until_the_end() -> None:
    async with (
        cluster(1, SLOW, max_in_flight=1) as c,
        httpx.AsyncClient(base_url=c.url, timeout=10) as client,
    ):
        body = {**BODY, "max_tokens": 25, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            other = await client.post("/v1/completions", json=BODY)
            assert other.status_code == 429
            chunks = [line async for line in r.aiter_lines() if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        assert c.gateway.ledger.admission.in_flight == 0
        assert json.loads(chunks[0][5:])["object"] == "text_completion"
