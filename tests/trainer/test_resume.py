"""Kill -9 a run mid-way, resume it: numbering continues, no adapter name collides."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from rollout_testbed.procs import SimFleet

from tests.trainer.helpers import FAST, read_jsonl, run_in_process, start_trainer, wire_calls
from trainer.checkpoint import find_checkpoint
from trainer.metrics import parse_prometheus
from trainer.stack import sim_gateway

pytestmark = pytest.mark.timeout(240)


def sim_faults(stack: SimFleet, method: str, body: dict[str, Any] | None = None) -> None:
    """Set (POST) or clear (DELETE) every sim replica's faults (``/sim/faults``)."""
    data = None if body is None else json.dumps(body).encode()
    for sim in stack.sims:
        req = urllib.request.Request(sim.url + "/sim/faults", data=data, method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


def test_kill_and_resume_continues_numbering(tmp_path: Path) -> None:
    S, total = 1, 9
    out = tmp_path / "run"
    common = [*FAST, "--output-dir", str(out), "--max-staleness", str(S), "--save-steps", "3",
              "--max-steps", str(total)]  # fmt: skip
    with sim_gateway(2, S, tmp_path / "logs") as stack:
        first = start_trainer([*common, "--gateway", stack.url], tmp_path / "run1.log")
        deadline = time.monotonic() + 150
        # kill -9 the whole run (driver + its reward process) once it is past checkpoint-3.
        # First every replica holds every new rollout (completion_hang): the run can then
        # train only on what it already has (at most S + 1 steps of rollouts), so the kill
        # lands before the run ends however long this process stalls. It may be past a
        # later checkpoint by then, so what follows is reckoned from the newest checkpoint
        # on disk once the run is frozen (SIGSTOP).
        while time.monotonic() < deadline:
            rows = read_jsonl(out / "metrics.jsonl")
            if (out / "checkpoint-3").is_dir() and rows and rows[-1]["step"] >= 4:
                break
            assert first.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("run 1 never got past checkpoint-3")
        sim_faults(stack, "POST", {"completion_hang": -1})
        os.killpg(first.pid, signal.SIGSTOP)
        newest = find_checkpoint(out, "latest")
        assert newest is not None
        ck = int(newest.name.removeprefix("checkpoint-"))
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert ck < total, "run 1 finished before it was killed"
        killed_calls = wire_calls(out / "control-wire.jsonl")
        killed_loads = [n for p, n in killed_calls if p == "/v1/load_lora_adapter"]
        saved = json.loads((newest / "rollout_state.json").read_text())
        assert saved["model_version"] == ck + 1  # v1 cold + one sync a step
        resumed = ck + 2  # the first version the resumed run loads
        assert len(killed_loads) >= 5  # the killed run got ahead of its checkpoint

        sim_faults(stack, "DELETE")  # the held rollouts end (their client is gone)
        rc = run_in_process([*common, "--gateway", stack.url, "--resume-from-checkpoint", "latest"])
        assert rc == 0
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
            gw = parse_prometheus(r.read().decode())

    calls = wire_calls(out / "control-wire.jsonl")[len(killed_calls) :]
    summary = json.loads((out / "summary.json").read_text())
    # 1. leftovers of the killed run are unloaded first, then numbering continues
    # The driver records a call after its response, so the kill can land between the
    # gateway loading a version and the record: at most one leftover beyond the wire log.
    leftovers = summary["leftovers_unloaded"]
    newest_killed = max(int(n.rsplit("-v", 1)[1]) for n in killed_loads)
    assert leftovers and set(leftovers) <= {*killed_loads, f"trl-policy-v{newest_killed + 1}"}
    assert f"trl-policy-v{newest_killed}" in leftovers  # the newest is never evicted
    k = len(leftovers)
    assert calls[:k] == [("/v1/unload_lora_adapter", n) for n in leftovers]
    loads = [n for p, n in calls if p == "/v1/load_lora_adapter"]
    assert loads[0] == f"trl-policy-v{resumed}"
    assert loads == [f"trl-policy-v{v}" for v in range(resumed, resumed + len(loads))]
    # 2. no collision: every reused name that was still live at resume (a leftover) was
    #    unloaded before it was loaded again, and the gateway never had to reload a name in
    #    place (every load a clean "ok"). A name the killed run loaded and the gateway had
    #    already evicted (older than max_staleness) is not live, so it needs no unload.
    reused = set(loads) & set(leftovers)
    for name in reused:
        assert calls.index(("/v1/unload_lora_adapter", name)) < calls.index(
            ("/v1/load_lora_adapter", name)
        )
    outcomes = {lab["outcome"]: v for lab, v in gw["gateway_adapter_loads_total"]}
    assert outcomes["ok"] and not any(v for k, v in outcomes.items() if k != "ok"), outcomes
    # 3. steps continue from the checkpoint; the prompt cursor moved on
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # history truncated at ck
    assert rows[ck]["model_version"] == resumed + 1  # step ck+1 ran on the resumed version
    assert summary["steps"] == total and summary["first_version"] == resumed
    assert summary["failed_groups"] == 0 and summary["staleness_max"] <= S
    final = json.loads((out / f"checkpoint-{total}" / "rollout_state.json").read_text())
    assert final["model_version"] == summary["last_version"]
    assert final["prompt_index"] >= total * 2
