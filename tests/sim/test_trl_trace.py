"""Replay TRL 1.16's recorded LoRA-sync wire trace against a sim: every call must succeed
the way TRL requires (reference/trl-wire.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_testbed.sim.testing import SimURL

TRACE = Path(__file__).parents[1] / "data" / "trl-1.16-lora-sync-wire-trace.jsonl"


def _trl_sequence() -> list[dict[str, Any]]:
    """The calls TRL makes, synthesized: startup, six syncs (max_staleness=2), a rollout."""
    calls: list[dict[str, Any]] = [
        {"method": "GET", "path": "/health", "query": "", "body": None},
        {"method": "GET", "path": "/server_info", "query": "config_format=json", "body": None},
        {"method": "GET", "path": "/v1/models", "query": "", "body": None},
    ]
    for v in range(1, 7):
        path = f"/out/.vllm_lora/trl-policy-v{v}"
        calls += [
            {"method": "POST", "path": "/pause", "query": "mode=keep", "body": None},
            {
                "method": "POST",
                "path": "/v1/load_lora_adapter",
                "query": "",
                "body": {"lora_name": f"trl-policy-v{v}", "lora_path": path, "load_inplace": False},
            },
            {"method": "POST", "path": "/resume", "query": "", "body": None},
        ]
        if v > 3:
            calls.append(
                {
                    "method": "POST",
                    "path": "/v1/unload_lora_adapter",
                    "query": "",
                    "body": {"lora_name": f"trl-policy-v{v - 3}"},
                }
            )
    calls.append(
        {
            "method": "POST",
            "path": "/v1/completions",
            "query": "",
            "body": {
                "model": "trl-policy-v6",
                "prompt": [16, 20, 23, 16],
                "max_tokens": 8,
                "n": 1,
                "return_token_ids": True,
                "logprobs": 0,
                "seed": 12345,
            },
        }
    )
    return calls


async def _replay(client: httpx.AsyncClient, calls: list[dict[str, Any]]) -> None:
    for call in calls:
        r = await client.request(
            call["method"], call["path"] + "?" + call["query"], json=call["body"]
        )
        assert r.status_code == 200, (call["path"], r.text)
        if call["path"] == "/server_info":
            cfg = r.json()["vllm_config"]
            assert cfg["lora_config"]["max_lora_rank"] >= 1
            assert cfg["lora_config"]["max_loras"] >= 4  # max_staleness + 2
            assert cfg["parallel_config"]["data_parallel_size"] == 1
        elif call["path"] == "/v1/models":
            assert r.json()["data"][0]["max_model_len"] > 0
        elif call["path"] == "/v1/completions":
            assert r.headers["content-type"] == "application/json"
            choice = r.json()["choices"][0]
            n = call["body"]["max_tokens"]
            assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == n


async def test_synthesized_trl_sequence(sim: SimURL, client: httpx.AsyncClient) -> None:
    await _replay(client, _trl_sequence())
    assert set(sim.sim.adapters) == {"trl-policy-v4", "trl-policy-v5", "trl-policy-v6"}
    assert sim.sim.stats.pauses == ["keep"] * 6 and not sim.sim.paused


@pytest.fixture
def recorded_calls() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]


async def test_recorded_trl_trace(
    client: httpx.AsyncClient, recorded_calls: list[dict[str, Any]]
) -> None:
    await _replay(client, recorded_calls)
