"""Replay TRL 1.16's recorded wire trace (shared/reference) against the gateway over 2 sims:
every call must succeed exactly as TRL would judge it, and broadcasts must reach both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.cluster import cluster

TRACE = Path(__file__).parent / "data" / "trl-1.16-lora-sync-wire-trace.jsonl"
# What TRL forwards verbatim; the rest (Host, Content-Length, ...) is per-connection.
_KEEP = {"user-agent", "accept", "content-type"}


def load_trace() -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in TRACE.read_bytes().splitlines() if line.strip()]


def request_args(call: dict[str, Any]) -> dict[str, Any]:
    """One recorded call as ``httpx`` request arguments (headers TRL really sends)."""
    return {
        "method": call["method"],
        "url": call["path"],
        "params": call["query"] or None,
        "content": orjson.dumps(call["body"]) if call["body"] is not None else None,
        "headers": {k: v for k, v in call["headers"].items() if k.lower() in _KEEP},
    }


def check_response(call: dict[str, Any], r: httpx.Response) -> None:
    """What TRL itself relies on in the answer to ``call``."""
    where = f"{call['method']} {call['path']} {call['body']}"
    assert r.status_code == 200, f"{where}: {r.status_code} {r.text}"
    if call["path"] == "/v1/completions":
        assert r.headers["content-type"].startswith("application/json")
        choice = r.json()["choices"][0]
        assert choice["token_ids"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    if call["path"] == "/server_info":
        cfg = r.json()["vllm_config"]
        assert cfg["lora_config"] is not None
        assert cfg["parallel_config"]["data_parallel_size"] == 1
    if call["path"] == "/v1/models":
        assert r.json()["data"][0]["max_model_len"] > 0


async def test_trace_replay_succeeds_and_broadcasts() -> None:
    trace = load_trace()
    assert len(trace) >= 20
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url) as client:
        for call in trace:
            r = await client.request(**request_args(call))
            check_response(call, r)

        loads = [x["body"]["lora_name"] for x in trace if x["path"] == "/v1/load_lora_adapter"]
        unloads = [x["body"]["lora_name"] for x in trace if x["path"] == "/v1/unload_lora_adapter"]
        pauses = sum(x["path"] == "/pause" for x in trace)
        for i in range(2):
            stats = c.sim(i).stats
            assert stats.loads == loads, f"replica {i} loads"
            assert stats.unloads == unloads, f"replica {i} unloads"
            # One more resume: the one that admitted the replica (the fleet was not paused).
            assert len(stats.pauses) == pauses and stats.resumes == pauses + 1
        served = sum(c.sim(i).stats.requests_by_model.total() for i in range(2))
        assert served == sum(x["path"] == "/v1/completions" for x in trace)
