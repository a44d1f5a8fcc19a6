"""Real vLLM: two runs' token counts at the gateway add up to what the replicas counted
themselves (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``).

A second gateway, in multi-run mode, in front of the session's replicas; the runs send
base-model completions (token ids, as TRL does) and a stream that asks for its usage.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import BASE_MODEL, E2E, GatewayServer, vllm_counter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUNS = ("team-a", "team-b")


def replicas_counted(env: E2E) -> tuple[float, float]:
    return (
        sum(vllm_counter(u, "vllm:prompt_tokens_total") for u in env.urls),
        sum(vllm_counter(u, "vllm:generation_tokens_total") for u in env.urls),
    )


def run_counter(text: str, name: str, run: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{run="{run}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {run} not in /metrics")


def test_runs_tokens_agree_with_the_replicas_counters(vllm_gw: E2E, tmp_path: Path) -> None:
    env = vllm_gw
    runs = []
    for name in RUNS:
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    gateway = GatewayServer(env.urls, runs=runs, lora_slots_per_replica=6)
    gateway.start()
    try:
        before = replicas_counted(env)
        rng = random.Random(7)
        for name, n in zip(RUNS, (5, 3), strict=True):
            with httpx.Client(base_url=gateway.url, auth=(name, f"key-{name}"), timeout=120) as c:
                for _ in range(n):
                    prompt = [rng.randrange(4, 2048) for _ in range(40)]
                    body: dict[str, Any] = {"model": BASE_MODEL, "max_tokens": 6, "prompt": prompt}
                    r = c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
                r = c.post("/v1/completions", json=stream)
                assert r.status_code == 200
                last = [orjson.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                assert last[-1]["usage"]["completion_tokens"] > 0
        after = replicas_counted(env)
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        prompt = sum(run_counter(text, "gateway_run_prompt_tokens_total", r) for r in RUNS)
        completion = sum(run_counter(text, "gateway_run_completion_tokens_total", r) for r in RUNS)
        assert prompt == after[0] - before[0] and prompt >= (5 + 3 + 2) * 40
        assert completion == after[1] - before[1] and completion > 0
        assert run_counter(text, "gateway_run_prompt_tokens_total", "team-a") > run_counter(
            text, "gateway_run_prompt_tokens_total", "team-b"
        )
    finally:
        gateway.stop()
