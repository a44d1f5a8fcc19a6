"""scripts/install-vllm.sh: the refusal paths (no network, no vLLM needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-vllm.sh"


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_refuses_without_the_local_cpu_torch_wheel(tmp_path: Path) -> None:
    """Never fall back to PyPI's torch: that would be a multi-GB CUDA build."""
    empty = tmp_path / "wheels"
    empty.mkdir()
    venv = tmp_path / "venv"
    env = dict(os.environ, PIP_FIND_LINKS=str(empty))
    env.pop("ROLLOUT_GATEWAY_CACHE", None)
    res = subprocess.run(
        ["bash", str(SCRIPT), str(venv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode != 0
    assert "torch-2.13.0+cpu" in res.stderr
    assert "ERROR" in res.stderr
    assert not venv.exists()
