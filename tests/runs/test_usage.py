"""Per-run accounting (``gateway.runs.usage``): vLLM's token counts per run, answers by
status class, time held; they add up to what the replicas themselves counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.runs.usage import RunUsage, usage_tokens
from tests.cluster import Cluster
from tests.runs.test_many_runs import as_run, load, shared

VLLM_BODY = (
    b'{"id":"cmpl-1","object":"text_completion","model":"a~p-v1","choices":[{"index":0,'
    b'"text":"\\"usage\\":{}","token_ids":[5,6]}],"usage":{"prompt_tokens":7,"total_tokens":9,'
    b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}'
)
SSE_LAST = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"total_tokens":8,'
    b'"completion_tokens":5,"prompt_tokens_details":null}}\n\ndata: [DONE]\n\n'
)


@pytest.mark.parametrize(
    ("content", "tokens"),
    [
        (VLLM_BODY, (7, 2)),  # generated text that looks like usage is never read as it
        (SSE_LAST, (3, 5)),
        (b'{"usage":{"prompt_tokens":1,"completion_tokens":0}}', (1, 0)),
        (b'{"choices":[]}', None),
        (b'{"usage":null}', None),
        (b'{"usage":{"prompt_tokens":"1","completion_tokens":2}}', None),
        (b'{"usage":{"prompt_tokens":1', None),  # cut off
        (b'{"usage":{' + b" " * 600 + b"}", None),  # not vLLM's: too long to be usage
    ],
)
def test_usage_tokens(content: bytes, tokens: tuple[int, int] | None) -> None:
    assert usage_tokens(content) == tokens


def test_run_usage_counts() -> None:
    usage = RunUsage()
    usage.tokens((7, 2))
    usage.tokens(None)
    for status in (200, 200, 404, 503):
        usage.answered(status)
    rollouts = {"2xx": 2, "4xx": 1, "5xx": 1}
    expected = {"prompt_tokens": 7, "completion_tokens": 2, "rollouts": rollouts, "held_s": 0.0}
    assert usage.status() == expected


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out[tuple(sorted(labels[len(name) :].strip("{}").split(",")))] = float(value)
    return out


async def replica_tokens(c: Cluster) -> tuple[float, float]:
    prompt = completion = 0.0
    async with httpx.AsyncClient() as client:
        for url in c.replica_urls:
            text = (await client.get(url + "/metrics")).text
            prompt += sum(samples(text, "vllm:prompt_tokens_total").values())
            completion += sum(samples(text, "vllm:generation_tokens_total").values())
    return prompt, completion


async def test_runs_tokens_add_up_to_the_replicas_own(tmp_path: Path) -> None:
    async with shared(tmp_path) as c:
        before = await replica_tokens(c)
        sent: dict[str, list[int]] = {"run-a": [0, 0], "run-b": [0, 0]}
        for run, n in (("run-a", 4), ("run-b", 2)):
            async with as_run(c, run) as client:
                assert (await client.post("/v1/load_lora_adapter", json=load(tmp_path, run, 1))
                        ).status_code == 200  # fmt: skip
                for i in range(n):
                    prompt = list(range(1, 9 + i))
                    body: dict[str, Any] = {"model": "trl-policy-v1", "prompt": prompt,
                                            "max_tokens": 3}  # fmt: skip
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    sent[run][0] += r.json()["usage"]["prompt_tokens"]
                    sent[run][1] += r.json()["usage"]["completion_tokens"]
                stream = {"model": "trl-policy-v1", "prompt": [4, 5, 6], "max_tokens": 4,
                          "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                r = await client.post("/v1/completions", json=stream)
                events = [orjson.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]  # fmt: skip
                usage = events[-1]["usage"]
                sent[run][0] += usage["prompt_tokens"]
                sent[run][1] += usage["completion_tokens"]
                bad = await client.post("/v1/completions", json={**body, "n": 0})
                assert bad.status_code == 400
        async with httpx.AsyncClient(base_url=c.url) as client:
            text = (await client.get("/metrics")).text
        prompt = samples(text, "gateway_run_prompt_tokens_total")
        completion = samples(text, "gateway_run_completion_tokens_total")
        rollouts = samples(text, "gateway_run_rollouts_total")
        for run, (p, k) in sent.items():
            assert prompt[(f'run="{run}"',)] == p and completion[(f'run="{run}"',)] == k
        assert rollouts[('run="run-a"', 'status_class="2xx"')] == 5
        assert rollouts[('run="run-a"', 'status_class="4xx"')] == 1
        assert rollouts[('run="run-b"', 'status_class="2xx"')] == 3
        after = await replica_tokens(c)
        assert sum(p for p, _ in sent.values()) == after[0] - before[0]
        assert sum(k for _, k in sent.values()) == after[1] - before[1]
        async with as_run(c, "run-b") as client:
            own = (await client.get("/gateway/status")).json()["runs"]
        assert own[0]["usage"]["prompt_tokens"] == sent["run-b"][0]
