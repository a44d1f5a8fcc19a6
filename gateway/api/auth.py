"""Which keys a handler needs, and (multi-run mode) which run a request belongs to: the
request side of ``gateway.runs.credentials``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from gateway.api.requests import header
from gateway.api.responses import gateway_of

if TYPE_CHECKING:
    from gateway.runs.tenancy import Tenant


def require_tenant(request: Request) -> Tenant:
    """The request's run: single-run mode's one run once the client key checks out, or
    (multi-run) the run whose key it presents."""
    return gateway_of(request).credentials.tenant(header(request, b"authorization"))


def require_client(request: Request) -> None:
    require_tenant(request)


def require_viewer(request: Request) -> Tenant | None:
    """``/gateway/status``: a client, or (multi-run mode) the admin, who sees every run
    (None), or a run, which sees itself."""
    gw = gateway_of(request)
    admin = gw.credentials.is_admin(header(request, b"authorization"))
    return gw.mode.viewer(admin, lambda: require_client(request), lambda: require_tenant(request))


def require_admin(request: Request) -> Tenant:
    """Control calls: the admin key if one is set (single-run mode), else a client's; in
    multi-run mode the run's own key (each run controls only itself)."""
    gw = gateway_of(request)
    credentials = gw.credentials
    return gw.mode.controller(
        bool(credentials.admin_keys),
        lambda: credentials.check_admin(header(request, b"authorization")),
        lambda: require_tenant(request),
    )
