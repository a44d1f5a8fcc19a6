"""Kubernetes' two questions, each with its own path, answered by the process that was
asked (in ``--workers N`` mode a worker answers for itself, never through the owner):

=========  ===========================================================================
path       200 when
=========  ===========================================================================
/livez     the process's event loop answers. Nothing else: not the replicas (restarting
           the gateway does not fix a replica), not a drain (the process is alive until
           it exits). A livenessProbe and the image's HEALTHCHECK ask this.
/readyz    it should be sent work: enough replicas are up (``/health``'s rule) and no
           SIGTERM has arrived (``Stopping``). A readinessProbe asks this; 503 takes the
           pod out of its Services while in-flight rollouts drain.
/health    unchanged, for TRL (it polls the vLLM URL's ``/health`` before training):
           the replicas only, like vLLM's own.
=========  ===========================================================================

``GET`` and ``HEAD`` only (the kubelet sends ``GET``); no key is asked, as for
``/health``: a probe carries none, and the answer tells nothing but up or down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.responses import Response

from gateway.api.responses import error_response
from gateway.errors import GatewayError, MethodNotAllowed, ShuttingDown, UpstreamUnavailable
from gateway.http.server.serving import Stopping

if TYPE_CHECKING:
    from gateway.core import Gateway

__all__ = ["PROBES", "fleet_ready", "probe"]

PROBES = frozenset({"/livez", "/readyz"})
_METHODS = ("GET", "HEAD")


def fleet_ready(gw: Gateway) -> None:
    """``/health``'s rule: enough replicas are up (all, or ``health_min_replicas``), at
    least one; else ``UpstreamUnavailable`` naming the ones down."""
    down = [r.index for r in gw.pool.replicas if not r.up]
    up = len(gw.pool) - len(down)
    if up >= gw.rotation.min_healthy() and up > 0:
        return
    raise UpstreamUnavailable(
        f"{up}/{len(gw.pool)} replicas healthy; down: {down}", headers={"Retry-After": "2"}
    )


def probe(gw: Gateway, stopping: Stopping, method: str, path: str) -> Response:
    """The answer to ``method path``, ``path`` one of ``PROBES``."""
    try:
        if method not in _METHODS:
            raise MethodNotAllowed(f"Method {method} not allowed on {path}.",
                                   headers={"Allow": ", ".join(_METHODS)})  # fmt: skip
        if path == "/readyz":
            if stopping.stopping:
                raise ShuttingDown("The gateway is shutting down: in-flight requests "
                                   "drain, new ones are refused.")  # fmt: skip
            fleet_ready(gw)
    except GatewayError as exc:
        return error_response(exc)
    return Response(status_code=200)
