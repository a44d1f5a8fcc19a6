"""The whole routing decision for one request, in one place: which replicas may serve it
(healthy, breaker closed, holding its adapter), how the router chooses among them, and the
failover loop that retries another replica (within the retry budget) when the chosen one
fails before any response byte."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.adapters.naming import retired_successor
from gateway.api.cache_salt import check_client_salt, salted
from gateway.api.requests import (
    check_generation,
    parse_json_object,
    request_id_for,
    session_key,
)
from gateway.errors import (
    GatewayError,
    TooManyRequests,
    UpstreamError,
    UpstreamUnavailable,
)
from gateway.fleet.admission import Refusal
from gateway.http.relay import BodyResponse, RelayResponse, broken_mid_stream
from gateway.http.server.inbound import Inbound
from gateway.http.upstream import (
    ReplicaConnectError,
    UpstreamResponse,
    map_errors,
    request_head_lines,
    request_headers,
    response_headers,
)
from gateway.metrics import RouteKind
from gateway.routing.policy import CandidateLoads, RouteRequest
from gateway.runs.scope import StreamUnscope, scoped_model, unknown_model, unscope_body
from gateway.runs.usage import usage_tokens

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.runs.tenancy import Tenant


_NONE: frozenset[int] = frozenset()


@dataclass(slots=True)
class Pick:
    """How one request chooses its replica, and what to tell others when it starts/ends.

    ``started(i)`` may refuse a replica (e.g. its adapter copy is being retired); the
    request then picks again among the others. ``body_for(i)`` is the body as replica
    ``i`` must see it (its adapter copy's ``cache_salt``), when that depends on ``i``."""

    choose: Callable[[Sequence[int]], int]
    started: Callable[[int], bool] | None = None
    finished: Callable[[int], None] | None = None
    body_for: Callable[[int], bytes] | None = None


async def dispatch(
    inbound: Inbound, gw: Gateway, kind: RouteKind, body: bytes, candidates: Sequence[int],
    pick: Pick, scope: Tenant | None = None,
) -> Response:  # fmt: skip
    """Send to one replica chosen among ``candidates``; if it fails before any response
    byte (refused, reset, or aborted because it was ejected), try another while the retry
    budget allows. Streams are relayed as they arrive; nothing is retried after that.
    ``scope``: a named run's rollout (multi-run mode): the answer in its own names, and
    its tokens counted (``gateway.runs.usage``)."""
    started = time.perf_counter()
    request_id = request_id_for(inbound.header(b"x-request-id"))
    lean = kind is RouteKind.ROUTED  # POST, JSON in and out: the h1client path
    target = head_lines = b""
    headers: list[tuple[str, str]] = []
    if lean:
        head_lines = request_head_lines(inbound.headers, request_id)
        target = inbound.target
    else:
        headers = request_headers(inbound.headers, request_id)
    task, guard = inbound.task, inbound.guard
    remaining = list(candidates)
    gw.retry_budget.record_request(gw.clock())
    retrying = False
    while True:
        if not remaining:
            raise UpstreamUnavailable("No healthy replica could take the request.")
        if retrying and not gw.retry_budget.try_retry(gw.clock()):
            gw.metrics.retry_budget_exhausted.inc()
            raise UpstreamUnavailable(
                "A replica failed before answering and the retry budget is spent.",
                headers={"Retry-After": "1"},
            )
        index = pick.choose(remaining)
        remaining.remove(index)
        if not gw.outliers.dispatched(index):
            continue
        if pick.started is not None and not pick.started(index):
            gw.outliers.abandoned(index)
            continue
        if retrying:
            gw.metrics.retries.inc()
        gw.pool.acquire(index)
        gw.metrics.record_routed(index)
        gw.tasks.enter(index, task)
        sent = body if pick.body_for is None else pick.body_for(index)
        upstream: UpstreamResponse
        try:
            with guard:
                if lean:
                    upstream, content = await gw.upstream.send_routed(
                        index, inbound.method, target, head_lines, sent
                    )
                else:
                    upstream, content = await _exchange(gw, index, inbound, headers, sent)
        except ReplicaConnectError as exc:
            _abandon(gw, pick, index, task)
            gw.on_connect_failure(index, exc.kind)
        except asyncio.CancelledError:
            ejected = gw.tasks.take(task)
            _abandon(gw, pick, index, task)
            if not ejected:
                raise
            gw.metrics.aborted.inc()
        except UpstreamError as exc:  # timeout, or broken mid-body: the replica's fault
            _abandon(gw, pick, index, task)
            gw.record_status(index, exc.status)
            raise
        except BaseException:
            _abandon(gw, pick, index, task)
            raise
        else:
            break
        retrying = True

    status = upstream.status
    gw.record_status(index, status)
    out_headers = response_headers(upstream.raw_headers, index, request_id)
    if content is None:

        def on_close(completed: bool) -> None:
            gw.tasks.leave(index, task)
            _release(gw, pick, index)
            if not completed:
                gw.metrics.client_disconnects.inc()
            gw.metrics.record_request(kind, status, time.perf_counter() - started)

        def was_ejected() -> GatewayError | None:
            if gw.tasks.take(task):
                gw.metrics.aborted.inc()
                return broken_mid_stream()
            return None if scope is None else scope.aborts.take(task)

        unscope = None if scope is None else StreamUnscope(scope.run, status, scope.usage)
        return RelayResponse(upstream, out_headers, guard, on_close, was_ejected, unscope)
    gw.tasks.leave(index, task)
    _release(gw, pick, index)
    gw.metrics.record_request(kind, status, time.perf_counter() - started)
    if scope is not None:  # a named run: its names, and what it used
        content = unscope_body(scope.run, status, content)
        if 200 <= status < 300:
            scope.usage.tokens(usage_tokens(content))
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


def _release(gw: Gateway, pick: Pick, index: int) -> None:
    gw.pool.release(index)
    if pick.finished is not None:
        pick.finished(index)


def _abandon(gw: Gateway, pick: Pick, index: int, task: asyncio.Task[Any]) -> None:
    """The attempt on ``index`` ended without a response."""
    gw.tasks.leave(index, task)
    gw.outliers.abandoned(index)
    _release(gw, pick, index)


def plan_rollout(
    gw: Gateway, inbound: Inbound, body: bytes, tenant: Tenant
) -> tuple[list[int], Pick, bytes]:
    """ROUTED (completions and chat completions): validate the body, and say which
    replicas may serve it and how to choose among them, and what to send them (in
    multi-run mode the ``model`` named as the run's adapter is on the replicas).
    Synchronous: no coroutine."""
    settings = gw.settings
    payload = parse_json_object(body, settings.max_json_depth)
    path = inbound.path
    check_generation(path, payload, settings)
    asked = payload.get("model")
    healthy = tenant.rollout_replicas(gw.routable_or_503())
    routes = tenant.routes
    model, allowed, body = scoped_model(tenant, payload, body)
    candidates = healthy if allowed is None else [i for i in healthy if i in allowed]
    if not candidates and isinstance(model, str) and allowed is not None:
        pattern = tenant.manager.policy.name_pattern
        successor = retired_successor(pattern, model, routes.live_names())
        if successor is not None:  # docs/adapters.md, "Retired versions"
            gw.metrics.retired_rollouts.inc()
            model = payload["model"] = successor
            body = orjson.dumps(payload)
            allowed = routes.candidates(model) or frozenset()
            candidates = [i for i in healthy if i in allowed]
    if not candidates:
        if isinstance(model, str) and routes.is_live(model):
            raise UpstreamUnavailable(f"No healthy replica holds `{asked}` right now.",
                                      headers={"Retry-After": "1"})  # fmt: skip
        if allowed is None:
            raise UpstreamUnavailable("No healthy replica is home to this run right now.",
                                      headers={"Retry-After": "1"})  # fmt: skip
        raise unknown_model(asked)
    route_request = RouteRequest(
        path=path,
        model=model,
        payload=payload,
        session_key=session_key(inbound, payload),
        lacking_adapter=_NONE if allowed is None else frozenset(healthy) - frozenset(candidates),
    )

    def choose(remaining: Sequence[int]) -> int:
        loads = CandidateLoads(gw.pool.loads(remaining))
        if gw.before_route is not None:
            gw.before_route()
        t0 = time.perf_counter()
        decision = gw.router.choose(route_request, loads)
        gw.metrics.record_decision(decision, time.perf_counter() - t0)
        gw.router.observe(decision)
        return decision.replica

    if allowed is None:
        return candidates, Pick(choose), body
    assert isinstance(model, str)
    check_client_salt(payload)
    pick = Pick(
        choose,
        started=lambda i: routes.request_started(model, i),
        finished=lambda i: routes.request_finished(model, i),
        body_for=lambda i: salted(body, payload, routes.salt(model, i)),
    )
    return candidates, pick, body


def admit(gw: Gateway, inbound: Inbound) -> bytes:
    """Count the request against the in-flight limits (429 when over); returns the client
    key to ``leave`` with, exactly once."""
    client = inbound.header(b"authorization") or inbound.peer
    refusal = gw.admission.enter(client)
    if refusal is not None:
        gw.metrics.rejected.labels(refusal.value).inc()
        who = "this client" if refusal is Refusal.CLIENT_IN_FLIGHT else "the gateway"
        raise TooManyRequests(f"Too many requests in flight for {who}; retry shortly.",
                              headers={"Retry-After": "1"})  # fmt: skip
    return client


class Releasing(Response):
    """Runs ``release`` once the wrapped response was sent (or failed to be)."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:
        self.inner = inner
        self.status_code = inner.status_code
        self.background = None
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self._release()
