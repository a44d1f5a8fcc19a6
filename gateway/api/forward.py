"""FORWARDED: any path the gateway does not serve itself goes to one replica (least
loaded): ``/tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/version``, ...

In multi-run mode such a request is scoped to its run exactly as a rollout is
(``gateway.runs.scope.scoped_model``): it goes to the run's home replicas, an adapter it
names is read as the run's own (sent under its prefix; another run's name, or one it
never loaded, gets vLLM's 404), and the answer shows the run's names only. So its body
must be a JSON object the gateway can read the ``model`` of (400 otherwise): a body the
gateway cannot read could name any adapter on a shared replica. Single-run mode forwards
the request as it came.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.auth import require_tenant
from gateway.api.requests import parse_json_object, request_body
from gateway.api.responses import gateway_of
from gateway.api.rollout import Releasing, dispatch
from gateway.errors import BadRequest
from gateway.fleet.selection import Plan
from gateway.http.relay import BodyResponse
from gateway.http.server.inbound import Inbound
from gateway.metrics import RouteKind
from gateway.runs.scope import own_listing

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.runs.tenancy import Tenant

__all__ = ["forwarded", "plan_forward"]


async def forwarded(request: Request) -> Response:
    """FORWARDED: the least-loaded replica among those the request may go to."""
    gw = gateway_of(request)
    tenant = require_tenant(request)
    inbound = Inbound.from_scope(request.scope, request.receive)
    ledger = gw.ledger
    entry = ledger.enter(inbound, RouteKind.FORWARDED)
    try:
        body = await request_body(request, gw.settings.max_body_bytes)
        plan = plan_forward(gw, body, tenant)
        response = await dispatch(inbound, gw, entry, plan)
        scope = plan.scope
        if scope is not None and isinstance(response, BodyResponse) and response.status_code < 300:
            content = bytes(response.body)
            listed = own_listing(scope.run, content)
            if listed is not content:  # BodyResponse adds its own Content-Length
                headers = [h for h in response.raw_headers if h[0] != b"content-length"]
                response = BodyResponse(response.status_code, headers, listed)
    except BaseException:
        ledger.exit(entry)
        raise
    return Releasing(response, ledger, entry)


def plan_forward(gw: Gateway, body: bytes, tenant: Tenant) -> Plan:
    """Where a FORWARDED request may go and the body to send (``Selection.forwarded``),
    which reads the body only where it must be scoped (multi-run mode): then it must be a
    JSON object whose ``model``, if any, is a string. Synchronous."""
    depth = gw.settings.max_json_depth

    def parse(raw: bytes) -> dict[str, Any]:
        payload = parse_json_object(raw, depth)
        if not isinstance(payload.get("model", ""), str):
            raise BadRequest("'model' must be a string.", param="model")
        return payload

    return gw.selection.forwarded(body, tenant, parse)
