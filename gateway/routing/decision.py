"""What a routing policy reads and returns: one request, the candidates' loads, a decision.

Plain value types, shared by every policy (``policy.py``) and by the cross-worker load
table (``fleet.py``); ``gateway.routing.policy`` re-exports them, so callers import them
from there as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, overload

from gateway.routing.prefix import PromptKey

__all__ = ["CandidateLoads", "Decision", "Reason", "ReplicaView", "RouteRequest"]


class Reason(StrEnum):
    """Why a replica was chosen; the label set of ``gateway_routing_decisions_total``."""

    AFFINITY = "affinity"
    RING = "ring"
    SPILL = "spill"
    NO_KEY = "no_key"
    ADAPTER_CONSTRAINT = "adapter_constraint"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a policy may know about one candidate replica."""

    index: int
    in_flight: int


@dataclass(slots=True)
class RouteRequest:
    """Everything a policy may look at for one request (parsed once by the caller).

    Treat it as immutable: not ``frozen``, because a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) costs ~1 us per routed request.

    ``session_key`` is the ``X-Session-ID`` header if present (the OpenAI ``user`` field is
    read from the payload). ``lacking_adapter`` names healthy replicas that were filtered out
    only because they do not hold the adapter; it lets the decision say
    ``adapter_constraint`` when the key's home is one of them.
    """

    path: str
    model: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
    session_key: str | None = None
    lacking_adapter: frozenset[int] = frozenset()


class Decision:
    """The chosen replica, why, and the features ``observe`` needs (no re-hashing).

    A plain ``__slots__`` class (treat it as immutable): built once per routed request, and
    a frozen dataclass's ``__init__`` costs ~1 us of the decision budget. Equality ignores
    ``key``, as before.
    """

    __slots__ = ("key", "moved_by_load", "reason", "replica")

    def __init__(
        self,
        replica: int,
        reason: Reason,
        key: PromptKey | None = None,
        moved_by_load: bool = False,
    ) -> None:
        self.replica = replica
        self.reason = reason
        self.key = key
        #: A new key (``ring``) that the bounded-load walk placed past its ring home. Not a
        #: spill: no replica held its prefix yet, so nothing is lost; exported separately.
        self.moved_by_load = moved_by_load

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return (self.replica, self.reason, self.moved_by_load) == (
            other.replica,
            other.reason,
            other.moved_by_load,
        )

    def __hash__(self) -> int:
        return hash((self.replica, self.reason, self.moved_by_load))

    def __repr__(self) -> str:
        return (
            f"Decision(replica={self.replica}, reason={self.reason!r}, "
            f"moved_by_load={self.moved_by_load})"
        )


class CandidateLoads(Sequence[ReplicaView]):
    """Candidates as a read-only ``replica index -> in-flight`` mapping plus its total.

    A plain ``Sequence[ReplicaView]`` costs O(n) to read (about 20 us at n = 256 on the
    benchmark machine); the pool can instead keep one live dict per candidate set and its
    running total, and wrap them here without copying (e.g. in a ``MappingProxyType``).
    ``PrefixAffinityRouter`` then reads only the loads of the replicas it probes.
    """

    __slots__ = ("loads", "total")

    def __init__(self, loads: Mapping[int, int], total: int | None = None) -> None:
        if not loads:
            raise ValueError("candidates must not be empty")
        self.loads = loads
        self.total = sum(loads.values()) if total is None else total

    def __len__(self) -> int:
        return len(self.loads)

    def __iter__(self) -> Iterator[ReplicaView]:
        for index, in_flight in self.loads.items():
            yield ReplicaView(index, in_flight)

    @overload
    def __getitem__(self, i: int) -> ReplicaView: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ReplicaView]: ...
    def __getitem__(self, i: int | slice) -> ReplicaView | Sequence[ReplicaView]:
        if isinstance(i, slice):
            return list(self)[i]
        index = list(self.loads)[i]  # C-speed copy of the keys, no per-replica objects
        return ReplicaView(index, self.loads[index])
