"""The start line tells the truth about the adapter window (issue 34, item 9): in
multi-run mode each run's own ``max_staleness`` (and weight, in-flight cap, root), not the
top-level setting that no run uses; in single-run mode the one window, as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from rollout_testbed.procs import free_port, wait_http

from tests.deploy._proc import base_env, process, sim_replica


def _up_line(args: list[str], log: Path) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--log-format", "json",
           *args]  # fmt: skip
    with process(cmd, env=base_env(), log=log):
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=30)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    [up] = [r["message"] for r in records if r["message"].startswith("gateway up on")]
    return str(up)


def test_multi_run_start_line_shows_each_runs_settings(tmp_path: Path) -> None:
    runs = []
    for name, staleness, extra in [
        ("run-a", 1, {}),
        ("run-b", 2, {"weight": 2, "max_in_flight": 8}),
    ]:
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": staleness, **extra})  # fmt: skip
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"runs": runs}))
    with sim_replica("--max-loras", "12") as replica:
        up = _up_line(["--replica", replica, "--config", str(config)], tmp_path / "multi.log")
    assert (
        "2 runs (run-a: max_staleness 1, weight 1; "
        "run-b: max_staleness 2, weight 2, max_in_flight 8);" in up
    ), up
    assert "max_staleness 4" not in up, up  # the top-level default, used by no run
    assert f"adapter roots run-a {tmp_path / 'run-a'}, run-b {tmp_path / 'run-b'}," in up, up


def test_single_run_start_line_shows_its_window(tmp_path: Path) -> None:
    with sim_replica() as replica:
        up = _up_line(["--replica", replica, "--max-staleness", "3"], tmp_path / "one.log")
    assert ", max_staleness 3; version " in up, up
    assert "adapter roots none (any lora_path)" in up, up
