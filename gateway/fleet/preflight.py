"""The first minute tells the truth: what the gateway checks and says once, at start.

TRL 1.16 needs three things of every replica that nothing else checks before it dies:
``/server_info`` (read at train start), ``/pause`` (each weight sync; a 404 is fatal) and
runtime LoRA (``/v1/load_lora_adapter``, plus a ``lora_config`` from ``--enable-lora``).
vLLM registers the first two only with ``VLLM_SERVER_DEV_MODE=1`` and the load route only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; without them the paths do not exist at all.

Each question is asked without side effects: ``GET /server_info`` is a read, and a ``GET``
on a POST-only route answers 405 when the route exists and 404 when it does not (FastAPI's
routing, before any handler runs); nothing is paused, loaded or changed. An answer that
says neither (an auth error, a timeout) is "cannot tell", never a false alarm.

Start-up only: nothing here runs per request.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.http.upstream import Upstream

__all__ = [
    "Capabilities",
    "check_replica",
    "exposure_warning",
    "open_port_refusal",
    "replica_warning",
    "source",
]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one replica offers TRL; ``None``: could not tell (no warning then)."""

    server_info: bool | None
    pause: bool | None
    load_route: bool | None
    lora_config: bool | None  # /server_info's lora_config is set (--enable-lora)


def _route(status: int | None) -> bool | None:
    """A GET on a POST-only route: 405 = it exists, 404 = it does not."""
    return {405: True, 404: False}.get(status) if status is not None else None


async def check_replica(upstream: Upstream, index: int, timeout: float) -> Capabilities:
    """Ask replica ``index`` the three questions, concurrently, with no side effects."""

    async def get(path: str, query: str = "") -> tuple[int | None, bytes]:
        try:
            r = await upstream.call(index, "GET", path, query=query, timeout=timeout)
        except GatewayError:
            return None, b""
        return r.status, r.content

    (info_status, info), (pause, _), (load, _) = await asyncio.gather(
        get("/server_info", "config_format=json"), get("/pause"), get("/v1/load_lora_adapter")
    )
    lora: bool | None = None
    if info_status == 200:
        try:
            config = orjson.loads(info).get("vllm_config")
            lora = isinstance(config.get("lora_config"), dict) if isinstance(config, dict) else None
        except (orjson.JSONDecodeError, AttributeError):
            lora = None
    server_info = {200: True, 404: False}.get(info_status) if info_status is not None else None
    return Capabilities(server_info, _route(pause), _route(load), lora)


def replica_warning(name: str, caps: Capabilities) -> str | None:
    """One line for a replica that lacks what TRL needs, saying what TRL will do; ``None``
    when nothing is known to be missing."""
    problems = []
    if caps.server_info is False:
        problems.append(
            "no /server_info (404: VLLM_SERVER_DEV_MODE=1 is not set): TRL reads the LoRA "
            "limits there at train start and stops if no replica answers"
        )
    if caps.pause is False:
        problems.append(
            "no /pause (404: VLLM_SERVER_DEV_MODE=1 is not set): TRL's first weight sync "
            "pauses every replica, gets a 502 from the gateway and stops"
        )
    if caps.load_route is False:
        problems.append(
            "no runtime LoRA (/v1/load_lora_adapter is 404: "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 is not set): every adapter load fails on it, "
            "so TRL's first sync fails and TRL stops"
        )
    if caps.lora_config is False:
        problems.append(
            "no lora_config in /server_info (started without --enable-lora): adapters cannot "
            "load on it; with no LoRA anywhere TRL falls back to full-weight NCCL sync, which "
            "no HTTP gateway can carry"
        )
    if not problems:
        return None
    return (
        f"replica {name} is not ready for TRL's AsyncGRPOTrainer: " + "; ".join(problems)
        + ". Start it with VLLM_SERVER_DEV_MODE=1, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and "
        "--enable-lora (deploy/trl-recipe.md)"
    )  # fmt: skip


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def open_port_refusal(settings: Settings) -> str | None:
    """Why the gateway must not start, if it would serve a non-loopback address with no
    client key and the operator did not choose that (``--no-auth``): no auth is never what
    a forgotten or unset key silently gives beyond this host (Redis' protected mode)."""
    if _loopback(settings.host) or settings.api_key is not None or settings.runs:
        return None
    if settings.no_auth:
        return None
    return (
        f"--host {settings.host} is not loopback and no client key is set: give "
        "--api-key-file (or GATEWAY_API_KEY_FILE), or choose no auth with --no-auth "
        "(GATEWAY_NO_AUTH=true), or listen on 127.0.0.1"
    )


def exposure_warning(settings: Settings) -> str | None:
    """A warning when anyone who can reach the port may use the fleet unauthenticated
    (``--no-auth``, or a start that skipped ``open_port_refusal``)."""
    if _loopback(settings.host) or settings.api_key is not None or settings.runs:
        return None
    control = "" if settings.admin_key is not None else ", load adapters, pause the fleet"
    return (
        f"listening on {settings.host}, not loopback, with no API key: anyone who can reach "
        f"port {settings.port} can generate{control}. Set --api-key-file (TRL sends it as "
        "http://trl:KEY@host:port) or listen on 127.0.0.1"
    )


def source(settings: Settings) -> str:
    """Where the replicas come from, for the start line."""
    parts = []
    if settings.replicas:
        parts.append(f"static list ({len(settings.replicas)})")
    if settings.discovery_dns:
        via = f" via {settings.discovery_nameserver}" if settings.discovery_nameserver else ""
        parts.append(f"DNS {settings.discovery_dns}{via} every {settings.discovery_interval_s:g}s")
    if settings.replicas_file:
        parts.append(f"file {settings.replicas_file}")
    return " + ".join(parts) or "none"
