"""FAN-IN: one answer made from every replica's (``/health``, ``/server_info``,
``/v1/models``), describing the fleet as TRL must see it: one server, DP=1."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.auth import require_tenant
from gateway.api.probes import fleet_ready
from gateway.api.requests import request_id
from gateway.api.responses import gateway_of, json_response, relay_buffered
from gateway.errors import UpstreamError, UpstreamUnavailable
from gateway.runs.usage import load

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.runs.tenancy import Tenant

log = logging.getLogger("gateway.api")


async def health(request: Request) -> Response:
    """FAN-IN: 200 (empty, like vLLM) only when enough replicas are up."""
    fleet_ready(gateway_of(request))  # ``/readyz`` adds the drain to this rule
    return Response(status_code=200)


def _home_replicas(gw: Gateway, tenant: Tenant) -> list[int] | None:
    """Where a run's fan-in asks (``Tenant.fan_in_replicas``)."""
    return tenant.fan_in_replicas(gw.pool.healthy_indices())


def _weakest_lora_config(configs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = dict(configs[0])
    for key in ("max_lora_rank", "max_loras", "max_cpu_loras"):
        values = [c[key] for c in configs if isinstance(c.get(key), int)]
        if values:
            merged[key] = min(values)
    return merged


async def server_info(request: Request) -> Response:
    """``/server_info`` of one replica, made to describe the fleet as TRL must see it:
    ``data_parallel_size == 1`` and the *weakest* replica's LoRA limits."""
    gw = gateway_of(request)
    tenant = require_tenant(request)
    query = request.scope.get("query_string", b"").decode("latin-1")
    targets = _home_replicas(gw, tenant)
    answers = await gw.fleet.fan_out("GET", "/server_info", query=query, replicas=targets)
    results = [r for r in answers if r.status == 200]
    if not results:
        raise UpstreamUnavailable("No healthy replica answered /server_info.")
    # Any valid JSON, not only what orjson reads (a lone surrogate's escape, 1e400),
    # written back by the parser that read it (``gateway.runs.usage.load``).
    loaded = [doc for r in results if (doc := load(r.content)) is not None]
    if len(loaded) != len(results):
        return relay_buffered(results[0], request_id())
    infos = [doc for doc, _ in loaded]
    write = loaded[0][1]
    info = infos[0]
    vllm_config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(vllm_config, dict):
        loras = [
            c
            for i in infos
            if isinstance(c := (i.get("vllm_config") or {}).get("lora_config"), dict)
        ]
        if loras:
            weakest = _weakest_lora_config(loras)
            budget = gw.tenancy.max_loras(tenant)
            if budget is not None:  # the run's own share of the replicas' slots
                weakest["max_loras"] = min(budget, weakest.get("max_loras", budget))
            if any(c != loras[0] for c in loras) or len(loras) != len(infos):
                log.warning("replicas disagree on lora_config; reporting the weakest: %s", weakest)
            vllm_config["lora_config"] = weakest
        parallel = vllm_config.setdefault("parallel_config", {})
        if isinstance(parallel, dict):
            parallel["data_parallel_size"] = 1
    return Response(write(info), media_type="application/json")


async def models(request: Request) -> Response:
    """``/v1/models``: the base model(s) of one replica, plus the adapters that are live on
    every replica (the adapter manager's view, not any single replica's)."""
    gw = gateway_of(request)
    tenant = require_tenant(request)
    run = tenant.run
    targets = _home_replicas(gw, tenant)
    results = [r for r in await gw.fleet.fan_out("GET", "/v1/models", replicas=targets)
               if r.status == 200]  # fmt: skip
    if not results:
        raise UpstreamUnavailable("No healthy replica answered /v1/models.")
    found = load(results[0].content)
    if found is None or not isinstance(found[0], dict):
        raise UpstreamError("A replica's /v1/models answer is not a JSON object.")
    listing = found[0]
    entries = [m for m in listing.get("data", []) if isinstance(m, dict)]
    bases = [m for m in entries if not m.get("parent")]
    known = {m["id"]: m for m in entries if m.get("parent")}
    parent = bases[0]["id"] if bases else None
    live = []
    for adapter in tenant.manager.live_adapters():
        entry = dict(
            known.get(adapter.name)
            or {"id": adapter.name, "object": "model", "owned_by": "vllm", "parent": parent}
        )
        entry["id"] = run.client_name(adapter.name)
        entry["root"] = adapter.path
        live.append(entry)  # fmt: skip
    listing["data"] = [*bases, *live]
    return json_response(listing)
