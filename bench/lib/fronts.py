"""The processes a benchmark starts: the fronts it measures (the gateway, vllm-router, a
script's own proxies) and the instant fake upstreams behind them, each pinned to its role.

Why pinned: on a 2-core machine a front that shares its core with the load client
measures the client as much as itself. ``Fleet`` gives each role a CPU set
(``split_cores``: the front alone on CPU 1; client and upstreams on CPU 0) and starts every
process through ``rollout_testbed.procs.Proc`` (log file per process, signals by PID only),
so the same placement holds for every front, ``direct`` included, and only the front
differs. The sim replica fleet, for latency-realistic runs, is
``rollout_testbed.procs.sim_fleet``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from rollout_testbed.procs import LOCAL, Proc, free_port, stop_all

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(sys.executable).parent
CLIENT_CPU = 0
FRONT_CPU = 1


def pin(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to ``cpus`` (None: no pinning, or no support)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None

    def pin_cpus() -> None:
        os.sched_setaffinity(0, cpus)

    return pin_cpus


def split_cores(placement: str = "split") -> dict[str, set[int]]:
    """``split``: the front on CPU 1, everything else (client, upstreams) on CPU 0; ``none``
    (or a 1-CPU machine): no pinning."""
    if placement == "none" or (os.cpu_count() or 1) < 2:
        return {}
    return {"front": {FRONT_CPU}, "client": {CLIENT_CPU}}


@dataclass
class Front:
    """A process that serves HTTP: what the load client is pointed at."""

    name: str
    url: str
    proc: Proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 30.0) -> None:
        """Until ``/health`` answers 200; fails early, with its log, if it exits."""
        self.proc.wait_http("/health", timeout=timeout)


@dataclass
class Fleet:
    """Processes started in ``log_dir`` (``NAME.log`` each), pinned by role (``cores``; a
    role not in it runs unpinned), stopped together by ``stop_all`` or on ``with`` exit."""

    log_dir: Path
    cores: dict[str, set[int]] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def cpus(self, role: str) -> set[int] | None:
        return self.cores.get(role) if hasattr(os, "sched_setaffinity") else None

    def start(
        self,
        name: str,
        argv: list[str],
        role: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        url: str = "",
    ) -> Proc:
        """Start ``argv`` pinned to ``role``'s CPUs; SIGTERM goes to this PID only."""
        proc = Proc(
            name,
            argv,
            self.log_dir / f"{name}.log",
            env=env,
            cwd=cwd,
            url=url,
            new_session=False,
            append=False,
            preexec_fn=pin(self.cpus(role)),
        )
        self.procs.append(proc.start())
        return proc

    def serve(
        self,
        name: str,
        argv: Sequence[str],
        role: str = "front",
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> Front:
        """Start ``argv --port P`` on a free port ``P``; wait for it with ``Front.wait``."""
        port = free_port()
        url = f"http://{LOCAL}:{port}"
        proc = self.start(name, [*argv, "--port", str(port)], role, env=env, cwd=cwd, url=url)
        return Front(name, url, proc)

    def upstreams(
        self, n: int, *, roles: Sequence[str] = (), flags: Sequence[str] = ()
    ) -> list[Front]:
        """``n`` instant fake upstreams (``bench.lib.upstream``), ready: each on the CPUs of
        its role in ``roles``, or on the client CPUs. ``flags``: the fake's own, e.g.
        ``--service-ms 4 --concurrency 56`` for one that saturates at 14k req/s."""
        argv = [PY, "-m", "bench.lib.upstream", *flags]
        ups = [
            self.serve(f"upstream{i + 1}", argv, roles[i] if roles else "client") for i in range(n)
        ]
        for up in ups:
            up.wait()
        return ups

    def gateway(
        self,
        replicas: Sequence[str],
        *,
        name: str = "gateway",
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> Front:
        """``python -m gateway serve`` over ``replicas`` at ``--log-level WARNING`` (from
        ``cwd``'s tree with ``env``'s PYTHONPATH, for another tree's code)."""
        argv = [PY, "-m", "gateway", "serve", "--host", LOCAL, "--log-level", "WARNING", *flags]
        for url in replicas:
            argv += ["--replica", url]
        return self.serve(name, argv, env=env, cwd=cwd)

    def vllm_router(
        self, replicas: Sequence[str], policy: str = "round_robin", *, name: str = "vllm-router"
    ) -> Front | None:
        """vllm-router (Rust, ``policy``) over ``replicas``, or None if not installed."""
        router = BIN / "vllm-router"
        if not router.exists():
            router = Path(shutil.which("vllm-router") or "/nonexistent")
        if not router.exists():
            return None
        argv = [
            str(router),
            "--host",
            LOCAL,
            "--worker-urls",
            *replicas,
            "--policy",
            policy,
            "--prometheus-host",
            LOCAL,
            "--prometheus-port",
            str(free_port()),
        ]
        return self.serve(name, argv)

    def stop_all(self) -> None:
        stop_all(list(reversed(self.procs)), grace=10, kill_wait=5)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
