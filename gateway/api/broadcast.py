"""BROADCAST: the control calls every replica must apply (``gateway.fleet.quorum``'s rule)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.auth import require_admin
from gateway.api.requests import header, parse_json_object, request_body, request_id_for
from gateway.api.responses import gateway_of, relay_buffered
from gateway.errors import GatewayError
from gateway.http.upstream import request_headers

_ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def broadcast(request: Request) -> Response:
    """BROADCAST: pause/resume/reset via ``FleetControl`` and LoRA load/unload via the
    adapter manager, both judged by ``gateway.fleet.quorum``'s rule (lost replicas left out)."""
    gw = gateway_of(request)
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
    return relay_buffered(first, request_id)
