"""Client and admin keys, and (multi-run mode) which run a request belongs to.

Keys arrive as ``Bearer KEY`` or as Basic auth's password, which is all TRL can send
(``http://user:KEY@gateway`` in its server URL)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.requests import Request

from gateway.api.requests import header
from gateway.api.responses import gateway_of
from gateway.errors import Unauthorized
from gateway.runs.table import presented_credential

if TYPE_CHECKING:
    from gateway.runs.tenancy import Tenant


def _presents(authorization: bytes | None, keys: Sequence[bytes]) -> bool:
    """Whether ``authorization`` presents one of ``keys``. Compares against every key,
    always: constant time in the key material."""
    presented = presented_credential(authorization)[1]
    ok = False
    for key in keys:
        ok |= presented is not None and hmac.compare_digest(presented, key)
    return ok


def check_key(authorization: bytes | None, keys: Sequence[bytes], what: str) -> None:
    """401 unless ``authorization`` presents one of ``keys`` (none configured: open)."""
    if keys and not _presents(authorization, keys):
        raise Unauthorized(f"Invalid or missing {what}.", headers={"WWW-Authenticate": "Bearer"})


def require_tenant(request: Request) -> Tenant:
    """The request's run: single-run mode's one run once the client key checks out, or
    (multi-run) the run whose key it presents."""
    gw = gateway_of(request)
    authorization = header(request, b"authorization")
    check_key(authorization, gw.client_keys, "API key")
    return gw.tenancy.for_request(authorization)


def require_client(request: Request) -> None:
    require_tenant(request)


def require_viewer(request: Request) -> Tenant | None:
    """``/gateway/status``: a client, or (multi-run mode) the admin, who sees every run
    (None), or a run, which sees itself."""
    gw = gateway_of(request)
    admin = bool(gw.admin_keys) and _presents(header(request, b"authorization"), gw.admin_keys)
    return gw.mode.viewer(admin, lambda: require_client(request), lambda: require_tenant(request))


def require_admin(request: Request) -> Tenant:
    """Control calls: the admin key if one is set (single-run mode), else a client's; in
    multi-run mode the run's own key (each run controls only itself)."""
    gw = gateway_of(request)
    return gw.mode.controller(
        bool(gw.admin_keys),
        lambda: check_key(header(request, b"authorization"), gw.admin_keys, "admin key"),
        lambda: require_tenant(request),
    )
