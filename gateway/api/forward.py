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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.auth import require_tenant
from gateway.api.requests import parse_json_object, request_body
from gateway.api.responses import gateway_of
from gateway.api.rollout import Pick, Releasing, admit, dispatch
from gateway.errors import BadRequest, UpstreamUnavailable
from gateway.http.relay import BodyResponse
from gateway.http.server.inbound import Inbound
from gateway.metrics import RouteKind
from gateway.runs.scope import own_listing, scoped_model, unknown_model

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.runs.tenancy import Tenant

__all__ = ["forwarded", "plan_forward"]


async def forwarded(request: Request) -> Response:
    """FORWARDED: the least-loaded replica among those the request may go to."""
    gw = gateway_of(request)
    tenant = require_tenant(request)
    inbound = Inbound.from_scope(request.scope, request.receive)
    client = admit(gw, inbound)
    try:
        body = await request_body(request, gw.settings.max_body_bytes)
        candidates, body, scope = plan_forward(gw, body, tenant)

        def choose(remaining: Sequence[int]) -> int:
            return min(remaining, key=lambda i: (gw.pool[i].in_flight, i))

        response = await dispatch(inbound, gw, RouteKind.FORWARDED, body, candidates,
                                  Pick(choose), scope)  # fmt: skip
        if scope is not None and isinstance(response, BodyResponse) and response.status_code < 300:
            content = bytes(response.body)
            listed = own_listing(scope.run, content)
            if listed is not content:  # BodyResponse adds its own Content-Length
                headers = [h for h in response.raw_headers if h[0] != b"content-length"]
                response = BodyResponse(response.status_code, headers, listed)
    except BaseException:
        gw.admission.leave(client)
        raise
    return Releasing(response, lambda: gw.admission.leave(client))


def plan_forward(
    gw: Gateway, body: bytes, tenant: Tenant
) -> tuple[list[int], bytes, Tenant | None]:
    """Where a FORWARDED request may go, the body to send, and the run whose names its
    answer must show (None: single-run mode, nothing to scope). Synchronous."""
    healthy = gw.routable_or_503()
    homes = tenant.fan_in_replicas(healthy)
    if homes is None:  # the implicit run: every replica, the body as it came
        return healthy, body, None
    if not homes:
        raise UpstreamUnavailable("No healthy replica is home to this run right now.",
                                  headers={"Retry-After": "1"})  # fmt: skip
    if not body:
        return homes, body, tenant
    payload = parse_json_object(body, gw.settings.max_json_depth)
    asked = payload.get("model")
    if asked is not None and not isinstance(asked, str):
        raise BadRequest("'model' must be a string.", param="model")
    model, allowed, body = scoped_model(tenant, payload, body)
    if allowed is None:
        return homes, body, tenant
    candidates = [i for i in homes if i in allowed]
    if not candidates:
        if isinstance(model, str) and tenant.routes.is_live(model):
            raise UpstreamUnavailable(f"No healthy replica holds `{asked}` right now.",
                                      headers={"Retry-After": "1"})  # fmt: skip
        raise unknown_model(asked)
    return candidates, body, tenant
