"""TRL 1.16's own client code against the gateway over 2 sim replicas.

TRL imports torch, so its code runs in the vLLM venv (``make vllm``) as a subprocess while
this test's event loop serves the gateway. A missing venv fails the test: it never skips.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rollout_testbed.local.vllm_env import find_vllm_python

from tests.cluster import cluster

PROBE = Path(__file__).with_name("trl_probe.py")


@pytest.mark.e2e
async def test_trl_chooses_adapter_only_sync_and_rolls_out(tmp_path: Path) -> None:
    python = find_vllm_python(None)
    assert python is not None and python.exists(), "vLLM venv missing: run `make vllm`"
    async with cluster(2) as c:
        proc = await asyncio.create_subprocess_exec(
            str(python), str(PROBE), c.url, str(tmp_path / "trl-policy-v1"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        result = json.loads(out.decode().strip().splitlines()[-1])
        assert result["adapter_only_sync"] is True
        assert result["data_parallel_size"] == 1
        assert result["max_model_len"] > 0
        assert len(result["token_ids"]) == 8 == len(result["logprobs"])
        for i in range(2):
            assert c.sim(i).stats.loads == ["trl-policy-v1"]
            assert c.sim(i).stats.unloads == ["trl-policy-v1"]
            assert c.sim(i).stats.pauses == ["keep"]
        served = [c.sim(i).stats.requests_by_model["trl-policy-v1"] for i in range(2)]
        assert sorted(served) == [0, 1]
