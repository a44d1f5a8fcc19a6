"""The fleet's pause state and the broadcasts that change it (``/pause``, ``/resume``,
``/reset_prefix_cache``), judged by ``gateway.fleet.quorum``.

vLLM's pause is per replica; TRL pauses "the server" around every weight sync. So the
gateway holds the fleet's pause state and keeps every serving replica in it:

* a broadcast is judged by the one rule in ``quorum``; lost replicas are ejected by the
  fan-out and left out, a refusal fails the call, and a failed ``/pause`` is undone on
  the replicas that did pause (all or nothing);
* a replica that rejoins (restarted, or back from a hang) is put in the current state
  *before* it is admitted: paused with the same query if the fleet is paused, resumed
  otherwise. That also undoes a ``/pause`` a hung replica applied after it was left out.

One lock orders the broadcasts and the rejoins, so a replica can never be admitted in
the state the fleet just left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.errors import BroadcastFailed, GatewayError, UpstreamUnavailable
from gateway.fleet.quorum import Tally, Verdict, judge, reply_for
from gateway.http.upstream import BufferedResponse

__all__ = ["PAUSE", "RESET", "RESUME", "FleetControl"]

log = logging.getLogger("gateway.control")

PAUSE, RESUME, RESET = "/pause", "/resume", "/reset_prefix_cache"
_DETAIL_LIMIT = 200


class FanOut(Protocol):
    async def __call__(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = ...,
        query: str = ...,
        headers: list[tuple[str, str]] | None = ...,
        replicas: Sequence[int] | None = ...,
    ) -> list[BufferedResponse]: ...


class FleetControl:
    def __init__(
        self,
        fan_out: FanOut,
        quorum: Callable[[], int],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._fan_out = fan_out
        self._quorum = quorum
        self._wall = wall
        self._lock = asyncio.Lock()
        self.paused: str | None = None
        """The query string of the ``/pause`` in effect (``""`` for none), or None."""
        self.paused_since: float | None = None
        """Unix time the fleet's pause began (a second ``/pause`` keeps it), or None: an
        alert on a pause held too long reads it (``gateway_fleet_paused_since_seconds``)."""

    async def broadcast(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        headers: list[tuple[str, str]] | None = None,
        replicas: Sequence[int] | None = None,
    ) -> tuple[BufferedResponse, Tally]:
        """Apply one control call to every healthy replica (or the healthy ones among
        ``replicas``); raise unless the rule holds."""
        async with self._lock:
            results = await self._fan_out(
                method, path, body=body, query=query, headers=headers, replicas=replicas
            )
            tally = judge({r.replica: reply_for(r.status) for r in results}, self._quorum())
            if tally.lost:
                log.warning("%s: replicas %s lost, left out of the call", path, list(tally.lost))
            if tally.verdict is Verdict.OK:
                if path == PAUSE:
                    if self.paused is None:
                        self.paused_since = self._wall()
                    self.paused = query
                elif path == RESUME:
                    self.paused = self.paused_since = None
                first = next(r for r in results if r.replica == tally.applied[0])
                return first, tally
            undone = ""
            if path == PAUSE and tally.applied:
                await self._fan_out(method, RESUME, replicas=tally.applied)
                undone = f" Resumed again on replicas {list(tally.applied)}."
            raise self._error(path, results, tally, undone)

    def _error(
        self, path: str, results: Sequence[BufferedResponse], tally: Tally, undone: str
    ) -> GatewayError:
        if tally.verdict is Verdict.REFUSED:
            parts = []
            for r in results:
                if r.replica in tally.refused:
                    text = r.content[:_DETAIL_LIMIT].decode("utf-8", "replace").strip()
                    parts.append(f"replica {r.replica}: HTTP {r.status} {text}")
            return BroadcastFailed(f"{path} refused: " + "; ".join(parts) + "." + undone)
        return UpstreamUnavailable(
            f"{path} applied on {len(tally.applied)} replicas, fewer than the "
            f"{self._quorum()} required (lost: {list(tally.lost)}).{undone}",
            headers={"Retry-After": "2"},
        )

    async def rejoin(self, replica: int) -> bool:
        """Put a replica that is about to be admitted in the fleet's pause state.

        True when it may serve. A replica without vLLM's dev-mode endpoints answers 404 to
        ``/resume``; it is running, so any HTTP answer will do unless the fleet is paused.
        """
        async with self._lock:
            paused = self.paused
            path, query = (RESUME, "") if paused is None else (PAUSE, paused)
            [result] = await self._fan_out("POST", path, query=query, replicas=[replica])
            if result.status == 0:
                return False
            if paused is not None and not 200 <= result.status < 300:
                log.warning("replica %d refused %s (HTTP %d); not admitting it while the "
                            "fleet is paused", replica, path, result.status)  # fmt: skip
                return False
            return True
