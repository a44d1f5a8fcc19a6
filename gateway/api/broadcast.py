"""BROADCAST: the control calls every replica must apply (``gateway.fleet.quorum``'s rule)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.auth import require_admin
from gateway.api.requests import header, parse_json_object, request_body, request_id_for
from gateway.api.responses import gateway_of, json_response, relay_buffered
from gateway.errors import GatewayError
from gateway.fleet.control import PAUSE, RESET, RESUME
from gateway.http.upstream import request_headers

_ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def broadcast(request: Request) -> Response:
    """BROADCAST: pause/resume/reset via ``FleetControl`` and LoRA load/unload via the
    adapter manager, both judged by ``gateway.fleet.quorum``'s rule (lost replicas left out).

    Multi-run mode: the call is the run's own. A load or unload names the run's adapter
    (on its home replicas, under its prefix); a scoped ``/pause`` holds only the run's
    rollouts at the gateway, and its ``/reset_prefix_cache`` reaches only its homes."""
    gw = gateway_of(request)
    tenant = require_admin(request)
    run = tenant.run
    body = await request_body(request, gw.settings.max_body_bytes)
    path = request.url.path
    request_id = request_id_for(header(request, b"x-request-id"))
    if path in _ADAPTER_PATHS:
        payload = parse_json_object(body, gw.settings.max_json_depth)
        handler = tenant.manager.load if path == "/v1/load_lora_adapter" else tenant.manager.unload
        if run.prefix:
            if path == "/v1/load_lora_adapter":
                tenant.check_placed()
            if isinstance(name := payload.get("lora_name"), str) and name:
                payload = {**payload, "lora_name": run.replica_name(name)}
        try:
            reply = await handler(payload)
        except GatewayError as exc:
            exc.message = run.unscope_text(exc.message)
            raise
        content = run.unscope(reply.content)
        return Response(content, status_code=reply.status, media_type=reply.media_type)
    query = request.scope.get("query_string", b"").decode("latin-1")
    endpoint = path.rsplit("/", 1)[-1]
    if run.prefix and gw.settings.run_pause == "scoped" and path in (PAUSE, RESUME):
        if path == PAUSE:
            await tenant.pause(query, gw.settings.broadcast_timeout_s)
        else:
            tenant.resume()
        gw.metrics.broadcasts.labels(endpoint, "ok").inc()
        return json_response({"status": "paused" if path == PAUSE else "resumed"})
    headers = request_headers(request.scope["headers"], request_id)
    # A run's reset empties only its homes' caches (co-tenants there lose hits, never
    # correctness); a fleet-wide pause (``run_pause: fleet``) reaches every replica.
    homes = None
    if run.prefix and path == RESET:
        homes = tenant.among(gw.pool.healthy_indices())
    try:
        first, tally = await gw.control.broadcast(
            request.method, path, body=body or None, query=query, headers=headers,
            replicas=homes,
        )  # fmt: skip
    except GatewayError:
        gw.metrics.broadcasts.labels(endpoint, "failed").inc()
        raise
    gw.metrics.broadcasts.labels(endpoint, "ok").inc()
    if path == RESET:
        for index in tally.applied:
            gw.forget_cache(index)
    return relay_buffered(first, request_id)
