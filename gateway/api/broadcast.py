"""BROADCAST: the control calls every replica must apply, one handler per path, all
judged by ``gateway.fleet.quorum``'s rule (lost replicas left out).

LoRA load and unload go through the caller's run's adapter manager (a transaction on
every replica it spans); ``/pause``, ``/resume`` and ``/reset_prefix_cache`` through
``FleetControl``. In multi-run mode each call is the run's own (``Tenant``'s scope): its
adapters under its prefix, on its homes; a scoped ``/pause`` holds only its rollouts, at
the gateway; its ``/reset_prefix_cache`` reaches only its homes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.adapters.manager import AdapterReply
from gateway.api.auth import require_admin
from gateway.api.requests import parse_json_object, request_body
from gateway.api.requests import request_id as current_request_id
from gateway.api.responses import gateway_of, json_response, relay_buffered
from gateway.errors import GatewayError
from gateway.fleet.control import PAUSE, RESET, RESUME
from gateway.http.upstream import request_headers
from gateway.runs.tenancy import Tenant

__all__ = ["CONTROL_HANDLERS"]

Handler = Callable[[Request], Awaitable[Response]]


async def _adapter_call(
    request: Request,
    call: Callable[[Tenant], Callable[[Mapping[str, Any]], Awaitable[AdapterReply]]],
) -> Response:
    gw = gateway_of(request)
    tenant = require_admin(request)
    body = await request_body(request, gw.settings.max_body_bytes)
    payload = parse_json_object(body, gw.settings.max_json_depth)
    run = tenant.run
    try:
        reply = await call(tenant)(tenant.adapter_call(request.url.path, payload))
    except GatewayError as exc:
        exc.message = run.unscope_text(exc.message)
        raise
    return Response(run.unscope(reply.content), status_code=reply.status,
                    media_type=reply.media_type)  # fmt: skip


async def load(request: Request) -> Response:
    """``POST /v1/load_lora_adapter``: live on every replica, or on none."""
    return await _adapter_call(request, lambda t: t.manager.load)


async def unload(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``: acknowledged at once, applied as copies drain."""
    return await _adapter_call(request, lambda t: t.manager.unload)


async def _fleet_call(request: Request, tenant: Tenant, replicas: list[int] | None) -> Response:
    """The call on ``replicas`` (None: every healthy one), judged by the quorum rule."""
    gw = gateway_of(request)
    body = await request_body(request, gw.settings.max_body_bytes)
    path = request.url.path
    endpoint = path.rsplit("/", 1)[-1]
    query = request.scope.get("query_string", b"").decode("latin-1")
    request_id = current_request_id()
    headers = request_headers(request.scope["headers"], request_id)
    try:
        first, tally = await gw.control.broadcast(
            request.method, path, body=body or None, query=query, headers=headers,
            replicas=replicas,
        )  # fmt: skip
    except GatewayError:
        gw.metrics.broadcasts.labels(endpoint, "failed").inc()
        raise
    gw.metrics.broadcasts.labels(endpoint, "ok").inc()
    if path == RESET:
        for index in tally.applied:
            gw.rotation.forget_cache(index)
    return relay_buffered(first, request_id)


async def _pause_or_resume(request: Request, pausing: bool) -> Response:
    gw = gateway_of(request)
    tenant = require_admin(request)
    if not tenant.holds_pause(gw.settings.run_pause):
        return await _fleet_call(request, tenant, None)
    await request_body(request, gw.settings.max_body_bytes)  # read, as vLLM does
    if pausing:
        query = request.scope.get("query_string", b"").decode("latin-1")
        await tenant.pause(query, gw.settings.broadcast_timeout_s)
    else:
        tenant.resume()
    gw.metrics.broadcasts.labels("pause" if pausing else "resume", "ok").inc()
    return json_response({"status": "paused" if pausing else "resumed"})


async def pause(request: Request) -> Response:
    """``POST /pause``: the fleet's replicas (or, scoped, the run's rollouts at the gateway)."""
    return await _pause_or_resume(request, pausing=True)


async def resume(request: Request) -> Response:
    """``POST /resume``."""
    return await _pause_or_resume(request, pausing=False)


async def reset(request: Request) -> Response:
    """``POST /reset_prefix_cache``: a run's homes' caches (co-tenants there lose hits,
    never correctness), or every replica's."""
    gw = gateway_of(request)
    tenant = require_admin(request)
    return await _fleet_call(request, tenant, tenant.reset_replicas(gw.pool.healthy_indices()))


CONTROL_HANDLERS: dict[str, Handler] = {
    "/v1/load_lora_adapter": load,
    "/v1/unload_lora_adapter": unload,
    PAUSE: pause,
    RESUME: resume,
    RESET: reset,
}
