"""The processes of the control-plane benchmark and the plain HTTP it speaks to them.

A fleet here is H ``rollout_testbed.sim.fleet_host`` processes (N/H simulated replicas
each, one port per replica) and one real ``python -m gateway serve`` over all N URLs, all
``rollout_testbed.procs.Proc``: own session, signals by PID (its process group), every
wait bounded. Why blocking urllib and not an async client: the harness makes one control
call at a time (plus one in a thread while a host vanishes), so an event loop would buy
nothing and a client library would only add CPU next to the gateway being measured.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollout_testbed.procs import LOCAL, Proc, free_port, free_ports, stop_all
from rollout_testbed.sim.fleet_host import format_ports

PY = sys.executable
T = TypeVar("T")

# Our own processes only: never through an http(s)_proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: Any = None, *, timeout: float = 120.0) -> tuple[int, bytes]:
    """(status, body) of one request; status 0 when nothing answered (refused, timed out)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), exc.read()
    except (OSError, ValueError):
        return 0, b""


def get_json(url: str, *, timeout: float = 30.0) -> Any:
    status, body = http("GET", url, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


def poll(check: Callable[[], T | None], what: str, *, timeout: float, interval: float = 0.2) -> T:
    """``check()`` until it returns something other than None or False; bounded by
    ``timeout`` (a TimeoutError naming ``what`` then). Checks once more after the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        expired = time.monotonic() >= deadline
        value = check()
        if value is not None and value is not False:
            return value
        if expired:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Host:
    """One sim host process: ``ports`` are its replicas, ``/fleet/...`` its own control."""

    proc: Proc
    ports: list[int]

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOCAL}:{p}" for p in self.ports]

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = get_json(self.proc.url + "/fleet/state", timeout=10)
        return state

    def hold(self, path: str, seconds: float) -> None:
        status, body = http("POST", self.proc.url + "/fleet/hold",
                            {"path": path, "seconds": seconds}, timeout=10)  # fmt: skip
        if status != 200:
            raise RuntimeError(f"hold {path}: {status} {body[:200]!r}")

    def received(self, path: str) -> int:
        return int(self.state()["received"].get(path, 0))

    def wait_ready(self, timeout: float) -> None:
        """Until its first and last ports answer ``/health`` (it binds all, then serves)."""
        self.proc.wait_http("/health", timeout=timeout, interval=0.05)
        last = self.urls[-1] + "/health"
        poll(lambda: http("GET", last, timeout=2)[0] == 200, last, timeout=timeout)


@dataclass
class Fleet:
    hosts: list[Host]
    gateway: Proc
    workers: int
    broadcast_timeout_s: float

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def n(self) -> int:
        return sum(len(h.ports) for h in self.hosts)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = get_json(self.url + "/gateway/status", timeout=30)
        return status

    def call(self, path: str, body: Any = None) -> tuple[int, bytes, float]:
        """POST a control call through the gateway: (status, body, seconds)."""
        t0 = time.perf_counter()
        status, data = http("POST", self.url + path, body, timeout=self.broadcast_timeout_s + 60)
        return status, data, time.perf_counter() - t0

    def replica_states(self) -> dict[int, dict[str, Any]]:
        """Every replica's own view (adapters held, paused), by port, from the hosts alive."""
        out: dict[int, dict[str, Any]] = {}
        for host in self.hosts:
            if host.proc.alive and not host.proc.frozen:
                out |= {int(p): s for p, s in host.state()["replicas"].items()}
        return out


def host_argv(ports: Sequence[int], max_loras: int, extra: Sequence[str] = ()) -> list[str]:
    return [PY, "-m", "rollout_testbed.sim.fleet_host", "--ports", format_ports(ports),
            "--max-loras", str(max_loras), *extra]  # fmt: skip


def gateway_argv(
    port: int, replicas: Sequence[str], *, workers: int, flags: Sequence[str]
) -> list[str]:
    argv = [PY, "-m", "gateway", "serve", "--host", LOCAL, "--port", str(port),
            "--log-level", "WARNING", "--workers", str(workers), *flags]  # fmt: skip
    for url in replicas:
        argv += ["--replica", url]
    return argv


@contextlib.contextmanager
def fleet(
    n: int,
    hosts: int,
    workers: int,
    log_dir: Path,
    *,
    max_staleness: int,
    broadcast_timeout_s: float,
    gateway_flags: Sequence[str] = (),
    host_flags: Sequence[str] = (),
    timeout: float = 180.0,
) -> Iterator[Fleet]:
    """``hosts`` sim hosts of ``n // hosts`` replicas, ready, then the gateway over all of
    them, healthy (every replica up); everything stopped on exit, the gateway first."""
    if n % hosts:
        raise ValueError("n must be a multiple of hosts")
    ports = free_ports(n)
    per = n // hosts
    procs: list[Proc] = []
    try:
        fleet_hosts: list[Host] = []
        for i in range(hosts):
            chunk = sorted(ports[i * per : (i + 1) * per])
            proc = Proc(f"host-{i}", host_argv(chunk, max_staleness + 4, host_flags),
                        log_dir / f"host-{i}.log", url=f"http://{LOCAL}:{chunk[0]}")  # fmt: skip
            procs.append(proc.start())
            fleet_hosts.append(Host(proc, chunk))
        for host in fleet_hosts:
            host.wait_ready(timeout)
        port = free_port()
        flags = ["--max-staleness", str(max_staleness),
                 "--broadcast-timeout-s", f"{broadcast_timeout_s:g}", *gateway_flags]  # fmt: skip
        urls = [u for h in fleet_hosts for u in h.urls]
        gw = Proc("gateway", gateway_argv(port, urls, workers=workers, flags=flags),
                  log_dir / "gateway.log", url=f"http://{LOCAL}:{port}")  # fmt: skip
        procs.insert(0, gw.start())
        gw.wait_http("/health", timeout=timeout, interval=0.2, request_timeout=10)
        yield Fleet(fleet_hosts, gw, workers, broadcast_timeout_s)
    finally:
        stop_all(procs, grace=15, kill_wait=5)
