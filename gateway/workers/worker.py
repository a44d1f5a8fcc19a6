"""A data-plane worker: routes rollouts by the owner's snapshots, sends it the rest.

The worker's ``Gateway`` has the same pool, router, upstream and metrics as a
one-process gateway, and serves ``POST /v1/completions`` and chat completions on the
same code path. It runs no health loop, no adapter lifecycle and no control call: its
replica health, outlier ejections, run homes, pauses and adapter candidates are the last
``ControlSnapshot`` the owner sent (``Follower.apply``). Every other request goes to
the owner as it came (``OwnerProxy``), over the owner's Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import aiohttp
from starlette.types import ASGIApp, Receive, Scope, Send
from yarl import URL

from gateway.api.requests import read_body
from gateway.api.responses import error_response
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.fleet.shared import FLEET_LOADS_S, SharedState
from gateway.http.upstream import HOP_BY_HOP
from gateway.runs.mode import WorkerRuns
from gateway.runs.table import Run, RunTable
from gateway.workers.channel import read_message, write_message
from gateway.workers.snapshot import ControlSnapshot, RunView, SnapshotFeed

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.replicas import ReplicaPool
    from gateway.routing.policy import Router

__all__ = [
    "FleetLoadsFeed",
    "Follower",
    "OwnerLink",
    "OwnerProxy",
    "OwnerSession",
    "share_loads",
]

log = logging.getLogger("gateway.workers")

_RECONNECT_S = 0.25
_OWN = HOP_BY_HOP | {b"date", b"server"}  # the worker's server adds its own


class OwnerLink:
    """A worker's ``Reporter`` (``gateway.roles``): what only this worker saw goes to the
    owner over the channel the ``Follower`` holds, while it holds one (a report made
    while the owner restarts is dropped: the owner probes every replica anew)."""

    __slots__ = ("_writer",)

    def __init__(self) -> None:
        self._writer: asyncio.StreamWriter | None = None

    def connected(self, writer: asyncio.StreamWriter | None) -> None:
        self._writer = writer

    def report(self, message: dict[str, Any]) -> None:
        if self._writer is not None:
            write_message(self._writer, message)


class Follower:
    """The worker's end of the owner's channel: adopts the owner's run set when it
    changes (``runs``), applies snapshots, acks them, answers the owner's questions. The
    worker's gateway was built with ``link`` as its reporter and ``feed`` as its runs'
    routes."""

    def __init__(
        self, gw: Gateway, worker: int, path: str, link: OwnerLink, feed: SnapshotFeed,
        runs: WorkerRuns,
    ) -> None:  # fmt: skip
        self.gw = gw
        self.worker = worker
        self.path = path
        self.link = link
        self.feed = feed
        self.runs = runs
        self.snapshot: ControlSnapshot | None = None

    async def connect(self, timeout: float) -> asyncio.StreamReader:
        """Join the owner and apply its current snapshot (the worker serves nothing
        before it has one)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), timeout)
        write_message(writer, {"op": "hello", "worker": self.worker, "pid": os.getpid()})
        self.link.connected(writer)
        while True:  # the owner's run set, then its snapshot
            message = await asyncio.wait_for(read_message(reader), timeout)
            self._handle(message)
            if message["op"] == "snapshot":
                return reader

    async def run(self, reader: asyncio.StreamReader) -> None:
        """Follow the owner for the worker's life; while it is gone (restarting), keep
        serving by the last snapshot and rejoin as soon as it is back."""
        while True:
            try:
                while True:
                    self._handle(await read_message(reader))
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                log.warning("worker %d: lost the owner; serving by control snapshot %s "
                            "until it is back", self.worker,
                            self.snapshot.epoch if self.snapshot else None)  # fmt: skip
            self.link.connected(None)
            while True:
                await asyncio.sleep(_RECONNECT_S)
                with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError,
                                         ValueError):  # fmt: skip
                    reader = await self.connect(timeout=5.0)
                    break

    def _handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "snapshot":
            snapshot = ControlSnapshot.from_wire(message["snapshot"])
            self.apply(snapshot)
            self.link.report({"op": "ack", "epoch": snapshot.epoch})
            return
        if op == "runs":
            self.runs.adopt(RunTable(Run.from_wire(r) for r in message["runs"]))
            return
        value: Any
        if op == "adapter_in_flight":
            value = self.feed.in_flight[(message["name"], int(message["replica"]))]
        elif op == "run_in_flight":
            tenant = self.gw.tenancy.find(message["run"])
            value = 0 if tenant is None else tenant.in_flight
        elif op == "metrics":
            value = self.gw.metrics.render().decode()
        elif op == "status":
            value = self.status()
        else:
            raise ValueError(f"unknown op {op!r}")
        self.link.report({"op": "reply", "id": message["id"], "value": value})

    def apply(self, snapshot: ControlSnapshot) -> None:
        """Adopt ``snapshot`` in one synchronous step (no rollout sees half of it)."""
        gw, old = self.gw, self.snapshot
        for index in gw.pool.follow(snapshot.healthy):
            gw.rotation.out_of_rotation(index)  # abort what waits on it, as the owner did
        if old is not None:
            for index, count in snapshot.cache_resets.items():
                if old.cache_resets.get(index) != count:
                    gw.router.forget_replica(index)
        self.feed.follow(snapshot)
        for tenant in gw.tenancy:
            view = snapshot.run(tenant.name) or RunView(tenant.name)
            tenant.follow(view.homes, view.unplaced, view.paused)
        self.snapshot = snapshot

    def status(self) -> dict[str, Any]:
        gw = self.gw
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "snapshot": self.snapshot.epoch if self.snapshot else None,
            "in_flight": gw.ledger.admission.in_flight,
            "routed": sum(r.served for r in gw.pool.replicas),
            "replicas": {str(r.index): [r.in_flight, r.served] for r in gw.pool.replicas},
            "routing": gw.metrics.routing_counts(),
        }


async def share_loads(
    pool: ReplicaPool, shared: SharedState, worker: int, interval_s: float
) -> None:
    """Every ``fleet.shared.FLEET_LOADS_S`` (or ``interval_s``, if shorter): publish this
    worker's in-flight counts per replica and, if the fleet-load table is that old, sum
    every worker's into it (the table the routers read, ``FleetLoadsFeed``). The owner's
    own 50 ms sum alone let the table age 100 ms, and saturated replicas herded
    (``gateway.fleet.shared``)."""
    replicas = range(shared.replicas)
    period = min(interval_s, FLEET_LOADS_S)
    while True:
        shared.publish_loads(worker, [pool[i].in_flight for i in replicas])
        shared.publish_fleet_loads_due(period)
        await asyncio.sleep(period)


class FleetLoadsFeed:
    """A worker's ``LoadsFeed`` (``gateway.roles``): before each routing decision, hand
    the router the owner's newest fleet-load table, the moment it is published. Every
    worker switches tables at the same instant, so a GRPO group's samples, spread over
    workers, are placed by the same table."""

    __slots__ = ("_seen", "_shared")

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        self._seen = -1.0

    def refresh(self, router: Router) -> None:
        seen, table = self._shared.fleet_loads(self._seen)
        if table is not None:
            self._seen = seen
            router.set_fleet_loads(table)


class OwnerSession:
    """The worker's HTTP client to the owner's Unix socket (made on first use, on the
    worker's event loop)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.path),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class OwnerProxy:
    """ASGI middleware of a worker's app: every HTTP request that reaches it (all but
    rollouts) goes to the owner as it came, and its answer back as it comes."""

    def __init__(self, app: ASGIApp, owner: OwnerSession, max_body_bytes: int) -> None:
        self.app = app
        self.owner = owner
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP]
        length = next((v for k, v in headers if k == b"content-length"), None)
        try:
            body = await read_body(receive, length, self.max_body_bytes)
        except GatewayError as exc:
            await error_response(exc)(scope, receive, send)
            return
        target = scope["raw_path"] + (b"?" + qs if (qs := scope["query_string"]) else b"")
        try:
            response = await self.owner.session().request(
                scope["method"],
                URL("http://owner" + target.decode("latin-1"), encoded=True),
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                data=body or None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        except (aiohttp.ClientError, OSError):
            await error_response(UpstreamUnavailable(
                "The gateway's control plane is restarting; retry shortly.",
                headers={"Retry-After": "1"},
            ))(scope, receive, send)  # fmt: skip
            return
        try:
            await send({
                "type": "http.response.start",
                "status": response.status,
                "headers": [(k, v) for k, v in response.raw_headers
                            if k.lower() not in _OWN],
            })  # fmt: skip
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            response.close()
