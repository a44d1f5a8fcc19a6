"""The sidecar image: hadolint, the image's conventions, and its exact ENTRYPOINT + CMD
run outside a container (no Docker engine on these machines) against a sim replica."""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import free_port, wait_http

from tests.deploy._proc import REPO, base_env, process, sim_replica
from tests.deploy.tools import tool

# The first test to need promtool/hadolint/... may install them (ensure_tools.sh).
pytestmark = pytest.mark.timeout(600)

DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): continuation lines joined, comments dropped."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        logical.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        elif op == "FROM":
            words = rest.split()
            base = words[0]
            for key, value in args.items():
                base = base.replace("${" + key + "}", value)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for arg in stage.all("ENV"):
        for item in shlex.split(arg):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def exec_form(arg: str) -> list[str]:
    value = json.loads(arg)
    assert isinstance(value, list), f"{arg!r} must be exec (JSON) form"
    return [str(v) for v in value]


@pytest.fixture(scope="module")
def runtime() -> Stage:
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    return stages[-1]


def test_hadolint_clean() -> None:
    res = subprocess.run(
        [str(tool("hadolint")), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_image_conventions(runtime: Stage) -> None:
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    assert len(stages) >= 2, "multi-stage: build the venv, copy it into a clean runtime"
    assert all("slim" in s.base for s in stages), [s.base for s in stages]
    assert any("--from=" in c for c in runtime.all("COPY")), "runtime copies from the build"
    user = runtime.last("USER")
    assert user and user.split(":")[0] not in ("root", "0"), "must run as non-root"
    assert exec_form(runtime.last("ENTRYPOINT") or "null") == ["rollout-gateway", "serve"]
    assert runtime.last("HEALTHCHECK"), "HEALTHCHECK required"
    env = env_of(runtime)
    assert {"GATEWAY_HOST", "GATEWAY_PORT"} <= set(env)
    # Only the gateway's dependencies: nothing heavy in the install, nor in the package.
    runs = " ".join(" ".join(s.all("RUN")) for s in stages).lower()
    assert "torch" not in runs and "vllm" not in runs
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.split("[")[0].split(">")[0].split("=")[0].strip()
                in ("torch", "vllm", "transformers", "trl")]  # fmt: skip


def test_dockerignore_keeps_context_small() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert patterns[0] == "*", "allow-list: ignore everything, then re-include"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    copied = {
        src for s in stages for c in s.all("COPY") if "--from=" not in c for src in c.split()[:-1]
    }
    assert copied <= included, f"COPY sources not in the build context: {copied - included}"


def test_entrypoint_serves_a_replica_outside_a_container(runtime: Stage, tmp_path: Path) -> None:
    """ENTRYPOINT + CMD, verbatim, with the image's ENV (PATH pointing at this venv instead
    of /opt/gateway) plus what `docker run -e` would add; then the HEALTHCHECK command."""
    argv = exec_form(runtime.last("ENTRYPOINT") or "[]") + exec_form(runtime.last("CMD") or "[]")
    image_env = env_of(runtime)
    image_env.pop("PATH")
    port = free_port()
    with sim_replica() as replica:
        env = base_env(image_env)
        env.update(GATEWAY_REPLICAS=replica, GATEWAY_HOST="127.0.0.1", GATEWAY_PORT=str(port))
        log = tmp_path / "gateway.log"
        with process(argv, env=env, log=log) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health")
            models = httpx.get(url + "/v1/models", timeout=5).json()
            assert models["data"], models
            out = httpx.post(url + "/v1/completions", timeout=10,
                             json={"model": models["data"][0]["id"], "prompt": "hi",
                                   "max_tokens": 4})  # fmt: skip
            assert out.status_code == 200, out.text
            health = runtime.last("HEALTHCHECK") or ""
            assert health.startswith("--") and " CMD " in health
            # Outside a container PID 1 is not the gateway: name its process instead.
            probe = [*exec_form(health.split(" CMD ", 1)[1]), "--pid", str(proc.pid)]
            res = subprocess.run(probe, env=env, timeout=10, check=False)
            assert res.returncode == 0, "HEALTHCHECK command failed against a healthy gateway"
            proc.terminate()
            assert proc.wait(15) == 0
        # GATEWAY_LOG_FORMAT=json from the image: every log line is one JSON object.
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        assert lines, "no log output"
        records = [json.loads(ln) for ln in lines]
        assert any("gateway up" in r["message"] for r in records)
    # The healthcheck fails once nothing listens.
    res = subprocess.run(probe, env=env, timeout=10, check=False, capture_output=True)
    assert res.returncode != 0


def _healthcheck(runtime: Stage) -> list[str]:
    health = runtime.last("HEALTHCHECK") or ""
    return exec_form(health.split(" CMD ", 1)[1])


@pytest.mark.parametrize("how", ["flag", "env", "yaml", "workers"])
def test_healthcheck_probes_the_port_however_it_was_set(
    runtime: Stage, tmp_path: Path, how: str
) -> None:
    """The image's HEALTHCHECK, verbatim, against the ENTRYPOINT with the port set by
    container arguments (a flag), by GATEWAY_PORT, or by the YAML file, while the image's
    GATEWAY_PORT=8000 stays in the environment (``workers``: two data-plane processes,
    whose listening sockets are children's). Its probe follows the listening socket."""
    argv = exec_form(runtime.last("ENTRYPOINT") or "[]")
    image_env = env_of(runtime)
    image_env.pop("PATH")
    port = free_port()
    with sim_replica() as replica:
        env = base_env(image_env)
        env.update(GATEWAY_REPLICAS=replica, GATEWAY_HOST="127.0.0.1")
        if how in ("flag", "workers"):
            argv = [*argv, "--port", str(port)]
        if how == "workers":
            argv += ["--workers", "2"]
        if how == "env":
            env["GATEWAY_PORT"] = str(port)
        if how == "yaml":
            cfg = tmp_path / "gw.yaml"
            cfg.write_text(f"port: {port}\n")
            env.pop("GATEWAY_PORT")  # the YAML file is below the environment
            env["GATEWAY_CONFIG"] = str(cfg)
        with process(argv, env=env, log=tmp_path / "gw.log") as proc:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
            probe = [*_healthcheck(runtime), "--pid", str(proc.pid)]
            res = subprocess.run(probe, env=env, timeout=10, check=False, capture_output=True)
            assert res.returncode == 0, res.stderr
        res = subprocess.run(probe, env=env, timeout=10, check=False, capture_output=True)
        assert res.returncode != 0 and b"listen on no TCP port" in res.stderr


def test_parser_handles_continuations() -> None:
    args, stages = parse_dockerfile(
        "ARG B=python:3.11-slim\nFROM ${B} AS build\nRUN a \\\n    && b\n"
        "# c\nFROM ${B}\nENV A=1 \\\n    B=two\nCMD []\n"
    )
    assert args == {"B": "python:3.11-slim"}
    assert [s.name for s in stages] == ["build", None]
    assert stages[0].all("RUN") == ["a && b"]
    assert env_of(stages[1]) == {"A": "1", "B": "two"}
