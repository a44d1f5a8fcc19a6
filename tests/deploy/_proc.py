"""Subprocess helpers for the deploy tests: free ports, simulated replica processes, polling.

Every process is started by these helpers and stopped by its own PID (never by name);
every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any GATEWAY_* leaking in, venv bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def wait_http(url: str, *, timeout: float = 20.0, status: int = 200) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == status:
                return r
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {status} within {timeout}s (last: {last!r})")


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    """SIGTERM this process (by PID), then SIGKILL if it lingers; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return int(proc.returncode)


@contextlib.contextmanager
def process(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        list(cmd), env=dict(env or base_env()), stdout=out, stderr=out, cwd=REPO
    )
    try:
        yield proc
    finally:
        stop(proc)
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def sim_replica(*args: str, port: int | None = None) -> Iterator[str]:
    """A ``rollout-testbed sim-replica`` process; yields its base URL once it answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "rollout_testbed", "sim-replica", "--port", str(port), *args]
    with process(cmd):
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        yield url
