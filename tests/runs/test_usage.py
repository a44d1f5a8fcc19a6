"""Per-run accounting (``gateway.runs.usage``): vLLM's token counts per run, answers by
status class, time held; they add up to what the replicas themselves counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from rollout_testbed.procs import sim_fleet

from gateway.runs.usage import UNREADABLE, RunUsage, usage_tokens
from tests.cluster import Cluster
from tests.conftest import ADMIN_KEY
from tests.eventually import eventually_sync
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


BODY = {"model": "trl-policy-v1", "prompt": [1, 2, 3, 4], "max_tokens": 3}
SPACED_SSE = (
    b'data: {"id": "c", "choices": [{"text": "a"}], "usage": null}\n\n'
    b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    b"\n\ndata: [DONE]\n\n"
)


@pytest.mark.parametrize(
    ("content", "tokens"),
    [
        (VLLM_BODY, (7, 2)),  # generated text that looks like usage is never read as it
        (SSE_LAST, (3, 5)),
        (b'{"usage":{"prompt_tokens":1,"completion_tokens":0}}', (1, 0)),
        (b'{"choices":[]}', None),
        (b'{"usage":null}', None),
        (b'data: {"choices":[],"usage":null}\n\n', None),
        # Any other layout is read exactly: spaces, newlines, escaped keys, key order.
        (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 2}, "choices": []}', (7, 2)),
        (b'{\n  "usage" :\n {"completion_tokens":2,\n"prompt_tokens":7}}', (7, 2)),
        (b'{"\\u0075sage":{"prompt_tokens":7,"completion_tokens":2}}', (7, 2)),
        (b'{"usage":{' + b" " * 600 + b'"prompt_tokens":7,"completion_tokens":2}}', (7, 2)),
        (SPACED_SSE, (3, 5)),
        (SPACED_SSE.replace(b"\n", b"\r\n"), (3, 5)),  # CRLF line ends
        (b'data:{"usage":\ndata: {"prompt_tokens":3,"completion_tokens":5}}\n\n', (3, 5)),
        (b'{"usage": null, "choices": [{"text": "\\"usage\\": {}"}]}', None),
        # What cannot be read is said so, never guessed.
        (b'{"usage":{"prompt_tokens":"1","completion_tokens":2}}', UNREADABLE),
        (b'{"usage":{"prompt_tokens":1', UNREADABLE),  # cut off
        (b'{"usage": {"prompt_tokens": -1, "completion_tokens": 2}}', UNREADABLE),
        (b'{"usage": {"prompt_tokens": 1.0, "completion_tokens": 2}}', UNREADABLE),
    ],
)
def test_usage_tokens(content: bytes, tokens: tuple[int, int] | None) -> None:
    assert usage_tokens(content) == tokens


def test_run_usage_counts() -> None:
    usage = RunUsage()
    usage.tokens((7, 2))
    usage.tokens(None)
    usage.tokens(UNREADABLE)
    assert usage.unread == {"usage": 1}
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


def _runs_config(path: Path, root: Path, runs: tuple[str, ...]) -> None:
    lines = [f"admin_key: {ADMIN_KEY}", "runs:"]
    for run in runs:
        (root / run / "trl-policy-v1").mkdir(parents=True, exist_ok=True)
        lines.append(f"  - {{name: {run}, key: key-{run}, adapter_root: {root / run}, "
                     "max_staleness: 1}")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def _events(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_behind_a_spaced_upstream_a_run_is_counted_and_named_as_behind_vllm(
    tmp_path: Path,
) -> None:
    """The real CLI, multi-run, in front of sim replicas that write JSON as ``json.dumps``
    does (``"model": "run-a~trl-policy-v1"``, ``"usage": {...}``): every token counted,
    the run's prefix in no answer; and once the run is removed and gone, its last counts
    are still on ``/metrics`` (``DEPARTED_KEEP_S``)."""
    config = tmp_path / "runs.yaml"
    _runs_config(config, tmp_path, ("run-a", "run-b"))
    with sim_fleet(2, tmp_path, sim_args=["--json-layout", "spaced"],
                   gateway_args=["--config", str(config)]) as f:  # fmt: skip
        raw = httpx.post(f.sims[0].url + "/v1/completions", json={**BODY, "model": "tiny-base"})
        assert '"model": "tiny-base"' in raw.text  # the upstream really writes spaces
        client = httpx.Client(base_url=f.url, auth=("run-a", "key-run-a"), timeout=30)
        with client:
            adapter = {"lora_name": "trl-policy-v1", "lora_path": f"{tmp_path}/run-a/trl-policy-v1"}
            r = client.post("/v1/load_lora_adapter", json=adapter)
            assert r.status_code == 200, r.text
            sent = [0, 0]
            answers = [
                client.post("/v1/completions", json={**BODY, "n": 3}),
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "trl-policy-v1",
                        "max_tokens": 3,
                        "messages": [{"role": "user", "content": "héllo"}],
                    },
                ),
            ]
            for answer in answers:
                assert answer.status_code == 200, answer.text
                assert "run-a~" not in answer.text and answer.json()["model"] == "trl-policy-v1"
                sent[0] += answer.json()["usage"]["prompt_tokens"]
                sent[1] += answer.json()["usage"]["completion_tokens"]
            for options in ({"include_usage": True}, None):
                stream = {**BODY, "stream": True, "max_tokens": 4,
                          **({"stream_options": options} if options else {})}  # fmt: skip
                r = client.post("/v1/completions", json=stream)
                assert r.status_code == 200 and "run-a~" not in r.text, r.text
                events = _events(r.text)
                assert {e["model"] for e in events} == {"trl-policy-v1"}
                if options:
                    sent[0] += events[-1]["usage"]["prompt_tokens"]
                    sent[1] += events[-1]["usage"]["completion_tokens"]
            missing = client.post("/v1/completions", json={**BODY, "model": "trl-policy-v9"})
            assert missing.status_code == 404 and "run-a~" not in missing.text
        assert sent[0] > 0 and sent[1] > 0
        text = httpx.get(f.url + "/metrics").text
        assert samples(text, "gateway_run_prompt_tokens_total")[('run="run-a"',)] == sent[0]
        assert samples(text, "gateway_run_completion_tokens_total")[('run="run-a"',)] == sent[1]
        assert not any(samples(text, "gateway_run_answers_unread_total").values())

        _runs_config(config, tmp_path, ("run-b",))  # run-a removed: nothing in flight
        admin = httpx.Client(base_url=f.url, auth=("admin", ADMIN_KEY), timeout=30)
        with admin:
            assert admin.post("/gateway/runs/reload").status_code == 200

            def gone() -> bool:
                runs = admin.get("/gateway/status").json()["runs"]
                return "run-a" not in {r["name"] for r in runs}

            eventually_sync(gone, "run-a drained, unloaded and gone")
        text = httpx.get(f.url + "/metrics").text
        assert samples(text, "gateway_run_prompt_tokens_total")[('run="run-a"',)] == sent[0]
        assert samples(text, "gateway_run_rollouts_total")[('run="run-a"', 'status_class="2xx"')]
        assert ('run="run-a"',) not in samples(text, "gateway_run_in_flight")  # counters only
