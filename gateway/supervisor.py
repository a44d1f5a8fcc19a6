"""``serve --workers N``: a supervisor, one owner of the control plane, N workers.

Why processes: one asyncio process is one core. Rollouts need no shared state but the
control snapshot (the ring is a pure function of the replica list, so every worker sends
a prefix where every other would), so N workers on one port scale the data path, and one
owner keeps every control decision in one place.

* The **supervisor** (this process) reserves the port, forks the owner, waits until its
  hub listens, forks the workers, and restarts whichever dies: a worker at once (the
  others keep their connections), the owner too (it rebuilds from the replicas, as a
  restarted gateway does, and the workers rejoin it; meanwhile they route by their last
  snapshot and answer control calls 503). SIGTERM drains the workers, then stops the
  owner. Children die with the supervisor (``PR_SET_PDEATHSIG``).
* The **owner** is the one-process gateway on a private Unix socket, plus the ``Hub``.
* Each **worker** binds the port with ``SO_REUSEPORT`` (the kernel spreads connections
  over the workers) and serves rollouts itself; everything else goes to the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from multiprocessing.process import BaseProcess
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware

from gateway.api import FastPath
from gateway.app import build_gateway, create_app
from gateway.config import Settings, current_runs
from gateway.fleet.shared import SharedState
from gateway.http.server.serving import Stopping, listen_socket, serve
from gateway.http.server.signals import announce_signals, on_hangup
from gateway.runs.mode import WorkerRuns
from gateway.workers.owner import Hub, SyncBeforeAnswer
from gateway.workers.snapshot import SnapshotFeed
from gateway.workers.worker import (
    FleetLoadsFeed,
    Follower,
    OwnerLink,
    OwnerProxy,
    OwnerSession,
    share_loads,
)

__all__ = ["supervise"]

log = logging.getLogger("gateway.workers")

_CONTROL, _OWNER = "control.sock", "owner.sock"
_PUBLISH_S = 0.05
"""How often the owner publishes background changes (health, ticks, expiries)."""
_RESTARTS, _RESTART_WINDOW_S = 5, 30.0
"""A worker that dies this often within the window: give up (the whole gateway exits)."""


def supervise(settings: Settings, workers: int, reserve: socket.socket) -> int:
    """Run the gateway as an owner and ``workers`` workers until SIGTERM; the exit code.
    ``reserve``: the port, bound with ``SO_REUSEPORT`` by the caller (which says in one
    line why it could not be) and never listening: it holds the port for the workers'
    binds (of this user only) and gets no connections."""
    rundir = Path(tempfile.mkdtemp(prefix="rollout-gateway-"))  # 0700: only this user
    port = reserve.getsockname()[1]
    stopping: list[int] = []
    fork = multiprocessing.get_context("fork")
    shared = SharedState(len(settings.replicas), workers=workers)

    def start(target: Callable[..., None], *args: object) -> BaseProcess:
        proc = fork.Process(target=_child, args=(os.getpid(), target, *args), daemon=False)
        proc.start()
        return proc

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    owners: list[BaseProcess] = []  # the owner now (it is restarted if it dies)
    supervisor = os.getpid()

    def hangup(signum: int, _frame: object) -> None:
        # SIGHUP reloads what can be: the owner's work (it tells the workers, and logs
        # what it did); the default action would end the whole gateway.
        if os.getpid() != supervisor:  # a child just forked, before _child took over
            return
        pid = owners[-1].pid if owners and owners[-1].is_alive() else None
        if pid is None:
            log.warning("SIGHUP ignored: no owner process right now (starting or "
                        "restarting); nothing to reload", extra={"event": "sighup"})  # fmt: skip
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
        log.info("SIGHUP: passed to the owner (pid %d), which reloads", pid,
                 extra={"event": "sighup"})  # fmt: skip

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, hangup)
    try:
        owner = start(_owner_main, settings, shared, workers, rundir)
        owners.append(owner)
        if not _wait_for(rundir / _CONTROL, owner, stopping, timeout=600.0):
            log.error("the owner process did not start (exit code %s)", owner.exitcode)
            _stop([owner], 5.0)
            return 3
        procs = {
            k: start(_worker_main, settings, shared, k, workers, rundir, port)
            for k in range(workers)
        }
        log.info("%d workers on http://%s:%d (pids %s), owner pid %d", workers, settings.host,
                 port, [p.pid for p in procs.values()], owner.pid)  # fmt: skip
        deaths: list[float] = []
        while not stopping:
            time.sleep(0.1)
            if not owner.is_alive():
                log.error("the owner (pid %s) exited with %s; restarting it; workers keep "
                          "serving by their last control snapshot", owner.pid,
                          owner.exitcode)  # fmt: skip
                (rundir / _CONTROL).unlink(missing_ok=True)
                owner = start(_owner_main, settings, shared, workers, rundir)
                owners[:] = [owner]
            for k, proc in procs.items():
                if proc.is_alive():
                    continue
                now = time.monotonic()
                deaths = [t for t in deaths if now - t < _RESTART_WINDOW_S] + [now]
                if len(deaths) > _RESTARTS:
                    log.error("workers died %d times in %.0f s; stopping the gateway",
                              len(deaths), _RESTART_WINDOW_S)  # fmt: skip
                    _stop([*procs.values(), owner], settings.shutdown_timeout_s)
                    return 1
                log.error("worker %d (pid %s) exited with %s; restarting it", k, proc.pid,
                          proc.exitcode)  # fmt: skip
                procs[k] = start(_worker_main, settings, shared, k, workers, rundir, port)
        # SIGTERM: the workers drain (each stops accepting, finishes what it has), then
        # the owner goes: control calls keep working while rollouts drain.
        _stop(list(procs.values()), settings.shutdown_timeout_s + 5.0)
        _stop([owner], 10.0)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reserve.close()
        shutil.rmtree(rundir, ignore_errors=True)


def _wait_for(path: Path, proc: BaseProcess, stopping: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping:
        if path.exists():
            return True
        if not proc.is_alive():
            return False
        time.sleep(0.05)
    return False


def _stop(procs: list[BaseProcess], timeout: float) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _child(parent: int, target: Callable[..., None], *args: object) -> None:
    """In a forked child: die with the supervisor, its own signal handlers, then
    ``target``."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn's, once the child serves
        signal.signal(sig, signal.SIG_DFL)
    announce_signals()  # not the supervisor's SIGHUP: that one signals the owner
    target(*args)


def _serve(app: object, sock: socket.socket, settings: Settings, lean: bool,
           stopping: Stopping) -> None:  # fmt: skip
    handler = app.serve if lean and isinstance(app, FastPath) else None
    if not serve(app, sock, lean=handler, shutdown_timeout_s=settings.shutdown_timeout_s,
                 stopping=stopping):  # fmt: skip
        os._exit(3)


def _owner_main(settings: Settings, shared: SharedState, workers: int, rundir: Path) -> None:
    settings = current_runs(settings)
    hub = Hub(str(rundir / _CONTROL), shared=shared, workers=workers)

    @contextlib.asynccontextmanager
    async def attach() -> AsyncIterator[None]:
        await hub.start(app.gateway)  # the supervisor starts the workers once it listens
        task = asyncio.create_task(hub.run(_PUBLISH_S), name="gateway-publish")
        try:
            yield
        finally:
            task.cancel()
            await hub.aclose()

    app = create_app(settings, attach, shared, peers=hub)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    (rundir / _OWNER).unlink(missing_ok=True)
    sock.bind(str(rundir / _OWNER))
    os.chmod(rundir / _OWNER, 0o600)
    sock.listen(1024)  # workers' requests queue while the owner starts up
    _serve(SyncBeforeAnswer(app, hub), sock, settings, lean=False, stopping=app.stopping)


def _not_here(worker: int) -> None:
    """SIGHUP reached a data-plane worker (alone, or with the whole process group, as when
    a terminal closes): the owner reloads, so the worker only says so."""
    log.warning("SIGHUP to data-plane worker %d (pid %d) ignored: send it to the "
                "supervisor (pid %d), which passes it to the owner, which reloads", worker,
                os.getpid(), os.getppid(), extra={"event": "sighup"})  # fmt: skip


def _worker_main(
    settings: Settings, shared: SharedState, worker: int, workers: int, rundir: Path,
    port: int,
) -> None:  # fmt: skip
    # Admission limits are per process: split the gateway's between the workers.
    limits = {
        name: math.ceil(value / workers)
        for name in ("max_in_flight", "max_in_flight_per_client")
        if (value := getattr(settings, name)) is not None
    }
    settings = settings.model_copy(update=limits)
    link, feed = OwnerLink(), SnapshotFeed()
    gw = build_gateway(settings, shared, reporter=link, feed=FleetLoadsFeed(shared), routes=feed)
    gw.router.set_workers(workers)  # decide a group's replica alike in every worker
    owner = OwnerSession(str(rundir / _OWNER))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runs = WorkerRuns(gw.tenancy, settings.broadcast_timeout_s)
        follower = Follower(gw, worker, str(rundir / _CONTROL), link, feed, runs)
        hangups = contextlib.ExitStack()  # a worker reloads nothing: the owner does
        hangups.enter_context(on_hangup(partial(_not_here, worker)))
        reader = await follower.connect(timeout=30.0)
        tasks = [
            asyncio.create_task(follower.run(reader), name="gateway-follow"),
            asyncio.create_task(
                share_loads(gw.pool, shared, worker, _PUBLISH_S), name="gateway-loads"
            ),
        ]
        try:
            yield
        finally:
            hangups.close()
            for task in tasks:
                task.cancel()
            await runs.aclose()
            await owner.aclose()
            await gw.upstream.aclose()

    inner = Starlette(
        lifespan=lifespan,
        middleware=[Middleware(OwnerProxy, owner=owner, max_body_bytes=settings.max_body_bytes)],
    )
    inner.state.gateway = gw
    sock = listen_socket(settings.host, port, reuse_port=True)
    fast = FastPath(inner)
    _serve(fast, sock, settings, lean=True, stopping=fast.stopping)
