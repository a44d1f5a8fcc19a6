"""The owner's side of the control plane: one ``Hub`` that every worker connects to.

The owner is the only process that applies control calls, probes replicas or runs the
adapter lifecycle. Whenever its state changes it sends every worker a new snapshot
(``gateway.workers.snapshot``) and waits for each worker's ack; ``SyncBeforeAnswer``
makes every answer the owner gives wait for that, so once a load's 200 is on the wire
every live worker routes by a snapshot that has the new version. A worker that does not
ack within ``ack_timeout_s`` is killed (the supervisor restarts it, and a new worker is
sent the current snapshot before it serves): "every live worker has it" stays true.

Workers report what only they see, a replica that refused a connection; the owner
ejects it and publishes, so it reaches every worker. (Outlier breakers need no message:
they are shared memory, ``gateway.fleet.shared``.) Before
the owner unloads a copy it retires, or ends a scoped ``/pause?mode=wait``, it asks the
workers how many requests they still have on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.workers.channel import read_message, write_message
from gateway.workers.merge import add_workers, merge_expositions
from gateway.workers.snapshot import ControlSnapshot, capture

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.shared import SharedState

__all__ = ["Hub", "SyncBeforeAnswer"]

log = logging.getLogger("gateway.workers")

_POLL_S = 0.02


@dataclass(eq=False)
class _Link:
    worker: int
    pid: int
    writer: asyncio.StreamWriter
    acked: int = -1
    runs: int = -1
    """The run set generation it was sent (-1: none yet; a joining worker is sent the
    owner's, whatever it started with)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    replies: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    async def wait_acked(self, epoch: int) -> None:
        while self.acked < epoch:
            self.changed.clear()
            await self.changed.wait()


class Hub:
    """The owner's ``Peers`` (``gateway.roles``): built before the owner's gateway, which
    it is handed to; it serves the workers once ``start`` hands it that gateway."""

    def __init__(
        self,
        path: str,
        *,
        shared: SharedState | None = None,
        workers: int = 1,
        ack_timeout_s: float = 5.0,
        join_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._gw: Gateway | None = None
        self._shared = shared
        self.workers = workers
        self.join_timeout_s = join_timeout_s
        self.path = path
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        self.links: dict[int, _Link] = {}
        self.published: ControlSnapshot | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._joined: set[int] = set()
        self._all_joined = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- lifecycle -------------------------------------------------------------------

    @property
    def gw(self) -> Gateway:
        assert self._gw is not None, "the hub serves once started"
        return self._gw

    async def start(self, gw: Gateway) -> None:
        """Serve the workers the control state of ``gw`` (the owner's own gateway)."""
        self._gw = gw
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links.values()):
            link.writer.close()
        for task in list(self._tasks):
            task.cancel()

    async def run(self, interval_s: float) -> None:
        """Every ``interval_s``: the routers' fleet-load table, and what changed in the
        background (health rounds, adapter ticks)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._shared is not None:
                self._shared.publish_fleet_loads()  # the routers' one table, this period
            try:
                await self.sync()
            except Exception:  # the loop must outlive any one bad round
                log.exception("publishing the control snapshot failed")

    # --- publishing ----------------------------------------------------------------

    async def sync(self) -> None:
        """Publish the control state if it changed; return once every live worker acked
        it (the one that did not in time is killed)."""
        async with self._lock:
            snapshot = self._take()
            await self._wait_acked(list(self.links.values()), snapshot.epoch)

    def _take(self) -> ControlSnapshot:
        """The current state, published to every link if it changed (lock held)."""
        epoch = self.published.epoch if self.published is not None else 0
        snapshot = capture(self.gw, epoch + 1)
        if snapshot.same_state(self.published):
            assert self.published is not None
            return self.published
        self.published = snapshot
        message = {"op": "snapshot", "snapshot": snapshot.to_wire()}
        for link in self.links.values():
            self._send(link, snapshot, message)
        return snapshot

    def _send(self, link: _Link, snapshot: ControlSnapshot, message: dict[str, Any]) -> None:
        """The snapshot, after the run set if the worker was not sent this one (the same
        stream: it adopts the runs before it routes by the snapshot that names them)."""
        if link.runs != snapshot.runs_generation:
            runs = [run.to_wire() for run in self.gw.tenancy.table.runs]
            write_message(link.writer, {"op": "runs", "runs": runs})
            link.runs = snapshot.runs_generation
        write_message(link.writer, message)

    async def _wait_acked(self, links: list[_Link], epoch: int) -> None:
        lagging = [link for link in links if link.acked < epoch]
        if not lagging:
            return
        waits = {asyncio.ensure_future(link.wait_acked(epoch)): link for link in lagging}
        _, pending = await asyncio.wait(waits, timeout=self.ack_timeout_s)
        for task in pending:
            task.cancel()
            link = waits[task]
            log.error("worker %d (pid %d) did not take control snapshot %d within %.1f s; "
                      "killing it", link.worker, link.pid, epoch, self.ack_timeout_s)  # fmt: skip
            self._drop(link)
            with contextlib.suppress(ProcessLookupError):
                os.kill(link.pid, signal.SIGKILL)

    def _drop(self, link: _Link) -> None:
        if self.links.get(link.worker) is link:
            del self.links[link.worker]
        link.writer.close()
        for future in link.replies.values():
            if not future.done():
                future.set_result(None)

    # --- questions to the workers ---------------------------------------------------------

    async def merged_metrics(self, own: bytes) -> bytes:
        """The whole gateway's ``/metrics``: the owner's and every worker's, merged."""
        return merge_expositions(own.decode(), await self.ask("metrics"))

    async def add_status(self, own: dict[str, Any]) -> None:
        """Each worker's part of ``/gateway/status``, added to the owner's."""
        add_workers(own, await self.ask("status"))

    async def ask(self, op: str, **args: Any) -> list[Any]:
        """Every live worker's answer to ``op`` (a worker that does not answer in time is
        left out)."""
        futures = []
        for link in list(self.links.values()):
            ident = next(self._ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            link.replies[ident] = future
            futures.append(future)
            write_message(link.writer, {"op": op, "id": ident, **args})
        if not futures:
            return []
        done, _ = await asyncio.wait(futures, timeout=self.ack_timeout_s)
        return [f.result() for f in done if f.result() is not None]

    async def drained(self, name: str, replica: int, timeout: float) -> None:
        """Before unloading ``name`` from ``replica``: publish (no worker starts a request
        on it after), then wait until no worker has one running, up to ``timeout``. Not
        started yet (the owner's start-up): no worker has joined, nothing to wait for."""
        if self._gw is None:
            return
        await self.sync()
        deadline = self.clock() + timeout
        while sum(await self.ask("adapter_in_flight", name=name, replica=replica)):
            if self.clock() >= deadline:
                log.warning("unloading %s from replica %d with requests still in flight in "
                            "workers (%.1f s grace over)", name, replica, timeout)  # fmt: skip
                return
            await asyncio.sleep(_POLL_S)

    async def run_drained(self, run: str, timeout: float) -> None:
        """A scoped ``/pause?mode=wait|abort``: publish the pause (workers hold new
        rollouts; with ``abort`` they cancel theirs), then wait until none is running."""
        if self._gw is None:
            return
        await self.sync()
        deadline = self.clock() + timeout
        while sum(await self.ask("run_in_flight", run=run)):
            if self.clock() >= deadline:
                log.warning("run %s: rollouts still in flight in workers %.0f s after /pause",
                            run, timeout)  # fmt: skip
                return
            await asyncio.sleep(_POLL_S)

    # --- one worker's connection -------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link: _Link | None = None
        try:
            hello = await asyncio.wait_for(read_message(reader), self.ack_timeout_s)
            link = _Link(int(hello["worker"]), int(hello["pid"]), writer)
            # At start, no worker listens before all have joined: keep-alive clients that
            # connect at once would otherwise all land on the first one, for good.
            self._joined.add(link.worker)
            if len(self._joined) >= self.workers:
                self._all_joined.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_joined.wait(), self.join_timeout_s)
            async with self._lock:  # no publish can slip between its snapshot and joining
                old = self.links.get(link.worker)
                if old is not None:
                    self._drop(old)
                snapshot = self._take()
                self.links[link.worker] = link
                self._send(link, snapshot, {"op": "snapshot", "snapshot": snapshot.to_wire()})
            log.info("worker %d (pid %d) joined at control snapshot %d",
                     link.worker, link.pid, snapshot.epoch)  # fmt: skip
            while True:
                self._handle(link, await read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError, KeyError):
            pass
        finally:
            if link is not None and self.links.get(link.worker) is link:
                log.warning("worker %d (pid %d) left", link.worker, link.pid)
                self._drop(link)
            writer.close()

    def _handle(self, link: _Link, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "ack":
            link.acked = max(link.acked, int(message["epoch"]))
            link.changed.set()
        elif op == "reply":
            future = link.replies.pop(int(message["id"]), None)
            if future is not None and not future.done():
                future.set_result(message.get("value"))
        elif op == "connect_failure":
            # The worker counted the upstream error in its own series (summed into /metrics):
            # here it only ejects.
            self.gw.rotation.unreachable(int(message["replica"]), str(message["kind"]))
            self._spawn(self.sync())
        else:
            raise ValueError(f"unknown op {op!r}")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class SyncBeforeAnswer:
    """ASGI middleware for the owner: no answer starts before every worker has the
    control state the request left behind."""

    def __init__(self, app: ASGIApp, hub: Hub) -> None:
        self.app = app
        self.hub = hub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def synced(message: Message) -> None:
            if message["type"] == "http.response.start":
                await self.hub.sync()
            await send(message)

        await self.app(scope, receive, synced)
