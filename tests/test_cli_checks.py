"""The CLI refuses mistakes with a clean error, and every setting an operator may need in
an incident has a flag (or a documented reason not to). Real processes where the
behaviour is the process's: exit status, stderr, what the running gateway enforces."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port

from gateway.cli import NO_FLAG, _serve_parser
from gateway.config import Settings, load_settings
from tests.conftest import ADMIN_KEY, CLIENT_KEY

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}, **extra}


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gateway", "serve", *args], capture_output=True,
                          text=True, env=env or _env(), timeout=60)  # fmt: skip


def _flag_dests() -> set[str]:
    parser = _serve_parser()
    return {a.dest for a in parser._actions if a.dest not in ("help", "config")}


def test_every_setting_has_a_flag_or_a_reason() -> None:
    fields = set(Settings.model_fields)
    flags = _flag_dests() - {f"{name}_file" for name in ("upstream_token", "api_key", "admin_key")}
    assert flags <= fields, flags - fields
    assert fields - flags == set(NO_FLAG), {
        "no flag, no reason": fields - flags - set(NO_FLAG),
        "reason for a flagged or unknown setting": set(NO_FLAG) - (fields - flags),
    }


def test_the_docs_give_each_reason() -> None:
    docs = (REPO / "docs" / "configuration.md").read_text()
    section = docs.split("## Settings without a flag", 1)[1].split("\n## ", 1)[0]
    for name in NO_FLAG:
        assert f"`{name}`" in section, name


@pytest.mark.parametrize(
    "name",
    ["health_min_replicas", "connect_timeout_s", "read_timeout_s", "broadcast_timeout_s",
     "health_timeout_s", "health_interval_s", "unhealthy_threshold", "healthy_threshold",
     "adapter_load_deadline_s", "shutdown_timeout_s"],
)  # fmt: skip
def test_incident_settings_have_flags(name: str) -> None:
    assert name in _flag_dests()


def test_new_flags_reach_the_settings() -> None:
    args = vars(_serve_parser().parse_args([
        "--replica", "http://a:1", "--health-min-replicas", "1", "--connect-timeout-s", "1.5",
        "--read-timeout-s", "30", "--broadcast-timeout-s", "45", "--unhealthy-threshold", "3",
        "--healthy-threshold", "2", "--adapter-load-deadline-s", "60",
        "--max-tokens-limit", "4096", "--router", "least_loaded",
    ]))  # fmt: skip
    s = load_settings(args, environ={"GATEWAY_READ_TIMEOUT_S": "999"})
    assert (s.health_min_replicas, s.connect_timeout_s, s.read_timeout_s) == (1, 1.5, 30.0)
    assert (s.broadcast_timeout_s, s.unhealthy_threshold, s.healthy_threshold) == (45.0, 3, 2)
    assert (s.adapter_load_deadline_s, s.max_tokens_limit, s.router) == (60.0, 4096, "least_loaded")


def test_router_typo_is_a_clean_usage_error() -> None:
    r = _serve("--replica", "http://127.0.0.1:1", "--router", "prefx")
    assert r.returncode == 2
    assert "argument --router: invalid choice: 'prefx'" in r.stderr
    for choice in ("prefix", "least_loaded", "round_robin", "random"):
        assert choice in r.stderr
    assert "Traceback" not in r.stderr


def test_router_typo_in_env_is_a_clean_configuration_error() -> None:
    r = _serve(env=_env(GATEWAY_REPLICAS="http://127.0.0.1:1", GATEWAY_ROUTER="prefx"))
    assert r.returncode == 2 and "invalid configuration: router:" in r.stderr
    assert "Traceback" not in r.stderr


def test_env_typo_fails_at_start_naming_the_setting() -> None:
    r = _serve("--replica", "http://127.0.0.1:1",
               env=_env(GATEWAY_MAX_STALNESS="1", GATEWAY_API_KEY_FLIE=CLIENT_KEY))  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "did you mean 'GATEWAY_MAX_STALENESS'?" in r.stderr
    assert "did you mean 'GATEWAY_API_KEY_FILE'?" in r.stderr
    assert CLIENT_KEY not in r.stderr and CLIENT_KEY not in r.stdout


def test_yaml_typo_fails_at_start_naming_the_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("replicas: [http://127.0.0.1:1]\nhealth_min_replica: 1\n")
    r = _serve("--config", str(cfg))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'health_min_replica' (did you mean 'health_min_replicas'?)" in r.stderr


def test_routing_typo_fails_at_start_not_when_routing(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("replicas: [http://127.0.0.1:1]\nrouting: {blok_size: 32}\n")
    r = _serve("--config", str(cfg))
    assert r.returncode == 2 and "did you mean 'block_size'?" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_running_gateway_takes_the_env_key_file_over_an_inline_yaml_key(
    sim_replica: str, tmp_path: Path
) -> None:
    """The precedence as the served gateway enforces it: YAML says one key inline, the
    environment names a key file; the file's key is the one clients must send, for the
    API key and the admin key alike (the flag beats both)."""
    key_file, admin_file = tmp_path / "api-key", tmp_path / "admin-key"
    key_file.write_text(CLIENT_KEY + "\n")
    admin_file.write_text("not-the-admin-key\n")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"replicas: [{sim_replica}]\napi_key: inline-yaml-key\n"
                   "admin_key: inline-yaml-admin\n")  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _env(GATEWAY_API_KEY_FILE=str(key_file), GATEWAY_ADMIN_KEY_FILE=str(admin_file))
    argv = [PY, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port),
            "--admin-key", ADMIN_KEY]  # fmt: skip
    log = tmp_path / "gw.log"
    with Proc("gateway", argv, log, env=env, url=url, new_session=False) as proc:
        proc.wait_http("/metrics", request_timeout=1.0)
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}

        def status(path: str, key: str, payload: object = body) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.post(url + path, json=payload, headers=headers, timeout=10).status_code

        assert status("/v1/completions", CLIENT_KEY) == 200
        assert status("/v1/completions", "inline-yaml-key") == 401
        assert status("/resume", "inline-yaml-admin") in (401, 403)
        assert status("/resume", "not-the-admin-key") in (401, 403)
        assert status("/resume", ADMIN_KEY, None) == 200
    text = log.read_text()
    assert CLIENT_KEY not in text and ADMIN_KEY not in text
    assert re.search(r"auth on \(api key, admin key\)", text), text[-2000:]
