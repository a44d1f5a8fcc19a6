"""Local process helpers (standard library only): a gateway and sim replicas as
subprocesses on 127.0.0.1, for the tests, the benchmark runner and the demo.

Everything started here runs in its own process group and is stopped by PID (SIGTERM to
that group, then SIGKILL after a grace period): never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Proc", "free_port", "gateway_python", "launch", "sim_gateway", "wait_healthy"]

REPO = Path(__file__).resolve().parents[1]


def gateway_python() -> str:
    """The gateway venv's python (``$GATEWAY_PYTHON``, ``<repo>/.venv``), else this one."""
    env = os.environ.get("GATEWAY_PYTHON")
    cand = Path(env) if env else REPO / ".venv" / "bin" / "python"
    return str(cand) if cand.exists() else sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def launch(cmd: Sequence[str], url: str, log: Path, env: dict[str, str] | None = None) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ if env is None else env)
    extra = full_env.get("PYTHONPATH")
    full_env["PYTHONPATH"] = str(REPO) + (os.pathsep + extra if extra else "")
    full_env.pop("VIRTUAL_ENV", None)
    with open(log, "ab") as fh:
        popen = subprocess.Popen(
            list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=str(REPO), start_new_session=True,
        )  # fmt: skip
    return Proc(popen, url, log)


def wait_healthy(procs: Sequence[Proc], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                tail = p.log.read_text(errors="replace")[-2000:] if p.log.exists() else ""
                raise RuntimeError(f"{p.url} exited with {p.popen.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(p.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(p)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {[p.url for p in pending]}")
        if pending:
            time.sleep(0.2)


@dataclass
class SimStack:
    gateway: Proc
    replicas: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gateway.url


def start_gateway(replica_urls: Sequence[str], max_staleness: int, log_dir: Path,
                  extra: Sequence[str] = ()) -> Proc:  # fmt: skip
    port = free_port()
    cmd = [gateway_python(), "-m", "gateway", "serve", "--port", str(port),
           "--max-staleness", str(max_staleness), "--health-interval-s", "0.5", *extra]  # fmt: skip
    for u in replica_urls:
        cmd += ["--replica", u]
    return launch(cmd, f"http://127.0.0.1:{port}", log_dir / "gateway.log")


@contextlib.contextmanager
def sim_gateway(
    n: int, max_staleness: int, log_dir: Path, latency: str = "prefill=1e-5,decode=5e-4"
) -> Iterator[SimStack]:
    """``n`` sim replicas (``max_loras = max_staleness + 2``) behind one gateway."""
    procs: list[Proc] = []
    try:
        for i in range(n):
            port = free_port()
            cmd = [gateway_python(), "-m", "rollout_testbed", "sim-replica", "--port", str(port),
                   "--max-loras", str(max_staleness + 2), "--latency-model", latency]  # fmt: skip
            procs.append(launch(cmd, f"http://127.0.0.1:{port}", log_dir / f"sim-{i}.log"))
        wait_healthy(procs)
        gw = start_gateway([p.url for p in procs], max_staleness, log_dir)
        procs.append(gw)
        wait_healthy([gw])
        yield SimStack(gw, procs[:-1])
    finally:
        for p in reversed(procs):
            p.stop()
