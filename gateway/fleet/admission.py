"""Admission control for proxied requests: a global in-flight cap and one per client.

Both bound what the gateway holds (sockets, buffers, tasks) no matter what clients do,
and turn overload into an immediate ``429`` with ``Retry-After`` -- which TRL and the
``openai`` client retry with backoff -- instead of an ever-growing queue of requests that
time out later. Only ROUTED and FORWARDED requests are counted: health checks, metrics
scrapes and admin calls must keep working when the data path is saturated.

A client is whoever holds a credential: the ``Authorization`` value if one was sent (so
one trainer is one client wherever it connects from), else the peer address.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Admission", "Refusal"]


class Refusal(StrEnum):
    """Why a request was refused; also the ``reason`` label of the rejection counter."""

    IN_FLIGHT = "in_flight"
    CLIENT_IN_FLIGHT = "client_in_flight"


class Admission:
    def __init__(self, max_in_flight: int | None, max_per_client: int | None) -> None:
        self.max_in_flight = max_in_flight
        self.max_per_client = max_per_client
        self.in_flight = 0
        self._by_client: dict[bytes, int] = {}

    def enter(self, client: bytes) -> Refusal | None:
        """Admit one request of ``client`` (then ``leave`` exactly once), or say why not."""
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            return Refusal.IN_FLIGHT
        if self.max_per_client is not None:
            held = self._by_client.get(client, 0)
            if held >= self.max_per_client:
                return Refusal.CLIENT_IN_FLIGHT
            self._by_client[client] = held + 1
        self.in_flight += 1
        return None

    def leave(self, client: bytes) -> None:
        self.in_flight -= 1
        if self.max_per_client is not None:
            held = self._by_client.get(client, 0) - 1
            if held > 0:
                self._by_client[client] = held
            else:
                self._by_client.pop(client, None)  # the table holds active clients only

    def clients(self) -> int:
        return len(self._by_client)
