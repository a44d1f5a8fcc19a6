"""What a process's role in the gateway changes, as parts handed to it when it is built.

``serve --workers N`` runs one owner of the control plane and N data-plane workers
(``gateway.workers``); a plain ``serve`` is one process that is both. They run the same
``Gateway``; what differs is what it is given:

=============  ====================  ==========================  =========================
part           one process           the owner                   a data-plane worker
=============  ====================  ==========================  =========================
``Reporter``   ``ALONE`` (nobody)    ``ALONE``                   its link to the owner
``LoadsFeed``  ``ALONE`` (own loads) ``ALONE``                   the fleet-load table
``Peers``      ``ALONE`` (none)      the ``Hub`` of its workers  ``ALONE``
=============  ====================  ==========================  =========================

A mode is an object, not a branch: no caller asks "am I a worker?"; it calls its part, and
the one-process part does nothing (``Alone``). Nothing here does I/O of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.routing.policy import Router

__all__ = ["ALONE", "Alone", "LoadsFeed", "Peers", "Reporter"]


class Reporter(Protocol):
    """Tells the owner what only this process saw (a replica that refused a connection),
    so that the owner ejects it for every process."""

    def report(self, message: dict[str, Any]) -> None: ...


class LoadsFeed(Protocol):
    """Hands the router the fleet-wide loads (every process's requests) before a decision,
    so that a group's samples, spread over workers, are placed by the same table."""

    def refresh(self, router: Router) -> None: ...


class Peers(Protocol):
    """The other processes of one gateway, as the owner sees them: what its ``/metrics``
    and ``/gateway/status`` add of theirs, and the waits for their requests to end."""

    async def merged_metrics(self, own: bytes) -> bytes: ...
    async def add_status(self, own: dict[str, Any]) -> None: ...

    async def drained(self, name: str, replica: int, timeout: float) -> None:
        """Returns once no other process routes to (or still waits on) adapter copy
        ``name`` on ``replica``, or ``timeout`` passed: the copy may be unloaded."""
        ...

    async def run_drained(self, run: str, timeout: float) -> None:
        """Returns once no other process runs a rollout of ``run`` (a scoped
        ``/pause?mode=wait|abort``), or ``timeout`` passed."""
        ...


class Alone:
    """Every part of a process with no other: nobody to tell, its own loads, no peers."""

    __slots__ = ()

    def report(self, message: dict[str, Any]) -> None:
        return None

    def refresh(self, router: Router) -> None:
        return None

    async def merged_metrics(self, own: bytes) -> bytes:
        return own

    async def add_status(self, own: dict[str, Any]) -> None:
        return None

    async def drained(self, name: str, replica: int, timeout: float) -> None:
        return None

    async def run_drained(self, run: str, timeout: float) -> None:
        return None


ALONE = Alone()
