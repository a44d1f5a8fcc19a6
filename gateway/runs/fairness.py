"""The async shell of the fair share (``gateway.runs.fairshare``): a rollout of a named
run waits here, on a future, until the core grants it a slot or the wait reaches its bound.

Multi-run mode only: single-run mode's rollouts never reach it (the ledger's ``counted``
is None), so a lone run pays nothing for it.

Under ``serve --workers N`` each process keeps its own books over ``1/N`` of every
replica's capacity (its rollouts are spread evenly over the processes by the kernel), so
no cross-process call sits on a rollout's path.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gateway.runs.fairshare import FairShare, Ticket

if TYPE_CHECKING:
    from gateway.runs.usage import RunUsage

__all__ = ["FairGate", "Slot"]


class Slot:
    """A rollout's slot, from its admission until its answer was sent (``release``); each
    attempt charges the replica it went to (``place``)."""

    __slots__ = ("_gate", "_ticket")

    def __init__(self, gate: FairGate, ticket: Ticket) -> None:
        self._gate = gate
        self._ticket = ticket

    def room(self, candidates: list[int]) -> list[int]:
        """Those of ``candidates`` with a slot for this rollout (its routing chooses among
        them)."""
        return self._gate.share.room(self._ticket, candidates, self._gate.now())

    def place(self, index: int) -> None:
        self._gate.place(self._ticket, index)

    def release(self) -> None:
        self._gate.release(self._ticket)


class FairGate:
    def __init__(
        self, share: FairShare, wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.share = share
        self.wait_s = wait_s
        self._clock = clock
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self.overflows: Counter[str] = Counter()
        """Rollouts sent at the wait's bound, by run (``gateway_run_fair_overflows_total``)."""

    async def admit(
        self, run: str, weight: float, candidates: Sequence[int], usage: RunUsage,
        prefer: Callable[[], int | None] | None = None,
    ) -> Slot:  # fmt: skip
        """A slot on ``candidates`` for a rollout of ``run``: at once while one is free to
        it, else once the core grants one (``prefer``, read only then: the replica its
        routing prefers, which it waits for), or at ``wait_s`` (sent anyway, counted). The
        wait counts as the run's held time."""
        started = self._clock()
        ticket, others = self.share.request(run, weight, candidates, started)
        self._wake(others)
        if not ticket.waiting:
            return Slot(self, ticket)
        if prefer is not None:
            self.share.prefer(ticket, prefer())
        granted = self._waiters[ticket] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(granted, self.wait_s)
        except TimeoutError:
            if ticket.waiting:
                self._wake(self.share.overflow(ticket, self._clock()))
                self.overflows[run] += 1
        except BaseException:  # the client left, or the run was aborted: give it back
            self.release(ticket)
            raise
        finally:
            self._waiters.pop(ticket, None)
            usage.held_s += self._clock() - started
        return Slot(self, ticket)

    def now(self) -> float:
        return self._clock()

    def place(self, ticket: Ticket, index: int) -> None:
        self._wake(self.share.place(ticket, index, self._clock()))

    def release(self, ticket: Ticket) -> None:
        """The rollout ended (or left while waiting): wake the tickets its slot now serves."""
        self._wake(self.share.release(ticket, self._clock()))

    def forget(self, run: str) -> None:
        """A removed run is gone: drop its books, and let anything of it still waiting go."""
        dropped, granted = self.share.forget(run, self._clock())
        self._wake([*dropped, *granted])
        self.overflows.pop(run, None)

    def slots(self, run: str) -> int:
        return self.share.charged(run)

    def waiting(self, run: str) -> int:
        return self.share.waiting(run)

    def overflowed(self, run: str) -> int:
        return self.overflows[run]

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            waiter = self._waiters.pop(ticket, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
