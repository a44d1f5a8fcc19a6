"""Fuzzing the gateway's HTTP surface with hypothesis: 10,000+ generated requests.

Every answer must be well-formed -- a success, or an OpenAI-style JSON error with a 4xx
status -- the gateway must never answer 5xx on its own account (its sim replicas are
healthy throughout), and it must keep serving afterwards. Requests mix valid shapes with
hostile ones: wrong types, deep nesting, garbage bytes, odd methods and paths, bogus
headers.
"""

from __future__ import annotations

import asyncio
import os
import string
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cluster import Cluster, cluster

BATCH = 10  # requests per hypothesis example, sent concurrently
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1050"))  # x BATCH = 10,500 requests
PATHS = [
    "/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/health", "/server_info", "/v1/models", "/tokenize",
    "/detokenize", "/version", "/metrics", "/gateway/status", "/pause", "/resume",
]  # fmt: skip
SAFE_PATHS = [p for p in PATHS if p not in ("/pause",)]  # a paused fleet would stall rollouts

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False),
    st.text(max_size=20),
)  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
token_ids = st.lists(st.integers(0, 2047), min_size=1, max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": st.text(max_size=30)}
)
generation = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("tiny-base"), st.text(max_size=12), json_value),
        "prompt": st.one_of(
            token_ids, st.text(max_size=40), st.lists(token_ids, max_size=3), json_value
        ),
        "messages": st.one_of(st.lists(message, max_size=3), json_value),
        "max_tokens": st.one_of(st.integers(-2, 8), json_value),
        "n": st.one_of(st.integers(-1, 3), json_value),
        "stream": st.one_of(st.booleans(), json_value),
        "logprobs": st.one_of(st.integers(-1, 3), json_value),
        "return_token_ids": st.booleans(),
        "user": st.one_of(st.text(max_size=10), json_value),
        "lora_name": st.one_of(st.text(max_size=12), json_value),
        "lora_path": st.one_of(st.text(max_size=20), json_value),
    },
)  # fmt: skip
deep = st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d)
body = st.one_of(
    generation.map(orjson.dumps),
    generation.map(orjson.dumps),
    st.binary(max_size=200),
    json_value.map(orjson.dumps),
    deep,
)
# What a real client can put on the wire (h11 refuses the rest before it leaves).
header_value = st.text(
    alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=40
).map(str.strip)
headers = st.dictionaries(
    st.sampled_from(["content-type", "authorization", "x-request-id", "x-session-id",
                     "accept", "connection", "x-forwarded-for", "cookie"]),
    header_value,
    max_size=4,
)  # fmt: skip
random_path = st.text(alphabet=string.ascii_letters + "/_-.%", max_size=20).map(lambda p: "/" + p)
requests = st.tuples(
    st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH"]),
    st.one_of(st.sampled_from(SAFE_PATHS), random_path),
    headers,
    body,
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fuzz_target() -> AsyncIterator[tuple[Cluster, httpx.AsyncClient]]:
    async with cluster(2, max_body_bytes=64 * 1024) as c:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=c.url, limits=limits, timeout=30) as client:
            yield c, client


SEEN: dict[str, int] = {"requests": 0, "5xx": 0}


@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="module")
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(requests, min_size=BATCH, max_size=BATCH))
async def test_every_answer_is_well_formed(
    fuzz_target: tuple[Cluster, httpx.AsyncClient],
    batch: list[tuple[str, str, dict[str, str], bytes]],
) -> None:
    _, client = fuzz_target

    async def one(method: str, path: str, hdrs: dict[str, str], content: bytes) -> None:
        r = await client.request(method, path, headers=hdrs, content=content)
        SEEN["requests"] += 1
        where = f"{method} {path} {hdrs} {content[:80]!r}"
        assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            error: Any = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"], where
            assert "code" in error and "type" in error, where

    await asyncio.gather(*(one(*request) for request in batch))


@pytest.mark.asyncio(loop_scope="module")
async def test_gateway_survived_the_campaign(
    fuzz_target: tuple[Cluster, httpx.AsyncClient],
) -> None:
    c, client = fuzz_target
    assert SEEN["requests"] >= min(EXAMPLES * BATCH, 10_000), SEEN
    ok = await client.post(
        "/v1/completions", json={"model": "tiny-base", "prompt": [1, 2], "max_tokens": 2}
    )
    assert ok.status_code == 200
    await asyncio.sleep(0)
    assert all(r.in_flight == 0 for r in c.gateway.pool.replicas)
    assert (await client.get("/health")).status_code == 200
