"""Sending one request to one replica, and trying another when that one fails before
any response byte (refused, reset, or aborted because it was ejected), while the retry
budget allows. Which replicas may serve it and which one does is the routing decision's
(``gateway.fleet.selection``); what each attempt counts is the ledger's
(``gateway.fleet.ledger``). Streams are relayed as they arrive; nothing is retried
after that."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.requests import check_generation, parse_json_object, session_key
from gateway.api.requests import request_id as current_request_id
from gateway.http.relay import BodyResponse, RelayResponse
from gateway.http.server.inbound import Inbound
from gateway.http.upstream import (
    UpstreamResponse,
    map_errors,
    request_head_lines,
    request_headers,
    response_headers,
)
from gateway.metrics import RouteKind
from gateway.runs.scope import StreamUnscope, answer_body

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.ledger import Entry, Ledger
    from gateway.fleet.selection import Plan
    from gateway.runs.tenancy import Tenant


async def dispatch(inbound: Inbound, gw: Gateway, entry: Entry, plan: Plan) -> Response:
    """Send ``inbound`` (``entry`` in the ledger) to a replica ``plan`` chooses, and try
    another while the failure left nothing to undo. ``entry.counted``: a named run's
    rollout (multi-run mode): the answer in its own names, and its tokens counted
    (``gateway.runs.usage``)."""
    ledger = gw.ledger
    request_id = current_request_id()
    lean = entry.kind is RouteKind.ROUTED  # POST, JSON in and out: the h1client path
    head = request_head_lines(inbound.headers, request_id) if lean else b""
    headers = [] if lean else request_headers(inbound.headers, request_id)
    upstream: UpstreamResponse
    while True:
        index = ledger.attempt(entry, plan)
        body = plan.body if plan.routes is None else plan.body_for(index)  # no call: hot
        try:
            with inbound.guard:
                if lean:
                    upstream, content = await gw.upstream.send_routed(
                        index, inbound.method, inbound.target, head, body
                    )
                else:
                    upstream, content = await _exchange(gw, index, inbound, headers, body)
        except BaseException as exc:
            if not ledger.failed(entry, exc):
                raise
        else:
            break
    status = upstream.status
    ledger.answered(entry, status)
    out_headers = response_headers(upstream.raw_headers, index, request_id)
    run = entry.counted if entry.counted is not None else plan.scope
    if content is None:
        unscope = None if run is None else StreamUnscope(run.run, status, run.usage)
        return RelayResponse(upstream, out_headers, inbound.guard, entry.closed, entry.ejected,
                             unscope)  # fmt: skip
    ledger.finished(entry, completed=True)
    if run is not None:  # a named run: its names, and what it used
        content = answer_body(run.run, run.usage, status, content)
    return BodyResponse(status, out_headers, content)


async def _exchange(
    gw: Gateway, index: int, inbound: Inbound, headers: list[tuple[str, str]], body: bytes
) -> tuple[UpstreamResponse, bytes | None]:
    """Send over aiohttp (FORWARDED), and read the body too unless it is a stream (SSE, or
    no Content-Length): a sized body is answered with one write."""
    upstream = await gw.upstream.send(
        index, inbound.method, inbound.raw_path.decode("latin-1"),
        query=inbound.query.decode("latin-1"), headers=headers, body=body,
    )  # fmt: skip
    if upstream.content_length is None or upstream.content_type == "text/event-stream":
        return upstream, None
    try:
        with map_errors(index, sending=False):
            content = await upstream.read()
    except BaseException:
        upstream.close()  # mid-body failure or client gone: abort, never reuse
        raise
    upstream.release()
    return upstream, content


def plan_rollout(gw: Gateway, inbound: Inbound, body: bytes, tenant: Tenant) -> Plan:
    """ROUTED (completions and chat completions): validate the body, then the routing
    decision's candidates for it (``Selection.rollout``). Synchronous: no coroutine."""
    settings = gw.settings
    payload = parse_json_object(body, settings.max_json_depth)
    path = inbound.path
    check_generation(path, payload, settings)
    session = session_key(inbound, payload)
    return gw.selection.rollout(path, payload, body, session, tenant)


class Releasing(Response):
    """Closes ``entry`` in the ledger once the wrapped response was sent (or failed to
    be)."""

    def __init__(self, inner: Response, ledger: Ledger, entry: Entry) -> None:
        self.inner = inner
        self.status_code = inner.status_code
        self.background = None
        self._ledger = ledger
        self._entry = entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self._ledger.exit(self._entry)
