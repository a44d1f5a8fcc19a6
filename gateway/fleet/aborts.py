"""Which tasks are talking to which replica, so that ejecting a replica can abort them.

A replica that hangs (accepts connections, never answers) holds every request sent to it
until the read timeout -- which must be long, because a real generation can take minutes.
The health checker notices the hang within a few probe timeouts; when it ejects the
replica, ``abort(index)`` cancels the tasks still waiting on it. ``dispatch`` then retries
the ones that had no response byte yet on another replica, and the relay ends streams
already under way with an SSE error event. A client disconnect cancels tasks too;
``take(task)`` tells the two apart. (``gateway.runs.aborts`` is the same idea for a run's
``/pause?mode=abort``, whose cancelled rollouts are owed an answer.)
"""

from __future__ import annotations

import asyncio

__all__ = ["ReplicaTasks"]


class ReplicaTasks:
    def __init__(self) -> None:
        self._by_replica: dict[int, set[asyncio.Task[object]]] = {}
        self._aborted: set[asyncio.Task[object]] = set()

    def enter(self, index: int, task: asyncio.Task[object]) -> None:
        tasks = self._by_replica.get(index)
        if tasks is None:
            tasks = self._by_replica[index] = set()
        tasks.add(task)

    def leave(self, index: int, task: asyncio.Task[object]) -> None:
        tasks = self._by_replica.get(index)
        if tasks is not None:
            tasks.discard(task)
        self._aborted.discard(task)

    def abort(self, index: int) -> int:
        """Cancel every task on replica ``index``; returns how many."""
        tasks = self._by_replica.pop(index, set())
        for task in tasks:
            self._aborted.add(task)
            task.cancel()
        return len(tasks)

    def take(self, task: asyncio.Task[object]) -> bool:
        """True (once) if ``task`` was cancelled by ``abort``; its cancellation is undone."""
        if task not in self._aborted:
            return False
        self._aborted.discard(task)
        task.uncancel()
        return True

    def count(self, index: int) -> int:
        return len(self._by_replica.get(index, ()))
