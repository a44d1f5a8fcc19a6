"""Ports, processes and sim fleets for the tests, the benchmarks, the demo and the trainer.

Standard library only: the trainer imports this from the vLLM venv (``PYTHONPATH``
holds ``testbed/``), where nothing of the gateway venv is installed. The sidecar itself
never imports it (``tests/test_layout.py``).

* ``free_port()``, ``free_ports(n)``, ``free_port_on(*hosts)``: ports the kernel reports
  free now, on 127.0.0.1 or the given hosts (a race with other processes remains; the
  callers start their server right after).
* ``Proc``: one real subprocess that we own. Its output goes to a log file (or nowhere),
  ``wait_http`` waits for a readiness URL with a deadline and fails early, with the log's
  tail, if the process exits; ``stop`` sends SIGTERM, then SIGKILL after a grace period,
  every wait bounded. Signals go by PID: to the process's own group when it was started in
  a new session (the default), else to the PID alone. Nothing is ever stopped by name.
* ``sim_argv``, ``gateway_argv``, ``sim_fleet``: ``n`` ``rollout-testbed sim-replica``
  processes and one ``rollout-gateway serve`` in front of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "LOCAL",
    "Proc",
    "SimFleet",
    "env_workers",
    "free_port",
    "free_port_on",
    "free_ports",
    "gateway_argv",
    "http_status",
    "sim_argv",
    "sim_fleet",
    "stop_all",
    "wait_http",
    "worker_args",
]

LOCAL = "127.0.0.1"

# Readiness probes go straight to our own processes, never through an http(s)_proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --- ports ------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a client's source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class _Ports:
    """Ports for servers the tests start, chosen below the kernel's ephemeral range.

    Why not ``bind(0)``: the kernel picks that port from the ephemeral range, the same range
    it draws every client connection's source port from; between the probe's close and the
    server's bind, any connection on the machine (this test's own clients, the other pytest
    process of the fast layer) can take it. Ports below that range are never drawn for
    source ports. Each process walks its own sequence from a start set by its pid and never
    hands a port out twice, so two processes meet only after each has used thousands."""

    LOW = 10000

    def __init__(self) -> None:
        self.high = max(self.LOW + 1000, _ephemeral_low())
        span = self.high - self.LOW
        self.next = self.LOW + (os.getpid() * 7919) % span
        self.given: set[int] = set()

    def take(self, host: str) -> int:
        span = self.high - self.LOW
        for _ in range(span):
            port = self.next
            self.next = self.LOW + (self.next - self.LOW + 1) % span
            if port in self.given:
                continue
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
            except OSError:
                continue
            self.given.add(port)
            return port
        raise RuntimeError(f"no free port on {host} in {self.LOW}..{self.high}")


_PORTS = _Ports()


def free_port(host: str = LOCAL) -> int:
    """A TCP port free on ``host`` right now, below the ephemeral range (``_Ports``)."""
    return _PORTS.take(host)


def free_ports(n: int, host: str = LOCAL) -> list[int]:
    """``n`` distinct ports free on ``host`` right now."""
    return [_PORTS.take(host) for _ in range(n)]


def free_port_on(*hosts: str, attempts: int = 50) -> int:
    """One port number free on every one of ``hosts`` (e.g. 127.0.0.2 and 127.0.0.3)."""
    for _ in range(attempts):
        port = free_port(hosts[0])
        try:
            for h in hosts[1:]:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                    t.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no common free port on {hosts} after {attempts} attempts")


# --- readiness --------------------------------------------------------------------------


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of ``GET url`` (error statuses included), or None if nothing answered."""
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (OSError, ValueError):
        return None


def wait_http(
    url: str,
    *,
    timeout: float = 20.0,
    status: int = 200,
    interval: float = 0.1,
    request_timeout: float = 2.0,
    proc: Proc | None = None,
) -> float:
    """Poll ``GET url`` until it answers ``status``; returns the seconds it took.

    Raises ``TimeoutError`` after ``timeout`` seconds, and ``RuntimeError`` (with the log's
    tail) as soon as ``proc``, the process meant to serve ``url``, has exited."""
    start = time.monotonic()
    deadline = start + timeout
    last: int | None = None
    while True:
        if proc is not None and not proc.alive:
            raise RuntimeError(
                f"{proc.name} exited with {proc.returncode} before {url} answered "
                f"{status}:\n{proc.log_tail()}"
            )
        last = http_status(url, timeout=request_timeout)
        if last == status:
            return time.monotonic() - start
        if time.monotonic() > deadline:
            where = f" ({proc.name}; log tail:\n{proc.log_tail()})" if proc else ""
            raise TimeoutError(
                f"{url} did not answer {status} within {timeout:g}s (last: {last}){where}"
            )
        time.sleep(interval)


# --- processes --------------------------------------------------------------------------


@dataclass
class Proc:
    """One subprocess we own, restartable on the same argv (hence the same port).

    ``log``: the file its stdout and stderr go to (None: discarded, or this process's own
    with ``inherit_output``), opened for append unless ``append`` is false. With
    ``log_per_start``, each start writes its own file, ``NAME.0.log``, ``NAME.1.log``, ...
    next to ``log`` (``log_files`` lists them).
    ``url``: its base URL, if it serves HTTP (``wait_http`` paths are relative to it).
    """

    name: str
    argv: list[str]
    log: Path | None = None
    env: Mapping[str, str] | None = None
    cwd: Path | str | None = None
    url: str = ""
    new_session: bool = True
    """Start it in its own session and signal its whole process group."""
    append: bool = True
    log_per_start: bool = False
    inherit_output: bool = False
    preexec_fn: Callable[[], None] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    log_files: list[Path] = field(default_factory=list, init=False, repr=False)
    frozen: bool = field(default=False, init=False)

    def _next_log(self) -> Path | None:
        if self.log is None:
            return None
        if not self.log_per_start:
            return self.log
        n = len(self.log_files)
        return self.log.with_name(f"{self.log.stem}.{n}{self.log.suffix}")

    def start(self) -> Proc:
        """Start it (again, if it has exited); returns self."""
        assert not self.alive, f"{self.name} is running"
        if self.popen is not None:
            self.popen.wait()
        log = self._next_log()
        out: int | IO[bytes] | None = None if self.inherit_output else subprocess.DEVNULL
        with contextlib.ExitStack() as stack:
            if log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
                out = stack.enter_context(log.open("ab" if self.append else "wb"))
                if log not in self.log_files:
                    self.log_files.append(log)
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out,
                stderr=None if out is None else subprocess.STDOUT,
                env=None if self.env is None else dict(self.env), cwd=self.cwd,
                start_new_session=self.new_session, preexec_fn=self.preexec_fn,
            )  # fmt: skip
        self.frozen = False
        return self

    @property
    def port(self) -> int:
        """The port of ``url``."""
        port = urllib.parse.urlsplit(self.url).port
        assert port is not None, f"{self.name} has no URL with a port"
        return port

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to this process (its own group, if started in a new session)."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL (a crash, not a shutdown), and reap it so its port is free again."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP: a hang. The kernel still completes TCP handshakes into the backlog."""
        self.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT after ``freeze``."""
        self.signal(signal.SIGCONT)
        self.frozen = False

    def stop(self, grace: float = 10.0, kill_wait: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit status (None if
        it was never started or outlived SIGKILL by ``kill_wait`` seconds)."""
        if self.popen is None:
            return None
        if self.frozen:
            self.thaw()
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill(kill_wait)
            return self.popen.poll()

    def restart(self) -> Proc:
        """Kill (if alive) and start again with the same argv: same port, fresh state."""
        self.kill()
        return self.start()

    def wait_http(
        self,
        path: str = "/health",
        *,
        timeout: float = 20.0,
        status: int = 200,
        interval: float = 0.1,
        request_timeout: float = 2.0,
    ) -> float:
        """``wait_http(self.url + path)``, failing early if this process exits."""
        return wait_http(
            self.url + path, timeout=timeout, status=status, interval=interval,
            request_timeout=request_timeout, proc=self,
        )  # fmt: skip

    async def await_http(
        self, path: str = "/health", *, timeout: float = 20.0, interval: float = 0.05
    ) -> float:
        """``wait_http`` from async code (in a thread: the event loop keeps running)."""
        return await asyncio.to_thread(
            self.wait_http, path, timeout=timeout, interval=interval, request_timeout=1.0
        )

    def output(self) -> str:
        """Everything it wrote, every start's log file in order."""
        return "".join(p.read_text("utf-8", "replace") for p in self.log_files if p.exists())

    def log_tail(self, chars: int = 2000) -> str:
        return self.output()[-chars:]

    def __enter__(self) -> Proc:
        if self.popen is None:
            self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def stop_all(procs: Sequence[Proc], grace: float = 10.0, kill_wait: float = 5.0) -> None:
    """SIGTERM every one of ``procs`` at once, then wait for each (``grace`` seconds from
    its turn) and SIGKILL those still alive."""
    for proc in procs:
        if proc.frozen:
            proc.thaw()
        proc.signal(signal.SIGTERM)
    for proc in procs:
        proc.stop(grace, kill_wait)


# --- a sim fleet ------------------------------------------------------------------------


def sim_argv(
    port: int,
    *,
    python: str = sys.executable,
    latency: str | None = None,
    max_loras: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m rollout_testbed sim-replica --port PORT ...``"""
    argv = [python, "-m", "rollout_testbed", "sim-replica", "--port", str(port)]
    if latency is not None:
        argv += ["--latency-model", latency]
    if max_loras is not None:
        argv += ["--max-loras", str(max_loras)]
    return argv + list(extra)


def env_workers() -> int:
    """``ROLLOUT_TESTBED_WORKERS``, else 1: the data-plane workers a test layer asks every
    ``serve`` it starts to run (CI runs the fault suite with 2)."""
    return int(os.environ.get("ROLLOUT_TESTBED_WORKERS", "").strip() or 1)


def worker_args() -> list[str]:
    """``--workers N`` when ``ROLLOUT_TESTBED_WORKERS`` asks for more than one."""
    workers = env_workers()
    return ["--workers", str(workers)] if workers > 1 else []


def gateway_argv(
    port: int, replicas: Sequence[str], *, python: str = sys.executable, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m gateway serve --port PORT [extra] --replica URL ...``; with
    ``ROLLOUT_TESTBED_WORKERS=N`` set, ``--workers N`` too (CI runs the fault suite so)."""
    argv = [python, "-m", "gateway", "serve", "--port", str(port), *worker_args(), *extra]
    for url in replicas:
        argv += ["--replica", url]
    return argv


@dataclass
class SimFleet:
    gateway: Proc
    sims: list[Proc]

    @property
    def url(self) -> str:
        return self.gateway.url


@contextlib.contextmanager
def sim_fleet(
    n: int,
    log_dir: Path,
    *,
    python: str = sys.executable,
    sim_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 60.0,
    interval: float = 0.2,
    grace: float = 10.0,
) -> Iterator[SimFleet]:
    """``n`` sim replicas (``sim-N.log``), each healthy before one gateway (``gateway.log``)
    starts in front of them; yields once the gateway's ``/health`` is 200 (``timeout``
    covers the sims together, then the gateway). All are stopped on exit, gateway first."""
    procs: list[Proc] = []
    try:
        for i, port in enumerate(free_ports(n)):
            url = f"http://{LOCAL}:{port}"
            sim = Proc(f"sim-{i}", sim_argv(port, python=python, extra=sim_args),
                       log_dir / f"sim-{i}.log", env=env, cwd=cwd, url=url)  # fmt: skip
            procs.append(sim.start())
        deadline = time.monotonic() + timeout
        for sim in procs:
            sim.wait_http(timeout=max(0.0, deadline - time.monotonic()), interval=interval)
        port = free_port()
        argv = gateway_argv(port, [p.url for p in procs], python=python, extra=gateway_args)
        gw = Proc("gateway", argv, log_dir / "gateway.log", env=env, cwd=cwd,
                  url=f"http://{LOCAL}:{port}")  # fmt: skip
        sims = list(procs)
        procs.append(gw.start())
        gw.wait_http(timeout=timeout, interval=interval)
        yield SimFleet(gw, sims)
    finally:
        for proc in reversed(procs):
            proc.stop(grace)
