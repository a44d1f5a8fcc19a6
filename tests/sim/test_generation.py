"""/v1/completions and /v1/chat/completions: shapes, n, token ids, logprobs, cache, SSE."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel
from rollout_testbed.sim.testing import SimURL, running_sim

from tests.eventually import eventually

PROMPT = list(range(10, 20))  # 10 tokens: 2 whole blocks of 4 + a partial block


async def _complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    result: dict[str, Any] = r.json()
    return result


async def _sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """Parse a whole SSE body into JSON events, checking vLLM's framing."""
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [orjson.loads(e[len("data: ") :]) for e in events[:-2]]


async def test_trl_rollout_request(client: httpx.AsyncClient) -> None:
    body = await _complete(
        client,
        n=1,
        return_token_ids=True,
        logprobs=0,
        seed=7,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
    )
    assert body["object"] == "text_completion" and body["model"] == "tiny-base"
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"] == PROMPT
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(x <= 0 for x in lp["token_logprobs"])
    assert [len(t) for t in lp["top_logprobs"]] == [1, 1, 1, 1]
    assert lp["tokens"] == list(choice["text"]) and lp["text_offset"] == [0, 1, 2, 3]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 14,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
    }
    again = await _complete(client, return_token_ids=True, seed=7)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    other = await _complete(client, return_token_ids=True, seed=8)
    assert other["choices"][0]["token_ids"] != choice["token_ids"]


async def test_plain_request_has_null_extras(client: httpx.AsyncClient) -> None:
    (choice,) = (await _complete(client))["choices"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["logprobs"] is None and isinstance(choice["text"], str)


async def test_n_and_top_logprobs(client: httpx.AsyncClient) -> None:
    body = await _complete(client, n=3, logprobs=2, return_token_ids=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 3
    assert all(len(t) == 3 for c in body["choices"] for t in c["logprobs"]["top_logprobs"])
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == 10


async def test_prompt_forms(client: httpx.AsyncClient) -> None:
    forms: list[tuple[Any, int]] = [
        ("hello", 1),
        (["a", "bb"], 2),
        ([[1, 2], [3, 4, 5]], 2),
        ([7, 8, 9], 1),
    ]
    for prompt, choices in forms:
        body = await _complete(client, prompt=prompt, n=1)
        assert len(body["choices"]) == choices, prompt


async def test_cached_tokens_grow_and_are_per_adapter(client: httpx.AsyncClient) -> None:
    first = await _complete(client)
    assert first["usage"]["prompt_tokens_details"] is None  # vLLM omits a zero hit
    second = await _complete(client)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    on_adapter = await _complete(client, model="a")
    assert on_adapter["model"] == "a"
    assert on_adapter["usage"]["prompt_tokens_details"] is None
    assert (await _complete(client, model="a"))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 8
    }
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    assert (await _complete(client))["usage"]["prompt_tokens_details"] is None


async def test_a_cache_salt_keys_the_blocks_as_vllms_does(client: httpx.AsyncClient) -> None:
    await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    await _complete(client, model="a", cache_salt="g1")
    hit = {"cached_tokens": 8}
    assert (await _complete(client, model="a", cache_salt="g1"))["usage"][
        "prompt_tokens_details"
    ] == hit
    assert (await _complete(client, model="a", cache_salt="g2"))["usage"][
        "prompt_tokens_details"
    ] is None
    assert (await _complete(client, model="a"))["usage"]["prompt_tokens_details"] is None
    assert (await _complete(client, cache_salt="g1"))["usage"]["prompt_tokens_details"] is None


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": list(range(300))}, "input_tokens"),
    ({"n": "many"}, "body.n"),
    ({"cache_salt": ""}, "body.cache_salt"),
    ({"cache_salt": "a/b"}, "body.cache_salt"),
]


async def test_invalid_requests_are_400(client: httpx.AsyncClient) -> None:
    for body, param in INVALID:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, **body})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["code"] == 400 and err["param"] == param, body
        assert err["type"] in ("BadRequestError", "Bad Request")


async def test_max_tokens_is_clamped_to_context(client: httpx.AsyncClient) -> None:
    body = await _complete(client, prompt=list(range(250)), max_tokens=100)
    assert body["usage"]["completion_tokens"] == 6  # max_model_len 256 - 250


async def test_completion_stream_chunks_and_usage(client: httpx.AsyncClient) -> None:
    events = await _sse(
        client,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 3,
            "n": 2,
            "return_token_ids": True,
            "logprobs": 0,
            "stream_options": {"include_usage": True},
        },
    )
    *chunks, usage = events
    assert len(chunks) == 6 and {c["id"] for c in events} == {events[0]["id"]}
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
        assert "usage" not in c and len(choice["token_ids"]) == 1
    for seq in by_index.values():
        assert seq[0]["prompt_token_ids"] == PROMPT
        assert [s["prompt_token_ids"] for s in seq[1:]] == [None, None]
        assert [s["finish_reason"] for s in seq] == [None, None, "length"]
        assert [s["logprobs"]["text_offset"] for s in seq] == [[0], [1], [2]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert "prompt_tokens_details" not in usage["usage"]


async def test_stream_arrives_incrementally() -> None:
    """The first chunk reaches the client while the replica is still generating."""
    slow = SimConfig(latency=LatencyModel(decode=0.05))
    async with running_sim(slow) as url, httpx.AsyncClient(base_url=url) as client:
        body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            assert url.sim.running == 1  # four tokens still to go
            rest = [line async for line in lines if line]
        assert url.sim.running == 0
        assert len(rest) == 5 and rest[-1] == "data: [DONE]"


async def test_chat_completion(client: httpx.AsyncClient) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": msgs,
            "max_tokens": 3,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 3
    content = choice["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    tok = (await client.post("/tokenize", json={"messages": msgs})).json()
    assert body["prompt_token_ids"] == tok["tokens"]
    assert body["usage"]["prompt_tokens"] == tok["count"]


async def test_chat_stream(client: httpx.AsyncClient) -> None:
    events = await _sse(
        client,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:]) and len(deltas) == 3
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 2


async def test_tokenize_detokenize(client: httpx.AsyncClient) -> None:
    tok = await client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    body = tok.json()
    assert body["count"] == len(body["tokens"]) == 6 and body["max_model_len"] == 256
    detok = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert detok.json() == {"prompt": "héllo"}
    r = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


async def test_metrics(sim: SimURL, client: httpx.AsyncClient) -> None:
    await _complete(client)
    await _complete(client)
    text = (await client.get("/metrics")).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:")
    }
    assert values["vllm:prefix_cache_queries_total"] == 20
    assert values["vllm:prefix_cache_hits_total"] == 8
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:generation_tokens_total"] == 8
    assert 'model_name="tiny-base"' in text
    async with running_sim() as other, httpx.AsyncClient(base_url=other) as c2:
        fresh = (await c2.get("/metrics")).text  # per-instance registry, not the global one
        assert "vllm:prefix_cache_queries_total{" in fresh
        assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-base"} 0.0' in fresh


async def test_max_num_seqs_runs_that_many_and_queues_the_rest_in_order() -> None:
    """vLLM's ``--max-num-seqs``: the rest wait first come, first served, counted in
    ``vllm:num_requests_waiting`` (what the gateway's fair share is measured against)."""
    slow = SimConfig(latency=LatencyModel(decode=0.05), max_num_seqs=2)
    async with running_sim(slow) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        done: list[int] = []

        async def one(i: int) -> None:
            r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200
            done.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.ensure_future(one(i)))
            await eventually(lambda n=i: url.sim.running + url.sim.waiting == n + 1, "queued")
        assert (url.sim.running, url.sim.waiting) == (2, 3)
        metrics = (await client.get("/metrics")).text
        assert any(line.startswith("vllm:num_requests_waiting{") and line.endswith(" 3.0")
                   for line in metrics.splitlines())  # fmt: skip
        await asyncio.gather(*tasks)
        assert done[2:] == [2, 3, 4]  # the waiting ones in arrival order
        assert (url.sim.running, url.sim.waiting) == (0, 0)


def test_max_num_seqs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimConfig(max_num_seqs=0)
