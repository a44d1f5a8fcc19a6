"""The same call on several replicas at once: control calls, fan-in reads, run placing.

A replica that gives no HTTP answer is *lost* (``gateway.fleet.quorum``): it is ejected
at once and every run homed there stops counting on it (``Tenancy.lose``); its result is
a status-0 answer instead of an exception, so that the caller judges the whole set. A
call waiting on a replica that the health checker ejects ends at once
(``call_abortable``): a hung replica must not hold a control call for the whole
``broadcast_timeout_s``.

``FanOut`` is also what placing and sweeping runs read of the fleet
(``gateway.runs.placing.RunFleet``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from gateway.config import Settings
from gateway.errors import GatewayError, UpstreamTimeout
from gateway.fleet.replicas import ReplicaPool
from gateway.fleet.rotation import Rotation
from gateway.http.upstream import BufferedResponse, ReplicaConnectError, Upstream
from gateway.runs.tenancy import Tenancy

__all__ = ["FanOut"]


class FanOut:
    def __init__(
        self, settings: Settings, upstream: Upstream, rotation: Rotation, tenancy: Tenancy
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.tenancy = tenancy
        self.pool: ReplicaPool = rotation.pool
        self._rotation = rotation

    async def fan_out(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        headers: list[tuple[str, str]] | None = None,
        replicas: Sequence[int] | None = None,
    ) -> list[BufferedResponse]:
        """The same call on several replicas (default: every healthy one), concurrently.
        A replica that gives no HTTP answer is lost and yields a status-0 result instead
        of raising."""
        targets = list(replicas) if replicas is not None else self._rotation.healthy_or_503()
        timeout = self.settings.broadcast_timeout_s

        async def one(index: int) -> BufferedResponse:
            try:
                return await self.call_abortable(
                    index, method, path, body=body, query=query, headers=headers, timeout=timeout
                )
            except ReplicaConnectError as exc:
                kind = exc.kind
            except UpstreamTimeout:
                kind = "timeout"
            except GatewayError:
                kind = "reset"
            self.tenancy.lose(index, kind)
            return BufferedResponse(0, [], f"unreachable ({kind})".encode(), index)

        return list(await asyncio.gather(*(one(i) for i in targets)))

    async def call_abortable(
        self, index: int, method: str, path: str, **kwargs: Any
    ) -> BufferedResponse:
        """``upstream.call`` that ends with ``ReplicaConnectError(kind="ejected")`` as soon
        as the replica leaves rotation."""
        tasks = self._rotation.tasks
        task = asyncio.ensure_future(self.upstream.call(index, method, path, **kwargs))
        tasks.enter(index, task)
        try:
            return await task
        except asyncio.CancelledError:
            if tasks.take(task):
                raise ReplicaConnectError(index, "ejected") from None
            task.cancel()
            raise
        finally:
            tasks.leave(index, task)
