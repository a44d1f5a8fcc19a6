"""The HTTP surface: which path is ROUTED, BROADCAST, FAN-IN, FORWARDED or the gateway's own.

=========================================  ==========  ==========================================
path                                       kind        behaviour
=========================================  ==========  ==========================================
/v1/completions, /v1/chat/completions      ROUTED      one replica chosen by the router; body
                                                       forwarded byte for byte; SSE relayed
/v1/load_lora_adapter, /v1/unload_...      BROADCAST   every healthy replica, all or nothing
/pause, /resume, /reset_prefix_cache       BROADCAST   every healthy replica
/health                                    FAN-IN      200 only when every replica is up
/server_info, /v1/models                   FAN-IN      merged: DP=1, weakest lora_config,
                                                       adapters present everywhere
anything else                              FORWARDED   one healthy replica (least loaded)
/metrics, /gateway/status                  GATEWAY     the gateway's own
=========================================  ==========  ==========================================

Handlers parse a body at most once, ask the router for a decision, let ``upstream`` do the
I/O and report back to the pool and metrics in ``finally``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import re
import time
from base64 import b64decode
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.admission import Refusal
from gateway.errors import (
    BadRequest,
    GatewayError,
    HeadersTooLarge,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unauthorized,
    UpstreamError,
    UpstreamUnavailable,
)
from gateway.h1server import LeanExchange
from gateway.inbound import Inbound
from gateway.logs import REQUEST_ID
from gateway.metrics import CONTENT_TYPE, RouteKind
from gateway.relay import BodyResponse, ClientDisconnected, DisconnectGuard, RelayResponse
from gateway.routing.policy import CandidateLoads, RouteRequest
from gateway.upstream import (
    BufferedResponse,
    ReplicaConnectError,
    UpstreamResponse,
    map_errors,
    request_head_lines,
    request_headers,
    response_headers,
)

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.config import Settings

__all__ = ["FastPath", "build_routes", "error_response"]

log = logging.getLogger("gateway.routes")

_ALL_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
_JSON = "application/json"
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()
_NONE: frozenset[int] = frozenset()

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
BROADCAST_PATHS = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/pause",
    "/resume",
    "/reset_prefix_cache",
)


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=_JSON, headers=headers)


def error_response(exc: GatewayError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type=_JSON, headers=exc.headers)


# --- auth ---------------------------------------------------------------------------------


def header(request: Request, name: bytes) -> bytes | None:
    """One request header by lower-case name (Starlette handlers; ``Inbound.header`` for
    the dispatch path). The raw list is turned into a dict once per request: Starlette's
    ``Headers.get`` scans the whole list on every call."""
    scope = request.scope
    table: dict[bytes, bytes] | None = scope.get("gateway.headers")
    if table is None:
        table = scope["gateway.headers"] = dict(scope["headers"])
    return table.get(name)


def _presented_key(value: bytes | None) -> bytes | None:
    """The key in an ``Authorization`` value: ``Bearer KEY``, or the password of ``Basic``
    auth, which is all TRL can send (``http://user:KEY@gateway`` in its server URL)."""
    if not value:
        return None
    scheme, _, rest = value.partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return rest.strip()
    if scheme == b"basic":
        try:
            decoded = b64decode(rest.strip(), validate=True)
        except ValueError:
            return None
        return decoded.partition(b":")[2]
    return None


def check_key(authorization: bytes | None, keys: Sequence[bytes], what: str) -> None:
    """401 unless ``authorization`` presents one of ``keys`` (none configured: open)."""
    if not keys:
        return
    presented = _presented_key(authorization)
    # Compare against every key, always: constant time in the key material.
    ok = False
    for key in keys:
        ok |= presented is not None and hmac.compare_digest(presented, key)
    if not ok:
        raise Unauthorized(f"Invalid or missing {what}.", headers={"WWW-Authenticate": "Bearer"})


def require_client(request: Request) -> None:
    check_key(header(request, b"authorization"), _gateway(request).client_keys, "API key")


def require_admin(request: Request) -> None:
    gw = _gateway(request)
    if gw.admin_keys:
        check_key(header(request, b"authorization"), gw.admin_keys, "admin key")
    else:
        require_client(request)


# --- request parsing ----------------------------------------------------------------------


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The whole body from ASGI ``receive``, refused early (413) when its declared
    ``Content-Length`` is, or what arrives becomes, larger than ``limit``."""
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Invalid Content-Length header.")
        _check_body_size(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        _check_body_size(size, limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def request_body(request: Request, limit: int) -> bytes:
    return await read_body(request.receive, header(request, b"content-length"), limit)


def _check_body_size(size: int, limit: int) -> None:
    if size > limit:
        raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit.", limit="body")


def parse_json_object(body: bytes, max_depth: int | None = None) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc.msg}.") from None
    if not isinstance(payload, dict):
        raise BadRequest("Request body must be a JSON object.")
    if max_depth is not None and _too_deep(body, payload, max_depth):
        raise BadRequest(f"JSON body nests deeper than {max_depth} levels.", limit="json_depth")
    return payload


def _too_deep(body: bytes, payload: dict[str, Any], limit: int) -> bool:
    """Whether objects/arrays nest more than ``limit`` deep. The number of ``[`` and ``{``
    in the raw bytes bounds the depth from above, so the walk runs only for bodies with
    many containers -- never for a TRL rollout (a token-id list inside one object)."""
    if not _openers_exceed(body, limit):
        return False
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))
    return False


def _openers_exceed(body: bytes, limit: int) -> bool:
    """``body.count(b"[") + body.count(b"{") > limit``, found with ``find`` (memchr) from
    opener to opener and stopping past ``limit``: a TRL body (one of each) costs four
    calls, where counting walked every byte twice (5 % of a rollout's instructions,
    ``bench/results/instructions.ablations.md``)."""
    seen = 0
    for opener in (b"[", b"{"):
        at = body.find(opener)
        while at >= 0:
            seen += 1
            if seen > limit:
                return True
            at = body.find(opener, at + 1)
    return False


_CEILINGS = ("n", "max_tokens", "max_completion_tokens")  # n: max_n; else max_tokens_limit


def _check_generation(path: str, payload: Mapping[str, Any], settings: Settings) -> None:
    """Reject, with the offending ``param``, what no replica could serve or the operator's
    ceilings forbid. The rest is vLLM's to validate: the body is forwarded untouched."""
    get = payload.get
    model = get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string.", param="model")
    stream = get("stream")
    if stream is not None and stream is not True and stream is not False:
        raise BadRequest("'stream' must be a boolean.", param="stream")
    for name in _CEILINGS:
        value = get(name)
        if value is None:
            continue
        if type(value) is not int or value < 1:  # JSON ints only: bool is a subclass
            raise BadRequest(f"'{name}' must be a positive integer.", param=name)
        ceiling = settings.max_n if name == "n" else settings.max_tokens_limit
        if ceiling is not None and value > ceiling:
            raise BadRequest(f"'{name}' must be at most {ceiling} here.", param=name, limit=name)
    if path.endswith("/chat/completions"):
        if not isinstance(get("messages"), list):
            raise BadRequest("'messages' must be a list.", param="messages")
    elif not isinstance(get("prompt"), (str, list)):
        raise BadRequest("'prompt' must be a string, token ids, or a list of them.", param="prompt")


def request_id_for(given: bytes | None) -> str:
    """The client's ``X-Request-Id`` (``given``) if it is sane, else a new one; also tags
    the logs.

    New ids are a random per-process prefix plus a counter: unique across gateways and
    restarts without a ``getrandom`` syscall per request."""
    request_id = given.decode("ascii") if given and _REQUEST_ID.match(given) else None
    request_id = request_id or f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"
    REQUEST_ID.set(request_id)
    return request_id


def _session_key(inbound: Inbound, payload: Mapping[str, Any]) -> str | None:
    given = inbound.header(b"x-session-id")
    key = given.decode("latin-1") if given else payload.get("user")
    return key if isinstance(key, str) and key else None


# --- dispatch to one replica --------------------------------------------------------------


@dataclass(slots=True)
class Pick:
    """How one request chooses its replica, and what to tell others when it starts/ends.

    ``started(i)`` may refuse a replica (e.g. its adapter copy is being retired); the
    request then picks again among the others."""

    choose: Callable[[Sequence[int]], int]
    started: Callable[[int], bool] | None = None
    finished: Callable[[int], None] | None = None


async def dispatch(
    inbound: Inbound, gw: Gateway, kind: RouteKind, body: bytes, candidates: Sequence[int],
    pick: Pick,
) -> Response:  # fmt: skip
    """Send to one replica chosen among ``candidates``; if it fails before any response
    byte (refused, reset, or aborted because it was ejected), try another while the retry
    budget allows. Streams are relayed as they arrive; nothing is retried after that."""
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
    gw.retry_budget.record_request(time.monotonic())
    retrying = False
    while True:
        if not remaining:
            raise UpstreamUnavailable("No healthy replica could take the request.")
        if retrying and not gw.retry_budget.try_retry(time.monotonic()):
            gw.metrics.retry_budget_exhausted.inc()
            raise UpstreamUnavailable(
                "A replica failed before answering and the retry budget is spent.",
                headers={"Retry-After": "1"},
            )
        index = pick.choose(remaining)
        remaining.remove(index)
        if pick.started is not None and not pick.started(index):
            continue
        if retrying:
            gw.metrics.retries.inc()
        gw.pool.acquire(index)
        gw.outliers.dispatched(index)
        gw.metrics.record_routed(index)
        gw.tasks.enter(index, task)
        upstream: UpstreamResponse
        try:
            with guard:
                if lean:
                    upstream, content = await gw.upstream.send_routed(
                        index, inbound.method, target, head_lines, body
                    )
                else:
                    upstream, content = await _exchange(gw, index, inbound, headers, body)
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

        def was_ejected() -> bool:
            if gw.tasks.take(task):
                gw.metrics.aborted.inc()
                return True
            return False

        return RelayResponse(upstream, out_headers, guard, on_close, was_ejected)
    gw.tasks.leave(index, task)
    _release(gw, pick, index)
    gw.metrics.record_request(kind, status, time.perf_counter() - started)
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


def plan_rollout(gw: Gateway, inbound: Inbound, body: bytes) -> tuple[list[int], Pick]:
    """ROUTED (completions and chat completions): validate the body, and say which
    replicas may serve it and how to choose among them. Synchronous: no coroutine."""
    settings = gw.settings
    payload = parse_json_object(body, settings.max_json_depth)
    path = inbound.path
    _check_generation(path, payload, settings)
    model = payload.get("model")
    healthy = gw.routable_or_503()
    allowed = gw.adapters.candidates(model)
    candidates = healthy if allowed is None else [i for i in healthy if i in allowed]
    if not candidates:
        if isinstance(model, str) and gw.adapters.is_live(model):
            raise UpstreamUnavailable(f"No healthy replica holds `{model}` right now.",
                                      headers={"Retry-After": "1"})  # fmt: skip
        # vLLM's own answer for a model it does not serve.
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    route_request = RouteRequest(
        path=path,
        model=model,
        payload=payload,
        session_key=_session_key(inbound, payload),
        lacking_adapter=_NONE if allowed is None else frozenset(healthy) - frozenset(candidates),
    )

    def choose(remaining: Sequence[int]) -> int:
        loads = CandidateLoads(gw.pool.loads(remaining))
        t0 = time.perf_counter()
        decision = gw.router.choose(route_request, loads)
        gw.metrics.record_decision(decision, time.perf_counter() - t0)
        gw.router.observe(decision)
        return decision.replica

    if allowed is None:
        return candidates, Pick(choose)
    assert model is not None
    manager = gw.adapters
    pick = Pick(
        choose,
        started=lambda i: manager.request_started(model, i),
        finished=lambda i: manager.request_finished(model, i),
    )
    return candidates, pick


async def forwarded(request: Request) -> Response:
    """FORWARDED: any other path goes to the least-loaded healthy replica."""
    gw = _gateway(request)
    require_client(request)
    inbound = Inbound.from_scope(request.scope, request.receive)
    client = admit(gw, inbound)
    try:
        body = await request_body(request, gw.settings.max_body_bytes)

        def choose(remaining: Sequence[int]) -> int:
            return min(remaining, key=lambda i: (gw.pool[i].in_flight, i))

        response = await dispatch(inbound, gw, RouteKind.FORWARDED, body,
                                  gw.routable_or_503(), Pick(choose))  # fmt: skip
    except BaseException:
        gw.admission.leave(client)
        raise
    return Releasing(response, lambda: gw.admission.leave(client))


# --- limits -------------------------------------------------------------------------------


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


def check_headers(headers: Sequence[tuple[bytes, bytes]], settings: Settings) -> None:
    """431 for too many or too large request headers (the server parsed them already;
    this keeps them out of everything downstream: logs, upstream, the router)."""
    if len(headers) > settings.max_header_count:
        raise HeadersTooLarge(f"More than {settings.max_header_count} request headers.",
                              limit="header_count")  # fmt: skip
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
    if size > settings.max_header_bytes:
        raise HeadersTooLarge(f"Request headers exceed {settings.max_header_bytes} bytes.",
                              limit="header_bytes")  # fmt: skip


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


# --- broadcast ----------------------------------------------------------------------------


def _relay_buffered(result: BufferedResponse, request_id: str) -> Response:
    headers = response_headers(result.headers, result.replica, request_id)
    return BodyResponse(result.status, headers, result.content)


async def broadcast(request: Request) -> Response:
    """BROADCAST: pause/resume/reset via ``FleetControl`` and LoRA load/unload via the
    adapter manager, both judged by ``gateway.quorum``'s rule (lost replicas left out)."""
    gw = _gateway(request)
    require_admin(request)
    body = await request_body(request, gw.settings.max_body_bytes)
    path = request.url.path
    request_id = request_id_for(header(request, b"x-request-id"))
    if path in _ADAPTER_PATHS:
        payload = parse_json_object(body, gw.settings.max_json_depth)
        manager = gw.adapters
        handler = manager.load if path == "/v1/load_lora_adapter" else manager.unload
        reply = await handler(payload)
        return Response(reply.content, status_code=reply.status, media_type=reply.media_type)
    query = request.scope.get("query_string", b"").decode("latin-1")
    headers = request_headers(request.scope["headers"], request_id)
    endpoint = path.rsplit("/", 1)[-1]
    try:
        first, tally = await gw.control.broadcast(
            request.method, path, body=body or None, query=query, headers=headers
        )
    except GatewayError:
        gw.metrics.broadcasts.labels(endpoint, "failed").inc()
        raise
    gw.metrics.broadcasts.labels(endpoint, "ok").inc()
    if path == "/reset_prefix_cache":
        for index in tally.applied:
            gw.forget_cache(index)
    return _relay_buffered(first, request_id)


# --- fan-in -------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """FAN-IN: 200 (empty, like vLLM) only when enough replicas are up."""
    gw = _gateway(request)
    down = [r.index for r in gw.pool.replicas if not r.up]
    up = len(gw.pool) - len(down)
    if up >= gw.min_healthy and up > 0:
        return Response(status_code=200)
    raise UpstreamUnavailable(
        f"{up}/{len(gw.pool)} replicas healthy; down: {down}", headers={"Retry-After": "2"}
    )


def _weakest_lora_config(configs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = dict(configs[0])
    for key in ("max_lora_rank", "max_loras", "max_cpu_loras"):
        values = [c[key] for c in configs if isinstance(c.get(key), int)]
        if values:
            merged[key] = min(values)
    return merged


async def server_info(request: Request) -> Response:
    """``/server_info`` of one replica, made to describe the fleet as TRL must see it:
    ``data_parallel_size == 1`` and the *weakest* replica's LoRA limits."""
    gw = _gateway(request)
    require_client(request)
    query = request.scope.get("query_string", b"").decode("latin-1")
    results = [r for r in await gw.fan_out("GET", "/server_info", query=query) if r.status == 200]
    if not results:
        raise UpstreamUnavailable("No healthy replica answered /server_info.")
    try:
        infos = [orjson.loads(r.content) for r in results]
    except orjson.JSONDecodeError:
        return _relay_buffered(results[0], request_id_for(header(request, b"x-request-id")))
    info = infos[0]
    vllm_config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(vllm_config, dict):
        loras = [
            c
            for i in infos
            if isinstance(c := (i.get("vllm_config") or {}).get("lora_config"), dict)
        ]
        if loras:
            weakest = _weakest_lora_config(loras)
            if any(c != loras[0] for c in loras) or len(loras) != len(infos):
                log.warning("replicas disagree on lora_config; reporting the weakest: %s", weakest)
            vllm_config["lora_config"] = weakest
        parallel = vllm_config.setdefault("parallel_config", {})
        if isinstance(parallel, dict):
            parallel["data_parallel_size"] = 1
    return json_response(info)


async def models(request: Request) -> Response:
    """``/v1/models``: the base model(s) of one replica, plus the adapters that are live on
    every replica (the adapter manager's view, not any single replica's)."""
    gw = _gateway(request)
    require_client(request)
    results = [r for r in await gw.fan_out("GET", "/v1/models") if r.status == 200]
    if not results:
        raise UpstreamUnavailable("No healthy replica answered /v1/models.")
    listing = orjson.loads(results[0].content)
    entries = [m for m in listing.get("data", []) if isinstance(m, dict)]
    bases = [m for m in entries if not m.get("parent")]
    known = {m["id"]: m for m in entries if m.get("parent")}
    parent = bases[0]["id"] if bases else None
    live = []
    for adapter in gw.adapters.live_adapters():
        entry = dict(
            known.get(adapter.name)
            or {"id": adapter.name, "object": "model", "owned_by": "vllm", "parent": parent}
        )
        entry["root"] = adapter.path
        live.append(entry)  # fmt: skip
    listing["data"] = [*bases, *live]
    return json_response(listing)


# --- the gateway's own --------------------------------------------------------------------


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


async def status(request: Request) -> Response:
    gw = _gateway(request)
    require_client(request)
    return json_response(gw.status())


def _method_not_allowed(allowed: Sequence[str]) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        raise MethodNotAllowed(
            f"Method {request.method} not allowed on {request.url.path}.",
            headers={"Allow": ", ".join(allowed)},
        )

    return handler


def _with_405(path: str, endpoint: Callable[[Request], Awaitable[Response]],
              methods: Sequence[str]) -> list[BaseRoute]:  # fmt: skip
    others = [m for m in _ALL_METHODS if m not in methods]
    return [
        Route(path, endpoint, methods=list(methods)),
        Route(path, _method_not_allowed(methods), methods=others, include_in_schema=False),
    ]


def build_routes() -> list[BaseRoute]:
    # POST to a ROUTED path never gets here: ``FastPath`` serves it; other methods: 405.
    not_post = [m for m in _ALL_METHODS if m != "POST"]
    routes: list[BaseRoute] = [
        Route(path, _method_not_allowed(["POST"]), methods=not_post) for path in ROUTED_PATHS
    ]
    for path in BROADCAST_PATHS:
        routes += _with_405(path, broadcast, ["POST"])
    routes += _with_405("/health", health, ["GET"])
    routes += _with_405("/server_info", server_info, ["GET"])
    routes += _with_405("/v1/models", models, ["GET"])
    routes += _with_405("/metrics", metrics, ["GET"])
    routes += _with_405("/gateway/status", status, ["GET"])
    routes.append(Route("/{path:path}", forwarded, methods=list(_ALL_METHODS)))
    return routes


class FastPath:
    """Outer ASGI app: header limits for every request, and ``POST`` to a ROUTED path
    skips Starlette's router and middleware; ``lean`` serves the rollouts that
    ``gateway.h1server`` read, without ASGI at all.

    Rollouts are the gateway's whole load; on 2 cores the proxy's CPU per request is its
    throughput, and the generic stack (route matching, two exception middlewares wrapping
    every ``send``, then the ASGI scope, ``Request`` and ``Response`` objects) cost a
    measurable share of it (``bench/overhead.py``, ``bench/cpu_per_request.py``).
    Everything else goes to the full Starlette app. Errors are mapped exactly as its
    handlers map them.
    """

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.gateway: Gateway = app.state.gateway

    @property
    def state(self) -> State:
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in ROUTED_PATHS:
            response, client = await self.respond(Inbound.from_scope(scope, receive))
            try:
                if response is not None:
                    await response(scope, receive, send)
            finally:
                if client is not None:
                    self.gateway.admission.leave(client)
            return
        try:
            check_headers(scope["headers"], self.gateway.settings)
        except GatewayError as exc:
            await self._refuse(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def lean(self, exchange: LeanExchange) -> None:
        """``gateway.h1server``'s handler: a rollout it read, answered in one write when
        the response is complete (its headers are the gateway's own or ones its parser
        accepted, see ``LeanExchange.respond``); a stream is relayed chunk by chunk
        (``RelayResponse.stream_to``); while writing is paused, the ASGI way."""
        if exchange.gone:
            return
        task = exchange.task
        inbound = Inbound(
            "POST", exchange.path, exchange.raw_path, b"", exchange.headers, exchange.client,
            task, DisconnectGuard(task, lost=exchange.lost), body=exchange.body,
        )  # fmt: skip
        response, client = await self.respond(inbound)
        try:
            if response is None:
                return
            if isinstance(response, RelayResponse):
                await response.stream_to(exchange)
            elif not exchange.respond(
                response.status_code, response.raw_headers, bytes(response.body)
            ):
                await response(_LEAN_SCOPE, exchange.receive, exchange.send)
        finally:
            if client is not None:
                self.gateway.admission.leave(client)

    async def respond(self, inbound: Inbound) -> tuple[Response | None, bytes | None]:
        """The response to a rollout (None: the client left) and the admission key to
        ``leave`` with once it is sent (None: refused before admission)."""
        gw = self.gateway
        try:
            check_headers(inbound.headers, gw.settings)
            client = admit(gw, inbound)
        except GatewayError as exc:
            return self._refuse(exc), None
        try:
            check_key(inbound.header(b"authorization"), gw.client_keys, "API key")
            limit = gw.settings.max_body_bytes
            body = inbound.body  # already read by ``gateway.h1server``
            if body is None:  # uvicorn's connection: read_body enforces the limit
                assert inbound.receive is not None
                body = await read_body(inbound.receive, inbound.header(b"content-length"), limit)
            else:
                _check_body_size(len(body), limit)
            candidates, pick = plan_rollout(gw, inbound, body)
            response = await dispatch(inbound, gw, RouteKind.ROUTED, body, candidates, pick)
            return response, client
        except ClientDisconnected:
            return None, client
        except GatewayError as exc:
            return self._refuse(exc), client
        except Exception:
            log.exception("unhandled error on POST %s", inbound.path)
            return error_response(GatewayError("Internal gateway error.")), client
        except BaseException:
            gw.admission.leave(client)
            raise

    def _refuse(self, exc: GatewayError) -> Response:
        if exc.limit is not None:
            self.gateway.metrics.rejected.labels(exc.limit).inc()
        return error_response(exc)


# What a response sent the ASGI way over a lean connection reads of its scope.
_LEAN_SCOPE: Scope = {"type": "http"}
