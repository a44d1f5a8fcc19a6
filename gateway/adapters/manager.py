"""The facade ``gateway/api`` and ``app.py`` call: parse, check, decide (core), execute (fanout).

Call sites (see docs/adapters.md, "Wiring"):

* ``POST /v1/load_lora_adapter``    -> ``await manager.load(body)``   (raises GatewayError)
* ``POST /v1/unload_lora_adapter``  -> ``await manager.unload(body)`` (200 at once)
* routed requests                   -> ``manager.candidates(model)``, then
  ``manager.request_started(model, i)`` right after choosing ``i`` (no ``await`` in
  between) and ``manager.request_finished(model, i)`` in ``finally``
* ``/v1/models``                    -> ``manager.live_adapters()``
* ``/gateway/status``, metrics      -> ``manager.status()`` / ``manager.snapshot()``
* lifespan startup                  -> ``await manager.rebuild()``
* every health round                -> ``await manager.sync_replicas(pool.healthy_indices())``
  (or ``replica_down(i)`` / ``await reconcile(i)`` on transitions)
* discovery membership changes      -> ``add_replica(i)`` / ``remove_replica(i)``
* background                        -> ``await manager.run_ticks()`` as a task
* shutdown                          -> ``await manager.aclose()``

Loads are serialized per adapter name (a second load of the same name waits for the first
to settle, and for a retiring copy of it to be gone); different names run concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from gateway.adapters import fanout
from gateway.adapters.checks import (
    check_capacity,
    check_path,
    load_error,
    parse_models,
    replica_list,
    require_str,
)
from gateway.adapters.state import (
    LOST,
    Action,
    AdapterPolicy,
    AdapterRegistry,
    AdapterState,
    ListedAdapter,
    ReplicaState,
    Result,
    Settlement,
    Snapshot,
    UnloadOnReplica,
)
from gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    UpstreamUnavailable,
)
from gateway.http.upstream import ReplicaConnectError
from gateway.roles import ALONE, Peers

__all__ = ["AdapterManager", "AdapterReply"]

log = logging.getLogger("gateway.adapters")

TEXT = "text/plain; charset=utf-8"
_SETTLED = frozenset({AdapterState.GONE, AdapterState.LIVE})


class AdapterReply(NamedTuple):
    """A successful answer, byte-compatible with vLLM's (errors are raised instead)."""

    status: int
    media_type: str
    content: bytes


# ------------------------------------------------------------------------ facade


class AdapterManager:
    def __init__(
        self,
        upstream: fanout.ReplicaCaller,
        replicas: Iterable[int],
        *,
        policy: AdapterPolicy,
        call_timeout_s: float = 120.0,
        adapter_roots: Sequence[Path] = (),
        owns: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_settled: Callable[[Settlement], None] | None = None,
        on_action: Callable[[Action, Result], None] | None = None,
        lost: Callable[[int, str], None] | None = None,
        quorum: Callable[[], int] = lambda: 1,
        peers: Peers = ALONE,
    ) -> None:
        self.policy = policy
        self._indices = sorted(set(replicas))
        # Salts name load generations: a fresh epoch per registry, so a restarted gateway
        # never sends a salt under which a replica cached blocks before (``core.salt``).
        self.core = AdapterRegistry(policy, self._indices, epoch=os.urandom(4).hex())
        self._upstream = upstream
        self._timeout = call_timeout_s
        self._roots = tuple(adapter_roots)
        self._owns = owns
        """Which listed adapter names are this manager's (multi-run: its run's prefix);
        the others are neither adopted nor unloaded as strays. None: all of them."""
        self._clock = clock
        self._on_settled = on_settled
        self._on_action = on_action
        self._lost = lost
        """Told when a replica gave no answer (the gateway ejects it at once)."""
        self._quorum = quorum
        """Replicas a load must reach (``gateway.fleet.quorum``)."""
        self._peers = peers
        """Before a copy is unloaded, waits until other processes (data-plane workers)
        route nothing more to it and finished what they sent it, up to the grace."""
        self.executor = fanout.Executor(
            self.core,
            self._perform,
            clock=clock,
            sleep=sleep,
            on_result=self._performed,
        )
        self._loading: set[str] = set()
        self._reconciling: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _perform(self, action: Action) -> Result:
        if isinstance(action, UnloadOnReplica):
            await self._peers.drained(action.name, action.replica, self.policy.unload_grace_s)
        return await fanout.perform(self._upstream, action, self._timeout)

    def _performed(self, action: Action, result: Result) -> None:
        if self._on_action is not None:
            self._on_action(action, result)
        if result.outcome in LOST and self._lost is not None:
            self._lost(action.replica, result.outcome.value)

    # ---------------------------------------------------------------- routes

    async def load(self, body: Mapping[str, Any]) -> AdapterReply:
        name = require_str(body, "lora_name")
        path = require_str(body, "lora_path")
        if not name or not path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):
            raise BadRequest("'load_inplace' must be a boolean.", param="load_inplace")
        if self._roots:  # the resolved path is what the replicas are sent from here on
            path = await asyncio.to_thread(check_path, path, self._roots)

        core = self.core
        await self.executor.wait_until(
            lambda: name not in self._loading and core.adapter_state(name) in _SETTLED
        )
        self._loading.add(name)
        try:
            replaced = core.adapter_state(name) is AdapterState.LIVE
            self.executor.submit(core.request_load(name, path, inplace=inplace, now=self._clock()))
            await self.executor.wait_until(lambda: core.peek_settlement(name) is not None)
            settled = core.take_settlement(name)
            assert settled is not None
        finally:
            self._loading.discard(name)
            self.executor.notify()
        if self._on_settled is not None:
            self._on_settled(settled)
        if settled.ok and len(settled.replicas) < self._quorum():
            # All or nothing: too few replicas left to call it loaded; take it back.
            self.executor.submit(core.request_unload(name, self._clock()))
            raise UpstreamUnavailable(
                f"LoRA adapter '{name}' reached only {replica_list(settled.replicas)}, fewer "
                f"than the {self._quorum()} required; unloaded again.",
                headers={"Retry-After": "2"},
            )
        if settled.ok:
            log.info(
                "adapter %s live on %s in %.3fs",
                name,
                replica_list(settled.replicas),
                settled.seconds,
                extra={"event": "adapter_live", "adapter": name},
            )
            message = f"Success: LoRA adapter '{name}' added successfully."
            return AdapterReply(200, TEXT, message.encode())
        error = load_error(settled, path, self.policy.load_deadline_s, replaced)
        log.warning("adapter %s not loaded: %s", name, error.message,
                    extra={"event": "adapter_load_failed", "adapter": name})  # fmt: skip
        raise error

    async def unload(self, body: Mapping[str, Any]) -> AdapterReply:
        name = require_str(body, "lora_name")
        if not name:
            raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
        state = self.core.adapter_state(name)
        if state is AdapterState.LIVE and name not in self._loading:
            self.executor.submit(self.core.request_unload(name, self._clock()))
        elif state is AdapterState.GONE and name not in self._loading:
            if not self.core.known_name(name):
                raise NotFound(f"The lora adapter '{name}' cannot be found.")
        elif state is not AdapterState.RETIRING:  # mid-load: unload once it settles
            self._spawn(self._deferred_unload(name))
        message = f"Success: LoRA adapter '{name}' removed successfully."
        return AdapterReply(200, TEXT, message.encode())

    async def _deferred_unload(self, name: str) -> None:
        await self.executor.wait_until(
            lambda: name not in self._loading and self.core.adapter_state(name) in _SETTLED
        )
        if self.core.adapter_state(name) is AdapterState.LIVE:
            self.executor.submit(self.core.request_unload(name, self._clock()))

    def candidates(self, model: str | None) -> frozenset[int] | None:
        return self.core.candidates(model)

    def is_live(self, name: str) -> bool:
        return self.core.is_live(name)

    def request_started(self, name: str, replica: int) -> bool:
        return self.core.request_started(name, replica)

    def request_finished(self, name: str, replica: int) -> None:
        self.core.request_finished(name, replica)

    def set_max_staleness(self, max_staleness: int | None) -> None:
        """A reload changed the run's window: a narrower one evicts, at once, the live
        versions now outside it (``AdapterRegistry.set_max_staleness``)."""
        self.executor.submit(self.core.set_max_staleness(max_staleness, self._clock()))
        self.policy = self.core.policy

    def in_flight_on(self, replica: int) -> int:
        return self.core.in_flight_on(replica)

    def salt(self, name: str, replica: int) -> str | None:
        return self.core.salt(name, replica)

    def live_names(self) -> list[str]:
        return [a.name for a in self.core.live_adapters()]

    def live_adapters(self) -> list[ListedAdapter]:
        return self.core.live_adapters()

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    def status(self) -> dict[str, Any]:
        """JSON-ready snapshot for ``/gateway/status``."""
        return dataclasses.asdict(self.core.snapshot())

    # ------------------------------------------------------------- lifecycle

    async def _models(self, replica: int) -> tuple[list[ListedAdapter], list[str]] | None:
        try:
            response = await self._upstream.call(
                replica, "GET", "/v1/models", timeout=self._timeout
            )
            if response.status != 200:
                return None
            adapters, bases = parse_models(response.content)
            if self._owns is not None:
                adapters = [a for a in adapters if self._owns(a.name)]
            return adapters, bases
        except (GatewayError, orjson.JSONDecodeError, TypeError, AttributeError) as exc:
            kind = exc.kind if isinstance(exc, ReplicaConnectError) else None
            log.info("replica %d: cannot read /v1/models (%s)", replica, exc,
                     extra={"event": "models_unreadable", "replica": replica,
                            "kind": kind})  # fmt: skip
            return None

    def _synced(self, replica: int) -> bool:
        state = self.core.replica_state(replica)
        return state is not ReplicaState.SYNCING or self.core.replica_settled(replica)

    async def rebuild(self) -> None:
        """Startup: adopt what the replicas hold, reconcile them, warn about capacity."""
        found = await asyncio.gather(*(self._models(r) for r in self._indices))
        listings: dict[int, list[ListedAdapter]] = {}
        for r, models in zip(self._indices, found, strict=True):
            if models is not None:
                listings[r] = models[0]
                self.core.set_base_models(models[1])
        self.executor.submit(self.core.rebuild(listings, self._clock()))
        await self.executor.wait_until(lambda: all(self._synced(r) for r in listings))
        live = self.core.live_adapters()
        log.info(
            "adapter registry rebuilt from %d/%d replicas: %d live adapters",
            len(listings), len(self._indices), len(live),
        )  # fmt: skip
        await self._warn_capacity(list(listings))

    async def _warn_capacity(self, replicas: Sequence[int]) -> None:
        async def info(r: int) -> tuple[int, Any]:
            try:
                resp = await self._upstream.call(
                    r, "GET", "/server_info", query="config_format=json", timeout=self._timeout
                )
                return r, orjson.loads(resp.content) if resp.status == 200 else None
            except (GatewayError, orjson.JSONDecodeError):
                return r, None

        infos = dict(await asyncio.gather(*(info(r) for r in replicas)))
        usable = {r: i for r, i in infos.items() if isinstance(i, Mapping)}
        for warning in check_capacity(usable, self.policy.max_staleness):
            log.warning("adapter capacity: %s", warning)

    async def reconcile(self, replica: int) -> bool:
        """Bring a (re)joining replica in line before it gets adapter traffic.

        Reads its ``/v1/models``, replays the live adapters it lacks, unloads the ones it
        should not hold; True once it is admitted. False: try again next health round.
        """
        core = self.core
        if core.replica_state(replica) is ReplicaState.UP:
            return True
        if replica in self._reconciling:
            await self.executor.wait_until(lambda: replica not in self._reconciling)
            return core.replica_state(replica) is ReplicaState.UP
        self._reconciling.add(replica)
        try:
            # Sends from before it was lost may still land: the listing must come after.
            await self.executor.wait_until(
                lambda: not self.executor.sending_to(replica) and core.replica_settled(replica)
            )
            models = await self._models(replica)
            if models is None or core.replica_state(replica) is ReplicaState.UP:
                return core.replica_state(replica) is ReplicaState.UP
            core.set_base_models(models[1])
            self.executor.submit(core.observe(replica, models[0], self._clock()))
            await self.executor.wait_until(lambda: self._synced(replica))
        finally:
            self._reconciling.discard(replica)
            self.executor.notify()
        admitted = core.replica_state(replica) is ReplicaState.UP
        if admitted:
            log.info("replica %d reconciled: holds every live adapter", replica)
        else:
            log.warning("replica %d not reconciled yet; keeping it out of adapter traffic", replica)
        return admitted

    def replica_down(self, replica: int) -> None:
        if self.core.replica_state(replica) is not ReplicaState.DOWN:
            self.executor.submit(self.core.replica_lost(replica, self._clock()))

    def add_replica(self, replica: int) -> None:
        """A replica joined (discovery): it gets adapter traffic only once reconciled."""
        if replica not in self._indices:
            self._indices = sorted({*self._indices, replica})
        self.core.add_replica(replica)

    def remove_replica(self, replica: int) -> None:
        """A replica left (discovery): in-flight loads stop waiting for it."""
        self._indices = [r for r in self._indices if r != replica]
        self.executor.submit(self.core.remove_replica(replica, self._clock()))

    async def sync_replicas(self, healthy: Collection[int]) -> None:
        """One call per health round: forget unhealthy replicas, reconcile the others."""
        for r in self._indices:
            if r not in healthy:
                self.replica_down(r)
        pending = [
            r
            for r in healthy
            if r in self._indices and self.core.replica_state(r) is not ReplicaState.UP
        ]
        await asyncio.gather(*(self.reconcile(r) for r in pending))

    def tick(self) -> None:
        self.executor.submit(self.core.tick(self._clock()))

    async def audit(self) -> None:
        """Compare every admitted replica's adapters with the registry (``core.audit``)."""
        up = [r for r in self._indices if self.core.replica_state(r) is ReplicaState.UP]
        await asyncio.gather(*(self._audit(r) for r in up))

    async def _audit(self, replica: int) -> None:
        core = self.core
        if replica in self._reconciling or self.executor.sending_to(replica):
            return
        mark = core.audit_mark(replica)
        models = await self._models(replica)
        if models is None:
            return
        drift, actions = core.audit(replica, models[0], mark, self._clock())
        if drift:
            found = "; ".join(f"{kind} {', '.join(names)}" for kind, names in drift.items())
            log.warning("replica %d drifted from the registry (%s): reconciling it", replica, found)
        self.executor.submit(actions)

    async def run_audits(self, interval_s: float, rng: random.Random | None = None) -> None:
        """``audit`` every ``interval_s`` (jittered +-20 %, so that gateways and runs
        sharing a fleet do not all list it at once)."""
        rng = rng or random.Random()
        while True:
            await asyncio.sleep(interval_s * rng.uniform(0.8, 1.2))
            await self.audit()

    async def run_ticks(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.tick()

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.executor.aclose()
