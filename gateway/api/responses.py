"""Building responses: JSON, OpenAI-style errors, a replica's buffered answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.http.relay import BodyResponse
from gateway.http.upstream import (
    BufferedResponse,
    response_headers,
)
from gateway.logs import REQUEST_ID

if TYPE_CHECKING:
    from gateway.core import Gateway


_JSON = "application/json"


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=_JSON, headers=headers)


def error_response(exc: GatewayError) -> Response:
    """The error as OpenAI-style JSON; inside a request (``REQUEST_ID`` set), its id in
    the body (``error.request_id``) and in ``X-Request-Id``, as on any answer."""
    request_id = REQUEST_ID.get()
    if request_id is None:
        return Response(exc.body(), status_code=exc.status, media_type=_JSON,
                        headers=exc.headers)  # fmt: skip
    headers = {**exc.headers, "x-request-id": request_id}
    return Response(exc.body(request_id), status_code=exc.status, media_type=_JSON,
                    headers=headers)  # fmt: skip


def relay_buffered(result: BufferedResponse, request_id: str) -> Response:
    headers = response_headers(result.headers, result.replica, request_id)
    return BodyResponse(result.status, headers, result.content)
