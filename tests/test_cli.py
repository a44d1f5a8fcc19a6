"""The CLI contract, run as a user would: real processes, real ports, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port, wait_http

from tests.conftest import ADMIN_KEY, CLIENT_KEY, UPSTREAM_TOKEN
from tests.deploy._proc import base_env

PY = sys.executable


def _wait_health(url: str, timeout: float = 20.0, status: int = 200) -> None:
    wait_http(f"{url}/health", timeout=timeout, status=status, request_timeout=1.0)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out, err


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [PY, "-m", "gateway", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--replica", "--host", "--port", "--upstream-token", "--upstream-token-file",
        "--api-key", "--admin-key", "--max-staleness", "--adapter-root", "--config",
        "--log-format", "GATEWAY_",
    ):  # fmt: skip
        assert flag in out, flag
    script = str(Path(PY).parent / "rollout-gateway")
    top = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    listed = [line.split()[0] for line in top.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["serve"]  # the sidecar runs one thing
    testbed = str(Path(PY).parent / "rollout-testbed")
    top = subprocess.run([testbed, "--help"], capture_output=True, text=True, check=True)
    listed = [line.split()[0] for line in top.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["sim-replica", "make-tiny-model", "replicas", "demo"]  # once each


@pytest.mark.parametrize("command", ["sim-replica", "make-tiny-model", "replicas", "train"])
def test_moved_subcommands_say_where_they_went(command: str) -> None:
    r = subprocess.run([PY, "-m", "gateway", command], capture_output=True, text=True)
    assert r.returncode == 2
    assert "moved to" in r.stderr and ("rollout-testbed" in r.stderr or "trainer" in r.stderr)


def test_serve_without_replicas_fails_clearly() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    r = subprocess.run([PY, "-m", "gateway", "serve"], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert "--replica" in r.stderr


def test_serve_with_env_and_secret_files(sim_replica: str, tmp_path: Path) -> None:
    token_file = tmp_path / "hf_token"
    token_file.write_text(UPSTREAM_TOKEN + "\n")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")},
        "GATEWAY_REPLICAS": sim_replica,
        "GATEWAY_PORT": str(port),
        "GATEWAY_API_KEY": CLIENT_KEY,
        "GATEWAY_UPSTREAM_TOKEN_FILE": str(token_file),
        "GATEWAY_LOG_FORMAT": "json",
        "GATEWAY_LOG_LEVEL": "DEBUG",
    }
    proc = subprocess.Popen(
        [PY, "-m", "gateway", "serve"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url)
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{url}/v1/completions", content=b"{", headers=auth).status_code == 400
    finally:
        _, err = _stop(proc)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "the gateway logged nothing"
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    [up] = [r["message"] for r in records if "gateway up" in r["message"]]
    assert up.startswith(f"gateway up on http://127.0.0.1:{port}: 1/1 replicas healthy, router ")
    assert "max_staleness" in up
    assert UPSTREAM_TOKEN not in err and CLIENT_KEY not in err


def test_a_replica_down_at_start_is_a_warning_naming_it(sim_replica: str) -> None:
    port, dead = free_port(), free_port()
    proc = subprocess.Popen(
        [PY, "-m", "gateway", "serve", "--port", str(port), "--replica", sim_replica,
         "--replica", f"http://127.0.0.1:{dead}", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_health(f"http://127.0.0.1:{port}", status=503)  # degraded: 1 of 2 up
    finally:
        _, err = _stop(proc)
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    warnings = [r["message"] for r in records if r["level"] == "WARNING"]
    assert f"replica 1 (http://127.0.0.1:{dead}) is down at start" in " ".join(warnings)
    [up] = [r["message"] for r in records if "gateway up" in r["message"]]
    assert "1/2 replicas healthy" in up


# --- auth: a key from every source is enforced, and the gateway says so ----------------


def _gateway(args: list[str], env: dict[str, str], log: Path) -> Proc:
    port = free_port()
    argv = [str(Path(PY).parent / "rollout-gateway"), "serve", "--port", str(port), *args]
    return Proc("gateway", argv, log, env=base_env(env), url=f"http://127.0.0.1:{port}",
                new_session=False)  # fmt: skip


def _up_line(log: Path) -> str:
    [up] = [line for line in log.read_text().splitlines() if "gateway up on" in line]
    return up


@pytest.mark.parametrize("source", ["flag", "flag-file", "env", "env-file", "yaml", "yaml-file"])
def test_an_api_key_from_every_source_is_enforced(
    source: str, sim_replica: str, tmp_path: Path
) -> None:
    """Each way of giving the client key: a request without it is a 401, with it a 200;
    the start line and /gateway/status say the same as what is enforced."""
    key_file = tmp_path / "api-key"
    key_file.write_text(CLIENT_KEY + "\n")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text({"yaml": f"api_key: {CLIENT_KEY}\n",
                    "yaml-file": f"api_key_file: {key_file}\n"}.get(source, "{}\n"))  # fmt: skip
    args = {"flag": ["--api-key", CLIENT_KEY], "flag-file": ["--api-key-file", str(key_file)]}
    env = {
        "env": {"GATEWAY_API_KEY": CLIENT_KEY},
        "env-file": {"GATEWAY_API_KEY_FILE": str(key_file)},
    }
    log = tmp_path / "gw.log"
    argv = ["--replica", sim_replica, "--config", str(cfg), *args.get(source, [])]
    with _gateway(argv, env.get(source, {}), log) as gw:
        gw.wait_http("/metrics", request_timeout=1.0)
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10).status_code == 401
        assert httpx.get(f"{gw.url}/gateway/status", timeout=10).status_code == 401
        assert httpx.post(f"{gw.url}/pause", timeout=10).status_code == 401
        ok = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=10)
        assert ok.status_code == 200
        status = httpx.get(f"{gw.url}/gateway/status", headers=auth, timeout=10).json()
        assert status["auth"] == {"clients": "api key", "control": "api key"}
    assert "auth on (api key)," in _up_line(log)
    assert CLIENT_KEY not in log.read_text()


def test_an_admin_key_file_keeps_the_client_key_off_control_calls(
    sim_replica: str, tmp_path: Path
) -> None:
    admin_file = tmp_path / "admin-key"
    admin_file.write_text(ADMIN_KEY + "\n")
    log = tmp_path / "gw.log"
    argv = ["--replica", sim_replica, "--api-key", CLIENT_KEY, "--admin-key-file", str(admin_file)]
    with _gateway(argv, {}, log) as gw:
        gw.wait_http("/metrics", request_timeout=1.0)
        client = {"Authorization": f"Bearer {CLIENT_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.post(f"{gw.url}/pause", headers=client, timeout=10).status_code == 401
        assert httpx.post(f"{gw.url}/resume", headers=admin, timeout=10).status_code == 200
        status = httpx.get(f"{gw.url}/gateway/status", headers=client, timeout=10).json()
        assert status["auth"] == {"clients": "api key", "control": "admin key"}
    assert "auth on (api key, admin key)," in _up_line(log)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_no_auth_is_said_as_such(host: str, sim_replica: str, tmp_path: Path) -> None:
    """Without a key: open on loopback, by ``--no-auth`` only beyond it (a start without
    either is refused: tests/test_start_errors.py); the start line says which, the
    exposure warning appears beyond loopback, and /gateway/status says "none"."""
    log = tmp_path / "gw.log"
    chosen = ["--no-auth"] if host == "0.0.0.0" else []
    with _gateway(["--replica", sim_replica, "--host", host, *chosen], {}, log) as gw:
        gw.wait_http("/metrics", request_timeout=1.0)
        status = httpx.get(f"{gw.url}/gateway/status", timeout=10).json()
        assert status["auth"] == {"clients": "none", "control": "none"}
    why = "--no-auth" if chosen else "no key given"
    assert f"auth off ({why})," in _up_line(log)
    warned = [line for line in log.read_text().splitlines() if "not loopback" in line]
    assert bool(warned) is bool(chosen), warned
