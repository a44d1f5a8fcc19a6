"""TRL 1.16's own client code against a gateway URL, from the host: tests/e2e/trl_probe.py
run by the vLLM venv's python (TRL imports torch, which the gateway venv lacks)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from rollout_testbed.local.vllm_env import find_vllm_python

from tests.container._podman import REPO

PROBE = REPO / "tests" / "e2e" / "trl_probe.py"


def probe(url: str, adapter_path: Path, timeout: float = 300) -> dict[str, Any]:
    """wait for /health, /server_info, pause, load ``adapter_path`` as trl-policy-v1,
    resume, one rollout through TRL's rollout loop, unload; the probe's JSON result."""
    python = find_vllm_python(None)
    assert python is not None and python.exists(), "vLLM venv missing: run `make vllm`"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(
        [str(python), str(PROBE), url, str(adapter_path)],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result
