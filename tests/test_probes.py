"""Liveness and readiness (``gateway/api/probes.py``) of the real ``rollout-gateway serve``
process, and the shipped manifests, compose file and image that use them (issue 34, item 7).

* ``/livez`` is 200 while every replica is down; ``/readyz`` (and ``/health``) 503 then,
  all 200 once a replica is up;
* SIGTERM with a rollout in flight: ``/readyz`` turns 503 at once (Kubernetes stops
  sending), ``/livez`` stays 200, new work gets 503, the rollout completes, then exit 0;
* every probe path in ``deploy/k8s``, ``deploy/compose`` and the image's HEALTHCHECK
  answers on a real gateway, and the liveness ones answer 200 with the fleet down.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rollout_testbed.procs import free_port, wait_http

from gateway.config import Settings
from gateway.http import liveness
from tests.deploy._proc import REPO, base_env, process, sim_replica
from tests.deploy.test_compose_overlay import load as load_compose
from tests.deploy.test_shutdown import Stream
from tests.eventually import eventually_sync

GATEWAY_CONTAINER = "rollout-gateway"


@contextlib.contextmanager
def gateway(replica: str, log: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--replica", replica, "--port", str(port),
           "--health-interval-s", "0.2", *extra]  # fmt: skip
    with process(cmd, env=base_env(), log=log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/livez", timeout=30)
        yield url, proc


def _status(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


def test_livez_ignores_the_replicas_readyz_follows_them(tmp_path: Path) -> None:
    sim_port = free_port()
    replica = f"http://127.0.0.1:{sim_port}"  # nothing listens there yet
    # A probe carries no key: the probes answer without one, like /health.
    with gateway(replica, tmp_path / "gw.log", "--api-key", "probe-test-key") as (url, _):
        assert _status(url + "/livez") == 200
        assert _status(url + "/readyz") == 503
        assert _status(url + "/health") == 503  # unchanged for TRL
        ready = httpx.get(url + "/readyz", timeout=5).json()["error"]
        assert "0/1 replicas healthy" in ready["message"], ready
        with sim_replica(port=sim_port):
            eventually_sync(lambda: _status(url + "/readyz") == 200, "/readyz 200 once up")
            assert _status(url + "/livez") == 200
            assert _status(url + "/health") == 200
        eventually_sync(lambda: _status(url + "/readyz") == 503, "/readyz 503 once down")
        assert _status(url + "/livez") == 200
        assert httpx.post(url + "/livez", timeout=5).status_code == 405


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_drain_is_not_ready_but_alive(tmp_path: Path, workers: str) -> None:
    """In ``--workers 2`` mode each worker answers the probes itself (never through the
    owner, which stops last)."""
    with (
        sim_replica("--latency-model", "decode=0.05") as replica,
        gateway(
            replica, tmp_path / "gw.log", "--shutdown-timeout-s", "30", "--workers", workers
        ) as (url, proc),
    ):
        eventually_sync(lambda: _status(url + "/readyz") == 200, "/readyz 200")
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        stream = Stream(url, model, max_tokens=100)  # ~5 s of decoding
        stream.start()
        assert stream.first.wait(10) and stream.error is None
        proc.send_signal(signal.SIGTERM)
        eventually_sync(lambda: _status(url + "/readyz") == 503, "/readyz 503 after SIGTERM")
        body = {"model": model, "prompt": "late", "max_tokens": 1}
        late = httpx.post(url + "/v1/completions", json=body, timeout=5)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert _status(url + "/livez") == 200
        assert proc.wait(30) == 0
        stream.join(5)
        assert stream.done and stream.error is None, (stream.chunks, stream.error)


def _manifest_probes() -> dict[str, dict[str, Any]]:
    """The gateway sidecar's probes in ``deploy/k8s``: ``{kind: probe}``."""
    docs = yaml.safe_load_all((REPO / "deploy/k8s/trainer-job.yaml").read_text())
    (job,) = [d for d in docs if d and d.get("kind") == "Job"]
    pod = job["spec"]["template"]["spec"]
    (gw,) = [c for c in pod["initContainers"] if c["name"] == GATEWAY_CONTAINER]
    return {k: gw[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in gw}


def _compose_gateway_paths() -> list[str]:
    """Paths the compose files' gateway healthchecks ask (none: the image's HEALTHCHECK)."""
    paths = []
    for file in sorted((REPO / "deploy/compose").glob("*.yaml")):
        service = (load_compose(file.name).get("services") or {}).get("gateway") or {}
        test = " ".join(map(str, (service.get("healthcheck") or {}).get("test") or []))
        paths += re.findall(r"http://[^/\s'\"]+(/[^\s'\"?]*)", test)
    return paths


def _dockerfile_healthcheck() -> str:
    text = (REPO / "Dockerfile").read_text()
    (command,) = re.findall(r"^HEALTHCHECK .*?CMD (\[.*?\])", text, re.M | re.S)
    return command


def test_the_shipped_probes_name_endpoints_that_answer(tmp_path: Path) -> None:
    probes = _manifest_probes()
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The image's HEALTHCHECK runs ``gateway.http.liveness``, which asks ``/livez``.
    assert '"-m", "gateway.http.liveness"' in _dockerfile_healthcheck()
    liveness_paths = {probes["livenessProbe"]["httpGet"]["path"], liveness.PATH}
    paths = {p["httpGet"]["path"] for p in probes.values()} | liveness_paths
    paths |= set(_compose_gateway_paths())
    sim_port = free_port()
    with gateway(f"http://127.0.0.1:{sim_port}", tmp_path / "gw.log") as (url, _):
        for path in sorted(liveness_paths):  # the fleet is down: never restart for it
            assert _status(url + path) == 200, path
        with sim_replica(port=sim_port):
            eventually_sync(lambda: _status(url + "/readyz") == 200, "/readyz 200")
            for path in sorted(paths):  # the kubelet: 200-399 is a pass
                assert 200 <= _status(url + path) < 400, path


def test_grace_periods_outlast_the_drain() -> None:
    """Every shipped stop lets the drain finish: the orchestrator's grace is above the
    drain the gateway is given there (its own setting, else the default), or the drain
    ends in SIGKILL (docs/operations.md, "Graceful shutdown")."""
    default = Settings.model_fields["shutdown_timeout_s"].default
    docs = yaml.safe_load_all((REPO / "deploy/k8s/trainer-job.yaml").read_text())
    (job,) = [d for d in docs if d and d.get("kind") == "Job"]
    pod = job["spec"]["template"]["spec"]
    (gw,) = [c for c in pod["initContainers"] if c["name"] == GATEWAY_CONTAINER]
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert (
        int(env.get("GATEWAY_SHUTDOWN_TIMEOUT_S", default)) < pod["terminationGracePeriodSeconds"]
    )
    compose = load_compose("compose.yaml")["services"]["gateway"]
    drain = int(compose.get("environment", {}).get("GATEWAY_SHUTDOWN_TIMEOUT_S", default))
    assert drain < int(str(compose["stop_grace_period"]).removesuffix("s"))
    for doc in ("README.md", "docs/operations.md"):
        stops = re.findall(r"--stop-timeout (\d+)", (REPO / doc).read_text())
        assert stops and all(int(s) > default for s in stops), (doc, stops)
