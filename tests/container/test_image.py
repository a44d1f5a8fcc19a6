"""The sidecar image, run as users run it: podman, read-only, unprivileged, the upstream
token from a mounted secret file, in front of token-checking sim replicas on the host.

One gateway container serves the module (start-up costs seconds on 2 busy cores); the
tests run in file order and the last one stops it (the SIGTERM drain).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.container._podman import (
    container,
    inspect,
    logs,
    podman,
    replica_cmd,
    run_python,
    wait_http,
)
from tests.deploy._proc import free_port, process
from tests.eventually import eventually_sync

pytestmark = pytest.mark.timeout(900)

# Each decoded token takes 20 ms: a 150-token stream is ~3 s in flight, long enough to
# stop the container under it; the other requests ask for a few tokens.
REPLICA_ARGS = ("--latency-model", "prefill=0,decode=0.02,concurrency=0")
SECRET_DIR = "/run/secrets/hf"


@dataclass
class Deployment:
    name: str
    url: str
    replicas: list[str]
    token: str
    startup_s: float
    log_lines: list[str] = field(default_factory=list)


def secret_file(root: Path, token: str) -> Path:
    """A directory holding ``token`` as a k8s secret volume would: world-readable file."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "token").write_text(token + "\n")
    (root / "token").chmod(0o644)
    return root


def gateway_flags(port: int, replicas: list[str], secret_dir: Path) -> list[str]:
    """The run flags of a locked-down sidecar; configuration only through GATEWAY_*."""
    return [
        "--network=host",
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--volume",
        f"{secret_dir}:{SECRET_DIR}:ro",
        "--env",
        f"GATEWAY_REPLICAS={','.join(replicas)}",
        "--env",
        "GATEWAY_HOST=127.0.0.1",
        "--env",
        f"GATEWAY_PORT={port}",
        "--env",
        f"GATEWAY_UPSTREAM_TOKEN_FILE={SECRET_DIR}/token",
        "--env",
        "GATEWAY_SHUTDOWN_TIMEOUT_S=20",
    ]


@pytest.fixture(scope="module")
def deployment(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    token = "hf_" + secrets.token_hex(20)
    secret_dir = secret_file(tmp_path_factory.mktemp("secret") / "hf", token)
    ports = [free_port(), free_port()]
    auth = {"Authorization": f"Bearer {token}"}
    with (
        process(replica_cmd(ports[0], secret_dir / "token", *REPLICA_ARGS)),
        process(replica_cmd(ports[1], secret_dir / "token", *REPLICA_ARGS)),
    ):
        replicas = [f"http://127.0.0.1:{p}" for p in ports]
        for url in replicas:
            _wait_replica(url, auth)
        port = free_port()
        start = time.monotonic()
        with container(image, run_flags=gateway_flags(port, replicas, secret_dir)) as name:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", name=name)
            yield Deployment(name, url, replicas, token, time.monotonic() - start)


def _wait_replica(url: str, headers: dict[str, str]) -> None:
    eventually_sync(
        lambda: httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200,
        f"replica {url} up",
        interval=0.1,
        ignore=(httpx.HTTPError,),
    )


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def test_image_has_healthcheck_and_no_build_tools(image: str) -> None:
    """What ships: HEALTHCHECK kept (docker format), uid 10001, and nothing but the gateway:
    no compiler, pip, tests, benchmarks, simulated replica or local-replica tools."""
    meta = inspect(image)
    assert meta["Config"]["User"] == "10001:10001"
    health = meta.get("Healthcheck") or meta["Config"].get("Healthcheck") or {}
    assert health.get("Test", [""])[0] == "CMD", health
    probe = """
import importlib.util as u, json, os, shutil, sys
site = [p for p in sys.path if p.endswith("site-packages")][0]
print(json.dumps({
    "tools": [t for t in ("cc", "gcc", "g++", "clang", "make", "ld", "as", "strip", "pip",
                          "pip3", "apt-get") if shutil.which(t) and t != "apt-get"],
    "modules": [m for m in ("pip", "setuptools", "hatchling", "fastapi", "rollout_testbed",
                            "trainer", "tests", "bench") if u.find_spec(m)],
    "dirs": [d for d in ("/src", "/wheels", "/opt/tools", "/tests", "/bench")
             if os.path.exists(d)],
    "serve": bool(u.find_spec("gateway.cli")) and bool(u.find_spec("gateway.app")),
}))
"""
    found = json.loads(run_python(image, probe).strip().splitlines()[-1])
    assert found == {"tools": [], "modules": [], "dirs": [], "serve": True}, found


def test_runs_as_uid_10001_on_a_read_only_root(deployment: Deployment) -> None:
    """The serving process itself (PID 1, exec-form ENTRYPOINT) is uid/gid 10001, and
    nothing can be written anywhere: no tmpfs needed (--read-only-tmpfs=false)."""
    status = podman("exec", deployment.name, "cat", "/proc/1/status").stdout
    uids = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
    gids = next(ln for ln in status.splitlines() if ln.startswith("Gid:")).split()[1:]
    assert set(uids) == {"10001"} and set(gids) == {"10001"}, (uids, gids)
    cmdline = podman("exec", deployment.name, "cat", "/proc/1/cmdline").stdout
    assert "rollout-gateway\0serve" in cmdline, cmdline
    host = inspect(deployment.name)["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    for path in ("/tmp/x", "/opt/gateway/x", "/x"):
        res = podman("exec", deployment.name, "touch", path, check=False)
        assert res.returncode != 0 and "Read-only file system" in res.stderr, (path, res)


def test_healthcheck_passes(deployment: Deployment) -> None:
    res = podman("healthcheck", "run", deployment.name, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    state = inspect(deployment.name)["State"]
    health = state.get("Health") or state.get("Healthcheck") or {}
    assert health.get("Status") == "healthy", state


def test_completions_streaming_and_adapter_load(deployment: Deployment) -> None:
    """The gateway's routes through the container, with the token injected on each hop."""
    url = deployment.url
    model = _model(url)
    out = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": model, "prompt": "hello", "max_tokens": 4},
    )
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"]
    events = _stream(url, model, max_tokens=5)
    assert events[-1] == "[DONE]" and len(events) >= 6, events
    load = httpx.post(
        url + "/v1/load_lora_adapter",
        timeout=30,
        json={"lora_name": "policy-1", "lora_path": "/adapters/policy-1"},
    )
    assert load.status_code == 200, load.text
    ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    assert "policy-1" in ids, ids
    out = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": "policy-1", "prompt": "hi", "max_tokens": 2},
    )
    assert out.status_code == 200, out.text
    for replica in deployment.replicas:
        counts = httpx.get(replica + "/_auth", timeout=5).json()
        # every request the gateway sent (probes, the load fan-out) carried the token
        assert counts["authorised"] > 0 and counts["rejected"] == 0, (replica, counts)


def _stream(
    url: str, model: str, max_tokens: int, first: threading.Event | None = None
) -> list[str]:
    """The SSE ``data:`` payloads of one streamed completion."""
    events: list[str] = []
    body = {"model": model, "prompt": "stream", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if first is not None:
                    first.set()
    return events


def test_token_never_leaks(deployment: Deployment) -> None:
    """After real traffic: not in a log line, /metrics, /gateway/status or podman inspect."""
    token = deployment.token
    text = logs(deployment.name)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines, "the gateway logged nothing"
    assert all(json.loads(ln) for ln in lines), "GATEWAY_LOG_FORMAT=json: one object per line"
    assert any("gateway up" in json.loads(ln).get("message", "") for ln in lines)
    for where, body in (
        ("logs", text),
        ("/metrics", httpx.get(deployment.url + "/metrics", timeout=10).text),
        ("/gateway/status", httpx.get(deployment.url + "/gateway/status", timeout=10).text),
        ("podman inspect", podman("inspect", deployment.name).stdout),
        ("podman inspect image", podman("image", "inspect", _image_of(deployment)).stdout),
    ):
        assert token not in body, f"the upstream token leaked into {where}"
        assert token[3:] not in body, f"the upstream token leaked into {where}"


def _image_of(deployment: Deployment) -> str:
    return str(inspect(deployment.name)["Image"])


def test_podman_stop_drains_a_stream_in_flight(deployment: Deployment) -> None:
    """SIGTERM (podman stop) with a stream in flight: the stream ends with [DONE], the
    container exits 0, well within the grace period. Stops the module's container."""
    model = _model(deployment.url)
    first = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["events"] = _stream(deployment.url, model, max_tokens=150, first=first)
        except Exception as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(30), "the stream never started"
    grace = 30
    start = time.monotonic()
    podman("stop", "--time", str(grace), deployment.name, timeout=grace + 30)
    drain_s = time.monotonic() - start
    thread.join(30)
    assert "error" not in result, result
    events = result["events"]
    assert isinstance(events, list), events
    assert events[-1] == "[DONE]", events[-3:]
    assert len(events) >= 150, len(events)
    state = inspect(deployment.name)["State"]
    assert state["ExitCode"] == 0, (state, logs(deployment.name)[-3000:])
    assert drain_s < grace, drain_s


def test_healthcheck_is_liveness_not_fleet_readiness(image: str, tmp_path: Path) -> None:
    """With every replica down /health is 503 (not ready) but the HEALTHCHECK passes: a
    sidecar restarted for a bad replica would fix nothing."""
    dead = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    flags = gateway_flags(port, [dead], secret_file(tmp_path / "hf", "hf_unused"))
    with container(image, run_flags=flags) as name:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", status=503, name=name)
        res = podman("healthcheck", "run", name, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
