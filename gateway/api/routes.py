"""The route table (Starlette): which handler serves each path, 405s with ``Allow``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.api.auth import require_viewer
from gateway.api.broadcast import CONTROL_HANDLERS
from gateway.api.fanin import health, models, server_info
from gateway.api.forward import forwarded
from gateway.api.requests import header
from gateway.api.responses import gateway_of, json_response
from gateway.errors import MethodNotAllowed, Unauthorized
from gateway.http.server.h1server import ROUTED_PATHS
from gateway.metrics import CONTENT_TYPE

_ALL_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    # The owner of data-plane workers answers for the whole gateway (``gateway.roles``).
    text = await gw.peers.merged_metrics(gw.metrics.render())
    return Response(text, media_type=CONTENT_TYPE)


async def status(request: Request) -> Response:
    gw = gateway_of(request)
    data = gw.status(require_viewer(request))
    await gw.peers.add_status(data)
    return json_response(data)


async def reload_runs(request: Request) -> Response:
    """``POST /gateway/runs/reload`` (the admin key): re-read the config file's runs and
    apply them live (docs/many-runs.md, "Runs join and leave live"); 400 naming the
    problem if the new set is invalid (the old one keeps serving)."""
    gw = gateway_of(request)
    if not gw.credentials.admin_keys:
        raise Unauthorized("Reloading the runs needs the admin key, and none is set.",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    gw.credentials.check_admin(header(request, b"authorization"))
    return json_response(await gw.mode.reload(gw.fleet, "POST /gateway/runs/reload"))


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
    for path, handler in CONTROL_HANDLERS.items():
        routes += _with_405(path, handler, ["POST"])
    routes += _with_405("/health", health, ["GET"])
    routes += _with_405("/server_info", server_info, ["GET"])
    routes += _with_405("/v1/models", models, ["GET"])
    routes += _with_405("/metrics", metrics, ["GET"])
    routes += _with_405("/gateway/status", status, ["GET"])
    routes += _with_405("/gateway/runs/reload", reload_runs, ["POST"])
    routes.append(Route("/{path:path}", forwarded, methods=list(_ALL_METHODS)))
    return routes
