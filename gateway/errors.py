"""OpenAI-style errors, each carrying its HTTP status; mapped to a response once, at the edge.

Every error the gateway itself produces has the shape
``{"error": {"message": str, "type": str, "param": str | None, "code": int | str | None}}``,
the same envelope vLLM's OpenAI server uses, so clients parse one shape either way.

    GatewayError                      (status 500)
    ├── BadRequest                    400 invalid JSON, wrong types, bad adapter path
    ├── Unauthorized                  401 missing/invalid client or admin key
    ├── NotFound                      404 unknown route or model
    ├── MethodNotAllowed              405 known path, wrong method
    ├── PayloadTooLarge               413 body above ``max_body_bytes``
    ├── HeadersTooLarge               431 header bytes/count above the limits
    ├── TooManyRequests               429 admission limits
    ├── InsufficientSlots             507 a run that does not fit the replicas' LoRA budget
    ├── ShuttingDown                  503 SIGTERM came: in-flight work drains, new work refused
    └── UpstreamError                 (status 502)
        ├── UpstreamUnavailable       503 no healthy replica / all retries refused
        ├── UpstreamTimeout           504 replica did not answer in time
        └── BroadcastFailed           502 a fan-out that was not accepted everywhere

Messages never contain replica URLs (they may embed credentials): replicas are named by
index, e.g. ``replica 1``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

__all__ = [
    "BadRequest",
    "BroadcastFailed",
    "GatewayError",
    "HeadersTooLarge",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "ShuttingDown",
    "TooManyRequests",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "error_body",
]


def error_body(
    message: str,
    status: int,
    *,
    err_type: str | None = None,
    param: str | None = None,
    code: int | str | None = None,
    request_id: str | None = None,
) -> bytes:
    """Serialize one OpenAI-style error envelope. ``request_id``: the request's id (also
    its ``X-Request-Id`` response header) as a top-level ``request_id`` beside ``error``,
    so an error a client pastes into a ticket leads to the gateway's log lines about it;
    the ``error`` object stays exactly vLLM's (clients ignore the extra key)."""
    error = {
        "message": message,
        "type": err_type or HTTPStatus(status).phrase.replace(" ", ""),
        "param": param,
        "code": code if code is not None else status,
    }
    if request_id is None:
        return orjson.dumps({"error": error})
    return orjson.dumps({"error": error, "request_id": request_id})


class GatewayError(Exception):
    """Base class: an error the gateway answers itself, with its status and OpenAI type."""

    status: int = 500
    err_type: str = "InternalServerError"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        limit: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.limit = limit
        """Set when a configured limit refused the request (the rejection metric's label)."""

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(self.message, self.status, err_type=self.err_type, param=self.param,
                          request_id=request_id)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = orjson.loads(self.body())
        return result


class BadRequest(GatewayError):
    status = 400
    err_type = "BadRequestError"


class Unauthorized(GatewayError):
    status = 401
    err_type = "AuthenticationError"


class NotFound(GatewayError):
    status = 404
    err_type = "NotFoundError"


class MethodNotAllowed(GatewayError):
    status = 405
    err_type = "MethodNotAllowed"


class PayloadTooLarge(GatewayError):
    status = 413
    err_type = "PayloadTooLarge"


class HeadersTooLarge(GatewayError):
    status = 431
    err_type = "RequestHeaderFieldsTooLarge"


class TooManyRequests(GatewayError):
    status = 429
    err_type = "RateLimitError"


class InsufficientSlots(GatewayError):
    """Not a 404 (TRL reads that as "runtime LoRA disabled") nor a 503 (it is not
    transient): the fleet's adapter budget cannot hold the run until another run leaves or
    replicas join; the message names the budget."""

    status = 507
    err_type = "InsufficientStorage"


class ShuttingDown(GatewayError):
    """The gateway itself is stopping, not its replicas: a retry elsewhere (another pod, or
    this one's successor) will do."""

    status = 503
    err_type = "ServiceUnavailable"


class UpstreamError(GatewayError):
    status = 502
    err_type = "BadGateway"


class UpstreamUnavailable(UpstreamError):
    status = 503
    err_type = "ServiceUnavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    err_type = "GatewayTimeout"


class BroadcastFailed(UpstreamError):
    status = 502
    err_type = "BadGateway"
