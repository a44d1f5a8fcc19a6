"""The first minute tells the truth: start-up warnings, the start line and --version, run
as a user runs them: real gateway processes in front of real replica processes (the sim,
and the sim with one of TRL's prerequisites left off, ``tests/partial_replica.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port, sim_argv

from gateway import __version__
from gateway.config import load_settings
from gateway.fleet.preflight import (
    Capabilities,
    exposure_warning,
    replica_warning,
    source,
)
from tests.conftest import CLIENT_KEY

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

# The partial replicas, by what each leaves off (see tests/partial_replica.py).
PARTIAL = (("dev-mode",), ("lora-updating",), ("enable-lora",))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """[complete sim, no dev mode, no runtime LoRA updating, no --enable-lora]."""
    logs = tmp_path_factory.mktemp("replicas")
    procs = []
    port = free_port()
    procs.append(Proc("sim", sim_argv(port, python=PY), logs / "sim.log",
                      url=f"http://127.0.0.1:{port}", new_session=False))  # fmt: skip
    for off in PARTIAL:
        port = free_port()
        procs.append(Proc(f"partial-{off[0]}", [PY, "-m", "tests.partial_replica", str(port), *off],
                          logs / f"{off[0]}.log", cwd=REPO, url=f"http://127.0.0.1:{port}",
                          new_session=False))  # fmt: skip
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http("/health", request_timeout=1.0)
        yield [p.url for p in procs]
    finally:
        for proc in procs:
            proc.stop(grace=10, kill_wait=5)


def _start(args: list[str], env: dict[str, str], log: Path) -> list[dict[str, str]]:
    """Run ``rollout-gateway serve ARGS`` until it serves, stop it; its JSON log records."""
    port = free_port()
    argv = [PY, "-m", "gateway", "serve", "--port", str(port), "--log-format", "json", *args]
    proc = Proc("gateway", argv, log, env=env, url=f"http://127.0.0.1:{port}", new_session=False)
    with proc:
        proc.wait_http("/metrics", request_timeout=1.0)
        proc.stop(grace=15, kill_wait=5)
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _up_line(records: list[dict[str, str]]) -> str:
    [up] = [r["message"] for r in records if r["message"].startswith("gateway up")]
    return up


def test_one_warning_per_replica_lacking_what_trl_needs(fleet: list[str], tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    args = [a for url in [*fleet, dead] for a in ("--replica", url)]
    records = _start(args, _env(), tmp_path / "gw.log")
    warnings = [r["message"] for r in records if r["level"] == "WARNING"]
    about = {i: [w for w in warnings if w.startswith(f"replica {i} (")] for i in range(5)}
    assert about[0] == [], about[0]  # the complete replica: nothing to say
    for i in (1, 2, 3):  # exactly one line each, naming it and what TRL will do
        assert len(about[i]) == 1, about[i]
        assert about[i][0].startswith(f"replica {i} ({fleet[i]}) is not ready for TRL")
    no_dev, no_updating, no_lora = about[1][0], about[2][0], about[3][0]
    assert "no /server_info" in no_dev and "no /pause" in no_dev
    assert "VLLM_SERVER_DEV_MODE=1 is not set" in no_dev and "stops" in no_dev
    assert "no runtime LoRA" not in no_dev  # its load route is there
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 is not set" in no_updating
    assert "/pause" not in no_updating.split(". Start it")[0]
    assert "--enable-lora" in no_lora and "NCCL" in no_lora and "/pause" not in no_lora
    # The dead replica is reported as down, nothing else.
    assert about[4] == [
        f"replica 4 ({dead}) is down at start (refused); it joins when a probe passes"
    ]
    # Loopback: no exposure warning. The start line says what it runs with.
    assert not [w for w in warnings if "not loopback" in w]
    up = _up_line(records)
    assert up.startswith("gateway up on http://127.0.0.1:") and "4/5 replicas healthy" in up
    assert (
        f"version {__version__}, auth off (no key given), adapter roots none (any lora_path)" in up
    )
    assert up.endswith("replicas from static list (5)")


def test_the_checks_have_no_side_effects(fleet: list[str], tmp_path: Path) -> None:
    """Nothing paused, loaded, unloaded or generated on any replica by a start. (The one
    ``/resume`` a start sends is the admission's, which puts a replica in the fleet's pause
    state, running here: docs/operations.md, "Control calls".)"""
    before = httpx.get(fleet[0] + "/sim/stats", timeout=5).json()
    _start(["--replica", fleet[0], "--replica", fleet[2]], _env(), tmp_path / "gw.log")
    stats = httpx.get(fleet[0] + "/sim/stats", timeout=5).json()
    assert stats["pauses"] == [] and stats["resumes"] == before["resumes"] + 1, stats
    assert stats["loads"] == [] and stats["unloads"] == [], stats
    assert stats["requests_by_model"] == {} and stats["paused"] is False, stats


def test_open_port_without_key_warns_and_a_key_silences_it(
    fleet: list[str], tmp_path: Path
) -> None:
    replicas = tmp_path / "replicas.txt"
    replicas.write_text(fleet[0] + "\n")
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for root in roots:
        Path(root).mkdir()  # a root that does not exist is refused at start
    args = ["--host", "0.0.0.0", "--replicas-file", str(replicas), "--adapter-root", roots[0],
            "--adapter-root", roots[1]]  # fmt: skip
    # No key beyond loopback is refused unless chosen (tests/test_start_errors.py).
    records = _start([*args, "--no-auth"], _env(), tmp_path / "open.log")
    [open_] = [r["message"] for r in records if "not loopback" in r["message"]]
    assert [r["level"] for r in records if "not loopback" in r["message"]] == ["WARNING"]
    assert open_.startswith("listening on 0.0.0.0, not loopback, with no API key")
    assert "load adapters, pause the fleet" in open_
    up = _up_line(records)
    assert (
        f"auth off (--no-auth), adapter roots {roots[0]}, {roots[1]}, replicas from file {replicas}"
        in up
    )
    records = _start(args, _env(GATEWAY_API_KEY=CLIENT_KEY), tmp_path / "keyed.log")
    assert not [r for r in records if "not loopback" in r["message"]]
    assert "auth on (api key)" in _up_line(records)
    assert CLIENT_KEY not in (tmp_path / "keyed.log").read_text()


@pytest.mark.parametrize("how", ["script", "module"])
def test_version(how: str) -> None:
    script = str(Path(PY).parent / "rollout-gateway")
    argv = [script, "--version"] if how == "script" else [PY, "-m", "gateway", "--version"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    # the commit: tests/test_build_info.py
    assert re.fullmatch(rf"rollout-gateway {re.escape(version)} \(commit \S+\)\n", out), out
    assert version == __version__


# --- the pure rules, edge by edge --------------------------------------------------------


def test_cannot_tell_is_never_a_warning() -> None:
    assert replica_warning("0 (x)", Capabilities(None, None, None, None)) is None
    assert replica_warning("0 (x)", Capabilities(True, True, True, True)) is None
    line = replica_warning("7 (http://r:1)", Capabilities(True, False, None, None))
    assert line is not None and line.startswith("replica 7 (http://r:1) is not ready")
    assert "no /pause" in line and "/server_info (404" not in line


@pytest.mark.parametrize(
    ("host", "warned"),
    [("127.0.0.1", False), ("127.0.0.5", False), ("::1", False), ("localhost", False),
     ("0.0.0.0", True), ("::", True), ("10.1.2.3", True), ("gateway.internal", True)],
)  # fmt: skip
def test_exposure_by_host(host: str, warned: bool) -> None:
    settings = load_settings({"host": host, "replicas": ["http://r:1"]}, environ={})
    assert (exposure_warning(settings) is not None) is warned


def test_exposure_with_admin_key_only_still_warns_about_rollouts() -> None:
    settings = load_settings(
        {"host": "0.0.0.0", "replicas": ["http://r:1"], "admin_key": "a"}, environ={}
    )
    line = exposure_warning(settings)
    assert line is not None and "can generate." in line and "pause" not in line


def test_source_names_every_discovery_source() -> None:
    settings = load_settings(
        {"replicas": ["http://r:1"], "discovery_dns": "vllm:8000",
         "discovery_nameserver": "10.0.0.10:53", "replicas_file": "/etc/replicas"},
        environ={},
    )  # fmt: skip
    assert source(settings) == (
        "static list (1) + DNS vllm:8000 via 10.0.0.10:53 every 5s + file /etc/replicas"
    )
