"""Drive the gateway with TRL 1.16's own client code (run with the vLLM venv's python).

    python tests/e2e/trl_probe.py GATEWAY_URL ADAPTER_PATH [REPLICA_URL ...]

Uses, unmodified: ``VLLMClient`` (health, /server_info, /v1/models, pause, load, resume,
unload), ``select_adapter_sync`` (TRL's decision between adapter-only and NCCL full-weight
sync), and ``_AsyncRolloutLoop._generate_one_turn`` / ``_post`` / ``_retry`` (the exact
rollout request path, on TRL's aiohttp session). Prints one JSON object with the results,
including whether each ``REPLICA_URL``'s own ``/v1/models`` listed the adapter right after
TRL's load returned.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import sys
import types
import urllib.request

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import aiohttp
from accelerate.state import PartialState
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop
from trl.experimental.async_grpo.vllm_client import VLLMClient


def tiny_peft_model(rank: int) -> object:
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return get_peft_model(Qwen2ForCausalLM(config), lora)


async def rollout(url: str, model: str, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """TRL's rollout request path on a stand-in ``self`` holding only what it reads."""
    loop = types.SimpleNamespace(
        vllm_server_url=url, _request_model=model, max_tokens=8, temperature=1.0, top_p=1.0,
        top_k=0, repetition_penalty=1.0, min_p=None, request_timeout=60,
        _counters=collections.Counter(),
    )  # fmt: skip
    loop._retry = functools.partial(_AsyncRolloutLoop._retry, loop)
    loop._post = functools.partial(_AsyncRolloutLoop._post, loop)
    async with aiohttp.ClientSession() as session:
        loop.session = session
        return await _AsyncRolloutLoop._generate_one_turn(loop, prompt_ids)  # type: ignore[arg-type]


def listed(replica_url: str, name: str) -> bool:
    """Whether the replica itself lists ``name`` (asked directly, not through the gateway)."""
    with urllib.request.urlopen(replica_url + "/v1/models", timeout=30) as resp:
        return any(m["id"] == name for m in json.load(resp)["data"])


def main() -> None:
    url, adapter_path, replicas = sys.argv[1], sys.argv[2], sys.argv[3:]
    PartialState()  # TRL logs through accelerate, which needs its state initialised
    client = VLLMClient(url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.5)
    info = client.get_server_info()
    adapter_only = select_adapter_sync(
        info, tiny_peft_model(rank=8), types.SimpleNamespace(max_staleness=4)
    )
    max_len = client.get_max_model_len()
    client.pause()
    client.load_lora_adapter("trl-policy-v1", adapter_path)
    held_after_load = [listed(r, "trl-policy-v1") for r in replicas]
    client.resume()
    token_ids, logprobs = asyncio.run(rollout(url, "trl-policy-v1", list(range(10, 40))))
    client.unload_lora_adapter("trl-policy-v1")
    print(json.dumps({
        "adapter_only_sync": adapter_only,
        "data_parallel_size": info["parallel_config"]["data_parallel_size"],
        "max_model_len": max_len,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "held_after_load": held_after_load,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
