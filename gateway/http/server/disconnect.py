"""Noticing that the client left while the gateway waits on a replica.

``DisconnectGuard`` is a ``with`` block around the wait on the upstream: while armed it
cancels the serving task when the client leaves, so the replica's connection is closed
and vLLM aborts the generation instead of computing tokens nobody reads.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from starlette.types import Receive

__all__ = ["ClientDisconnected", "DisconnectGuard"]

_ARM_AFTER_S = 0.05


class ClientDisconnected(Exception):
    """The client went away while the gateway was waiting on the upstream."""


class DisconnectGuard:
    """``with guard: await work``: if the client disconnects meanwhile, the serving task
    is cancelled and the block raises ``ClientDisconnected`` instead.

    A plain context manager, not a wrapping coroutine: no frame in the await chain of
    every rollout. On a connection served by ``gateway.http.server.h1server`` the server resolves
    ``lost`` when the connection goes: watching costs one callback. Otherwise a watcher
    task reads ASGI ``receive``; it is armed lazily, after ``_ARM_AFTER_S``: most rollouts
    finish sooner and then cost one timer instead of one task (a disconnect is still
    noticed within that delay, which is what cancelling a generation needs). Reusable:
    one block after another (a retry is a new block)."""

    __slots__ = ("_armed", "_fired", "_lost", "_receive", "_task", "_timer", "_watcher")

    def __init__(
        self,
        task: asyncio.Task[Any],
        *,
        lost: asyncio.Future[None] | None = None,
        receive: Receive | None = None,
    ) -> None:
        assert lost is not None or receive is not None
        self._task = task
        self._lost = lost
        self._receive = receive
        self._armed = self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Future[None] | None = None

    def __enter__(self) -> None:
        self._armed, self._fired = True, False
        if self._lost is not None:
            self._lost.add_done_callback(self._on_gone)
        else:
            self._timer = asyncio.get_running_loop().call_later(_ARM_AFTER_S, self._watch)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._armed = False
        if self._lost is not None:
            self._lost.remove_done_callback(self._on_gone)
        else:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher.remove_done_callback(self._on_gone)
                watcher.cancel()
        if kind is asyncio.CancelledError and self._fired:
            self._task.uncancel()
            raise ClientDisconnected from None

    def _watch(self) -> None:
        assert self._receive is not None
        self._timer = None
        self._watcher = asyncio.ensure_future(_wait_disconnect(self._receive))
        self._watcher.add_done_callback(self._on_gone)

    def _on_gone(self, signal: asyncio.Future[None]) -> None:
        # A callback already scheduled when the block ended does nothing.
        if self._armed and not signal.cancelled() and signal.exception() is None:
            self._fired = True
            self._task.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
