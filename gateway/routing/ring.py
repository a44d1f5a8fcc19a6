"""Consistent-hash ring with virtual nodes and a bounded-load lookup.

Algorithm (Karger et al. 1997; bounded loads: Mirrokni, Thorup, Zadimoghaddam, SODA 2018)
    * Each member (a replica index into the stable pool list) owns ``virtual_nodes`` points
      ``xxh3_64("<member>:<v>", seed=ring_seed)``; points are sorted once, when the ring is
      built (off the hot path: the ring is immutable, and a membership change builds a new
      one). A point depends only on the member id, so removing or adding a member moves only
      the keys whose clockwise successor point belongs to that member: ~1/N of them.
    * ``preferred(key)``: the owner of the first point clockwise of ``key`` among *eligible*
      members (the caller's candidate set). Ineligible members (ejected, unhealthy, lacking
      the adapter) are skipped, which is exactly the "member left" move, without a rebuild.
    * ``lookup(key, loads, bound)`` walks clockwise from the key, visiting distinct eligible
      members, and returns the first one that satisfies :func:`load_ok`. If ``max_probes``
      distinct members are all over the bound it returns the least-loaded eligible member
      (which is always under the bound when the bound is MTZ's ``ceil((1+eps)(L+1)/n)``,
      because the minimum load is at most ``floor(L/n)``), and if *every* eligible member is
      over it keeps the preferred one (MTZ: never refuse).

Invariants: the ring is immutable after construction; lookups never mutate it; for a fixed
(key, members, loads, bound) the result is deterministic across processes and hosts.

Complexity: build O(N V log(N V)); ``preferred`` O(log(N V)) plus skipped points;
``lookup`` O(log(N V) + probes * V/N-ish points), worst case O(max_probes + n).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping

from xxhash import xxh3_64_intdigest

__all__ = ["HashRing", "RingChoice", "load_ok"]


def load_ok(load: int, bound: int) -> bool:
    """The bounded-load predicate: one more request keeps ``load`` within ``bound``."""
    return load + 1 <= bound


class RingChoice:
    """Result of a bounded lookup: the member, and whether load moved it off its home."""

    __slots__ = ("member", "moved")

    def __init__(self, member: int, moved: bool) -> None:
        self.member = member
        self.moved = moved


class HashRing:
    """Immutable ring over member ids (replica indices)."""

    __slots__ = ("_owners", "_points", "members", "virtual_nodes")

    def __init__(self, members: Iterable[int], virtual_nodes: int, seed: int = 0) -> None:
        self.members = frozenset(members)
        self.virtual_nodes = virtual_nodes
        pts = sorted(
            (xxh3_64_intdigest(f"{m}:{v}".encode(), seed), m)
            for m in self.members
            for v in range(virtual_nodes)
        )
        self._points = [p for p, _ in pts]
        self._owners = [m for _, m in pts]

    def __len__(self) -> int:
        return len(self._points)

    def walk(self, key: int, eligible: Mapping[int, int] | None = None) -> Iterator[int]:
        """Distinct members clockwise of ``key`` (only those in ``eligible`` if given)."""
        owners = self._owners
        total = len(owners)
        if total == 0:
            return
        n_members = len(self.members)
        seen: set[int] = set()
        i = bisect_right(self._points, key)
        for step in range(total):
            m = owners[(i + step) % total]
            if m in seen:
                continue
            seen.add(m)
            if eligible is None or m in eligible:
                yield m
            if len(seen) >= n_members:
                return

    def preferred(self, key: int, eligible: Mapping[int, int] | None = None) -> int | None:
        """The key's home among ``eligible`` members (``None`` if none is on the ring)."""
        return next(self.walk(key, eligible), None)

    def lookup(
        self, key: int, loads: Mapping[int, int], bound: int, max_probes: int
    ) -> RingChoice | None:
        """Bounded-load choice among ``loads`` (member -> in-flight); None if none on ring."""
        owners = self._owners
        if owners:
            # Fast path (almost every lookup): the first point clockwise belongs to an
            # eligible member under the bound. No generator, no set.
            m = owners[bisect_right(self._points, key) % len(owners)]
            load = loads.get(m)
            if load is not None and load + 1 <= bound:
                return RingChoice(m, False)
        first: int | None = None
        for probes, m in enumerate(self.walk(key, loads)):
            if first is None:
                first = m
            if load_ok(loads[m], bound):
                return RingChoice(m, m != first)
            if probes + 1 >= max_probes:
                break
        if first is None:
            return None
        on_ring = [m for m in loads if m in self.members]
        best = min(on_ring, key=lambda m: (loads[m], m))
        if load_ok(loads[best], bound):
            return RingChoice(best, best != first)
        return RingChoice(first, False)  # everyone is over: keep the home (MTZ)
