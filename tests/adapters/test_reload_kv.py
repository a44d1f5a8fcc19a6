"""A name loaded again at the same path never meets KV cached under its earlier load,
through the gateway, on simulated replicas whose prefix cache keys blocks as vLLM's does
(adapter name and path, plus ``cache_salt``). The same on real vLLM:
``tests/e2e/test_vllm_reload.py``."""

from __future__ import annotations

from typing import Any

import httpx
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.config import SimConfig

from gateway.app import create_app
from gateway.config import load_settings
from tests.cluster import cluster

PROMPT = list(range(1, 9))  # two whole blocks of 4
HIT = {"cached_tokens": 8}


async def complete(client: httpx.AsyncClient, model: str, **extra: Any) -> dict[str, Any] | None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    details: dict[str, Any] | None = r.json()["usage"]["prompt_tokens_details"]
    return details


async def load(client: httpx.AsyncClient, name: str, path: str) -> None:
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert r.status_code == 200, r.text


async def test_a_reload_in_place_misses_the_old_blocks_then_shares_its_own() -> None:
    async with (
        cluster(1, SimConfig(block_size=4)) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        await load(client, "trl-policy-v1", "/runs/a/trl-policy-v1")
        assert await complete(client, "trl-policy-v1") is None
        assert await complete(client, "trl-policy-v1") == HIT  # a group shares its blocks
        await load(client, "trl-policy-v1", "/runs/a/trl-policy-v1")  # new bytes, same path
        assert await complete(client, "trl-policy-v1") is None  # not the old weights' KV
        assert await complete(client, "trl-policy-v1") == HIT
        assert await complete(client, "tiny-base") is None  # the base model is never salted
        assert await complete(client, "tiny-base") == HIT


async def test_unload_then_load_again_and_a_client_salt() -> None:
    async with (
        cluster(1, SimConfig(block_size=4)) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        await load(client, "trl-policy-v1", "/runs/a/trl-policy-v1")
        await complete(client, "trl-policy-v1")
        assert await complete(client, "trl-policy-v1", cache_salt="mine") is None  # isolated
        assert await complete(client, "trl-policy-v1", cache_salt="mine") == HIT
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
        assert r.status_code == 200
        await load(client, "trl-policy-v1", "/runs/a/trl-policy-v1")  # a restarted run's v1
        assert await complete(client, "trl-policy-v1") is None
        bad = await client.post("/v1/completions", json={"model": "trl-policy-v1",
                                "prompt": PROMPT, "cache_salt": "a/b"})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        assert await complete(client, "trl-policy-v1") == HIT  # the gateway goes on


async def test_a_restarted_gateway_never_reuses_a_salt() -> None:
    """Its registry is rebuilt from the replicas: it cannot know what they cached under
    which weights, so the adopted copies start new generations."""
    async with (
        cluster(1, SimConfig(block_size=4)) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        await load(client, "trl-policy-v1", "/runs/a/trl-policy-v1")
        await complete(client, "trl-policy-v1")
        assert await complete(client, "trl-policy-v1") == HIT
        settings = load_settings({"replicas": c.replica_urls, "health_interval_s": 0.2}, environ={})
        async with (
            serve_asgi(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url) as again,
        ):
            models = (await again.get("/v1/models")).json()["data"]
            assert "trl-policy-v1" in [m["id"] for m in models]
            assert await complete(again, "trl-policy-v1") is None
            assert await complete(again, "trl-policy-v1") == HIT
