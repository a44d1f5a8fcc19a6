"""Real vLLM: a name loaded again in place at the same path (TRL restarting at v1 in the
same folder) answers with the new weights, never with KV cached under the old ones.

vLLM keys an adapter's prefix-cache blocks by its name and path, not its bytes
(vllm#42125), so without the gateway's per-load ``cache_salt`` the prompt's cached blocks,
computed with adapter A, would be decoded with adapter C: an answer that is neither.
Greedy decoding makes "the new weights' answer" one exact token list: adapter C loaded
under a fresh name and path, on the same prompt.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import E2E, VLLM_BLOCK, random_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

BLOCKS = 5


def greedy(c: httpx.Client, model: str, prompt: list[int]) -> tuple[list[int], int, int]:
    """(token ids, cached prompt tokens, replica index) of one greedy completion."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 12,
                            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return list(out["choices"][0]["token_ids"]), cached, int(r.headers["x-gateway-replica"])


def publish(src: Path, dst: Path) -> None:
    """Replace ``dst`` with a copy of ``src`` by an atomic rename, as TRL publishes."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copytree(src, tmp)
    old = dst.with_name(dst.name + ".old")
    if dst.exists():
        os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def load(c: httpx.Client, name: str, path: Path) -> None:
    r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def test_reload_in_place_answers_with_the_new_weights_on_every_replica(
    vllm_gw: E2E, tmp_path: Path
) -> None:
    env = vllm_gw
    same = tmp_path / "run" / "reload-policy-v1"
    fresh = tmp_path / "fresh" / "fresh-policy-v1"
    publish(env.adapter_dir(3), same)  # adapter A
    shutil.copytree(env.adapter_dir(9), fresh)  # adapter C, under its own name and path
    with httpx.Client(base_url=env.url, timeout=180) as c:
        load(c, "reload-policy-v1", same)
        load(c, "fresh-policy-v1", fresh)
        # prompts until both replicas served one on which A and C answer differently
        # (routing is by prefix, and the tiny model's adapters sometimes agree on a
        # prompt: such a prompt would make the check blind, so it is skipped; bounded tries)
        prompts: dict[int, tuple[list[int], list[int]]] = {}
        for _ in range(24):
            prompt = random_prompt(BLOCKS * VLLM_BLOCK + 3)
            a, _, replica = greedy(c, "reload-policy-v1", prompt)
            again, cached, replica_again = greedy(c, "reload-policy-v1", prompt)
            assert replica_again == replica and again == a
            assert cached >= BLOCKS * VLLM_BLOCK  # its blocks are cached under A
            if replica not in prompts and greedy(c, "fresh-policy-v1", prompt)[0] != a:
                prompts[replica] = (prompt, a)
            if len(prompts) == len(env.urls):
                break
        assert len(prompts) == len(env.urls), f"only replicas {sorted(prompts)} served"

        publish(env.adapter_dir(9), same)  # C's bytes at A's path
        load(c, "reload-policy-v1", same)  # the gateway reloads it in place everywhere
        for replica, (prompt, a) in sorted(prompts.items()):
            expected, _, _ = greedy(c, "fresh-policy-v1", prompt)
            assert expected != a  # chosen so above: the check is not blind
            after, cached, served = greedy(c, "reload-policy-v1", prompt)
            assert served == replica
            assert cached == 0  # a new generation: A's blocks are never matched
            assert after == expected, (replica, after, expected, a)
            again, cached, _ = greedy(c, "reload-policy-v1", prompt)
            assert again == expected and cached >= BLOCKS * VLLM_BLOCK  # C's own blocks
