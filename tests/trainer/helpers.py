"""Run the driver as a subprocess (its own process group) against a sim stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRACE_SEQUENCE_S = 2  # the recorded TRL trace was taken with max_staleness=2

# Small and fast: 2 prompts x G=4 per step, 8-token completions.
FAST = [
    "--model", str(REPO / ".run" / "tiny-model"), "--num-generations", "4",
    "--per-device-train-batch-size", "8", "--micro-batch-size", "8",
    "--max-completion-length", "8", "--progress", "false", "--log-level", "WARNING",
]  # fmt: skip


def trainer_env() -> dict[str, str]:
    env = dict(os.environ)
    extra = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + extra if extra else "")
    env["ROLLOUT_GATEWAY_TRAIN_NO_DELEGATE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def start_trainer(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer", *args], stdout=fh, stderr=subprocess.STDOUT,
            env=trainer_env(), cwd=str(REPO), start_new_session=True,
        )  # fmt: skip


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def expected_sync_sequence(versions: range, max_staleness: int) -> list[tuple[str, str]]:
    """TRL 1.16's control calls for syncs to ``versions`` (path, adapter name or query)."""
    out: list[tuple[str, str]] = []
    for n in versions:
        out += [("/pause", "mode=keep"), ("/v1/load_lora_adapter", f"trl-policy-v{n}"),
                ("/resume", "")]  # fmt: skip
        if n - max_staleness - 1 > 0:
            out.append(("/v1/unload_lora_adapter", f"trl-policy-v{n - max_staleness - 1}"))
    return out


def wire_calls(path: Path) -> list[tuple[str, str]]:
    calls = []
    for rec in read_jsonl(path):
        body = rec.get("body") or {}
        calls.append((rec["path"], body.get("lora_name", rec.get("query", ""))))
    return calls


def run_in_process(args: list[str]) -> int:
    """The CLI in this process (torch is already imported here): saves ~30 s per run."""
    from trainer.cli import run
    from trainer.config import parse_config

    return run(parse_config(args))
