"""The outer ASGI app and the lean server's handler: every rollout takes this path."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.probes import PROBES, probe
from gateway.api.requests import assign_request_id, check_body_size, check_headers, read_body
from gateway.api.responses import error_response
from gateway.api.rollout import dispatch, plan_rollout
from gateway.errors import GatewayError, ShuttingDown
from gateway.http.relay import RelayResponse
from gateway.http.server.disconnect import ClientDisconnected
from gateway.http.server.exchange import AsgiExchange, Exchange
from gateway.http.server.h1server import ROUTED_PATHS
from gateway.http.server.inbound import Inbound
from gateway.http.server.serving import Stopping
from gateway.metrics import RouteKind

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.ledger import Entry


log = logging.getLogger("gateway.api")


class FastPath:
    """Outer ASGI app: header limits for every request, and ``POST`` to a ROUTED path
    skips Starlette's router and middleware; ``serve`` is the one path of every rollout,
    the ones ``gateway.http.server.h1server`` read (without ASGI at all) and the ones uvicorn
    read.

    Rollouts are the gateway's whole load; on 2 cores the proxy's CPU per request is its
    throughput, and the generic stack (route matching, two exception middlewares wrapping
    every ``send``, then the ASGI scope, ``Request`` and ``Response`` objects) cost a
    measurable share of it (docs/decisions.md, 'API: a fast path past Starlette').
    Everything else goes to the full Starlette app. Errors are mapped exactly as its
    handlers map them.
    """

    def __init__(self, app: Starlette, stopping: Stopping | None = None) -> None:
        self.app = app
        self.gateway: Gateway = app.state.gateway
        self.stopping = stopping if stopping is not None else Stopping()
        """Set by the server on SIGTERM (``serve(..., stopping=app.stopping)``): from
        then on new work is refused with 503 and ``/readyz`` is 503."""
        names = self.gateway.settings.request_id_headers
        self._id_headers = tuple(h.encode("latin-1") for h in names)

    @property
    def state(self) -> State:
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST" or scope["path"] not in ROUTED_PATHS:  # respond's own
            assign_request_id(dict(scope["headers"]).get, self._id_headers)
        if scope["path"] in PROBES:  # this process's own answer (``gateway.api.probes``)
            await probe(self.gateway, self.stopping, scope["method"], scope["path"])(
                scope, receive, send
            )
            return
        if scope["method"] == "POST" and scope["path"] in ROUTED_PATHS:
            await self.serve(AsgiExchange(scope, receive, send))
            return
        try:
            check_headers(scope["headers"], self.gateway.settings)
            self._admit(scope["path"])
        except GatewayError as exc:
            await self._refuse(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def serve(self, exchange: Exchange) -> None:
        """One rollout, whichever protocol read it (``gateway.http.server.exchange``): on
        ``gateway.http.server.h1server``'s connections a complete response goes out in one write
        (its headers are the gateway's own or ones its parser accepted), a stream chunk by
        chunk (``RelayResponse.stream_to``); otherwise, and while writing is paused, the
        ASGI way."""
        inbound = exchange.inbound()
        if inbound is None:
            return
        response, entry = await self.respond(inbound)
        try:
            if response is None:
                return
            if isinstance(response, RelayResponse):
                await response.stream_to(exchange)
            elif not exchange.respond(
                response.status_code, response.raw_headers, bytes(response.body)
            ):
                await response(_SCOPE, exchange.receive, exchange.send)
        finally:
            if entry is not None:
                self.gateway.ledger.exit(entry, None if response is None else response.status_code)

    async def respond(self, inbound: Inbound) -> tuple[Response | None, Entry | None]:
        """The response to a rollout (None: the client left), and its entry in the ledger
        to ``exit`` once it is sent (None: refused before it was admitted)."""
        gw = self.gateway
        started = time.perf_counter()
        assign_request_id(inbound.header, self._id_headers)
        try:
            check_headers(inbound.headers, gw.settings)
            self._admit(inbound.path)
            entry = gw.ledger.enter(inbound, RouteKind.ROUTED)
        except GatewayError as exc:
            return self._refuse(exc, started), None
        counted, tenant = entry.counted, entry.tenant
        assert tenant is not None
        try:
            limit = gw.settings.max_body_bytes
            body = inbound.body  # already read by ``gateway.http.server.h1server``
            if body is None:  # uvicorn's connection: read_body enforces the limit
                assert inbound.receive is not None
                body = await read_body(inbound.receive, inbound.header(b"content-length"), limit)
            else:
                check_body_size(len(body), limit)
            if counted is not None and counted.paused is not None:
                with inbound.guard:  # its scoped /pause: held until /resume (after the
                    await counted.held()  # body: the guard may read ``receive``)
            plan = plan_rollout(gw, inbound, body, tenant)
            if counted is not None:  # a named run: its slot, in fair order when saturated
                with inbound.guard:
                    prefer = partial(gw.selection.preferred, plan)  # read only if it waits
                    entry.slot = await counted.slot(plan.candidates, prefer)
            return await dispatch(inbound, gw, entry, plan), entry
        except ClientDisconnected:
            return None, entry
        except GatewayError as exc:
            if counted is not None:
                exc.message = counted.run.unscope_text(exc.message)
            return self._refuse(exc, started), entry
        except Exception:
            log.exception("unhandled error on POST %s", inbound.path)
            return self._refuse(GatewayError("Internal gateway error."), started), entry
        except BaseException as exc:
            why = None  # the run's /pause?mode=abort cancelled it: answered, not dropped
            if isinstance(exc, asyncio.CancelledError) and counted is not None:
                why = counted.aborts.take(inbound.task)
            if why is not None:
                return self._refuse(why, started), entry
            gw.ledger.exit(entry)
            raise

    def _admit(self, path: str) -> None:
        """While the process drains (``Stopping``), new work is refused: what is in flight
        finishes, and a client retries on a gateway that stays. Observers still answer
        (the probes, ``/health`` for TRL, ``/metrics`` and ``/gateway/status``)."""
        if self.stopping.stopping and path not in _OBSERVERS:
            raise ShuttingDown("The gateway is shutting down: requests in flight finish, "
                               "new ones are refused.", headers={"Retry-After": "2"})  # fmt: skip

    def _refuse(self, exc: GatewayError, started: float | None = None) -> Response:
        """The error answer; a rollout's (``started``: when it arrived) is counted in the
        request metrics like any other answer (``dispatch`` counts the ones a replica
        gave), so the 5xx-rate alert sees the gateway's own 502/503/504 too."""
        metrics = self.gateway.metrics
        if exc.limit is not None:
            metrics.rejected.labels(exc.limit).inc()
        if started is not None:
            metrics.record_request(RouteKind.ROUTED, exc.status, time.perf_counter() - started)
        return error_response(exc)


_OBSERVERS = frozenset({"/health", "/metrics", "/gateway/status"})
"""Paths that still answer while the process drains (``FastPath._admit``)."""

# What a whole response sent the ASGI way reads of its scope.
_SCOPE: Scope = {"type": "http"}
