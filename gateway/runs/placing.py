"""Multi-run mode's fleet chores: placing the runs at start, and sweeping replicas of
adapters that no run homed there owns (so the placement's slot budget holds)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import orjson

from gateway.adapters.checks import parse_models
from gateway.adapters.state import ListedAdapter
from gateway.errors import GatewayError
from gateway.runs.table import owner_of

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.http.upstream import BufferedResponse, Upstream
    from gateway.runs.tenancy import Tenancy


class Members(Protocol):
    """Which replicas there are and which are healthy (``gateway.fleet.replicas.
    ReplicaPool`` is this): the runs sit below the fleet's parts and do not import them."""

    def __len__(self) -> int: ...

    def indices(self) -> list[int]: ...

    def healthy_indices(self) -> list[int]: ...


class RunFleet(Protocol):
    """What placing and sweeping read of the gateway (its fan-out part,
    ``gateway.fleet.fanout.FanOut``, is one): named here so that this module, which the
    gateway calls, does not import it."""

    settings: Settings
    upstream: Upstream
    tenancy: Tenancy

    @property
    def pool(self) -> Members: ...

    async def fan_out(
        self, method: str, path: str, *, body: bytes | None = None, query: str = "",
        headers: list[tuple[str, str]] | None = None, replicas: Sequence[int] | None = None,
    ) -> list[BufferedResponse]: ...  # fmt: skip


__all__ = ["Members", "RunFleet", "place_runs", "sweep", "unload_run"]

log = logging.getLogger("gateway.runs")


async def place_runs(gw: RunFleet) -> None:
    """Multi-run mode, at start: each replica's adapter budget (configured, else the
    weakest replica's ``max_loras``), each run's homes, then every replica swept of
    adapters no run homed there owns."""
    reported = await _weakest_max_loras(gw)
    budget = gw.settings.lora_slots_per_replica
    if budget is None:
        budget = reported if reported is not None else sum(t.run.slots for t in gw.tenancy)
        if reported is None:
            log.warning("no replica reported max_loras; assuming %d adapter slots per "
                        "replica (set lora_slots_per_replica)", budget)  # fmt: skip
    elif reported is not None and budget > reported:
        log.warning("lora_slots_per_replica=%d is more than a replica's max_loras=%d: vLLM "
                    "will evict adapters between uses (restart it with --max-loras %d, or "
                    "lower lora_slots_per_replica)", budget, reported, budget)  # fmt: skip
    moves = gw.tenancy.place(gw.pool.indices(), budget)
    for tenant in gw.tenancy:
        log.info("run %s: home replicas %s (%d adapter slots each)",
                 tenant.name, sorted(tenant.homes), tenant.run.slots,
                 extra={"event": "run_placed", "run": tenant.name})  # fmt: skip
    log.info("placed %d runs on %d replicas of %d adapter slots (%d moves)",
             len(gw.tenancy.tenants), len(gw.pool), budget, len(moves))  # fmt: skip
    await asyncio.gather(*(sweep(gw, r) for r in gw.pool.healthy_indices()))


async def _weakest_max_loras(gw: RunFleet) -> int | None:
    results = await gw.fan_out("GET", "/server_info", query="config_format=json")
    found = []
    for r in results:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            lora = orjson.loads(r.content)["vllm_config"]["lora_config"]
            found.append(int(lora["max_loras"]))
    return min(found) if found else None


async def sweep(gw: RunFleet, replica: int) -> int:
    """Multi-run mode: unload from ``replica`` every adapter no run homed there owns
    (another run's after a placement move, a single-run leftover, a manual load), so
    the placement's slot budget holds. Best effort: the next rejoin sweeps again."""
    listed = await _listed(gw, replica)
    owners = gw.tenancy.owners_of(replica)
    foreign = [a for a in listed if owner_of(a.name) not in owners]
    await asyncio.gather(*(_unload(gw, replica, a) for a in foreign))
    if foreign:
        log.info("replica %d: unloaded %d adapters no run homed there owns",
                 replica, len(foreign))  # fmt: skip
    return len(foreign)


async def unload_run(gw: RunFleet, replica: int, run: str) -> int:
    """Unload from ``replica`` every adapter of ``run`` (a run a reload removed, once it
    drained). Best effort: what is left is swept as no run's at the next rejoin."""
    listed = await _listed(gw, replica)
    own = [a for a in listed if owner_of(a.name) == run]
    await asyncio.gather(*(_unload(gw, replica, a) for a in own))
    return len(own)


async def _listed(gw: RunFleet, replica: int) -> list[ListedAdapter]:
    """The adapters ``replica`` holds by its own ``/v1/models`` (none when it does not
    answer: the callers are best effort)."""
    try:
        result = await gw.upstream.call(
            replica, "GET", "/v1/models", timeout=gw.settings.broadcast_timeout_s
        )
        return parse_models(result.content)[0] if result.status == 200 else []
    except (GatewayError, ValueError):
        return []


async def _unload(gw: RunFleet, replica: int, adapter: ListedAdapter) -> None:
    body = orjson.dumps({"lora_name": adapter.name})
    with contextlib.suppress(GatewayError):
        await gw.upstream.call(replica, "POST", "/v1/unload_lora_adapter", body=body,
                                 timeout=gw.settings.broadcast_timeout_s)  # fmt: skip
