"""The replica pool: membership, health state and in-flight counts, with no I/O.

The pool decides; ``app.py``'s health loop and ``gateway/api`` do the I/O and report back:

* ``record_probe(i, ok)`` after each active ``/health`` probe. ``unhealthy_threshold``
  consecutive failures eject an UP replica; ``healthy_threshold`` consecutive successes
  make a DOWN replica *ready to admit*. Admission is a separate step (``admit``) so the
  caller can reconcile adapters onto the replica before it receives traffic.
* ``record_connect_failure(i)``: passive ejection. A refused or reset connection is
  conclusive, so the replica leaves rotation at once instead of after N probes.
* ``acquire``/``release`` bracket every routed request (``release`` runs in ``finally``).
* ``add(spec, token)`` / ``remove(index)``: membership changes from discovery
  (``gateway/fleet/discovery.py``). A new replica starts DOWN, so it is probed and reconciled
  before it gets traffic.

Replicas are identified by an index; the index, never the URL (which may carry
credentials), is what appears in headers, metrics and error bodies. Indices are stable: the
configured replicas are 0..n-1, a discovered address gets the next unused index, and an
index always names the same address (a removed address that comes back gets its old
index again; another address never does). The ring, the adapter registry and the metric
labels key on it. ``replicas`` lists the current members; ``pool[i]`` still answers for a
removed replica so requests in flight to it can finish and release.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from yarl import URL

from gateway.config import ReplicaSpec, Settings

__all__ = ["Health", "Replica", "ReplicaPool", "Transition"]


class Health(StrEnum):
    UP = "up"
    DOWN = "down"


class Transition(StrEnum):
    """What a health observation changed; the caller logs it and acts on ``READY``."""

    EJECTED = "ejected"
    READY = "ready"


@dataclass(slots=True)
class Replica:
    index: int
    base_url: URL
    """Upstream base URL with any ``user:pass@`` removed (that goes into ``auth_header``)."""
    auth_header: str | None = field(repr=False)
    display: str
    """``scheme://host:port``: safe to log, never shown to clients."""
    health: Health = Health.DOWN
    in_flight: int = 0
    served: int = 0
    ejections: int = 0
    probe_failures: int = 0
    probe_successes: int = 0
    member: bool = True
    """False once discovery removed it (its index stays reserved for its address)."""

    @classmethod
    def from_spec(cls, index: int, spec: ReplicaSpec, token: str | None) -> Replica:
        url = URL(spec.url)
        auth: str | None = None
        if token:
            auth = f"Bearer {token}"
        elif url.user or url.password:
            raw = f"{url.user or ''}:{url.password or ''}".encode()
            auth = "Basic " + base64.b64encode(raw).decode("ascii")
        bare = url.with_user(None)  # drops the password too
        display = f"{bare.scheme}://{bare.host}:{bare.port}"  # yarl: the scheme's default port
        return cls(index=index, base_url=bare, auth_header=auth, display=display)

    @property
    def up(self) -> bool:
        return self.health is Health.UP


class ReplicaPool:
    """All configured replicas and their health; sans-I/O, single event loop."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        unhealthy_threshold: int = 2,
        healthy_threshold: int = 1,
    ) -> None:
        self._all: list[Replica] = list(replicas)  # by index, members or not
        if [r.index for r in self._all] != list(range(len(self._all))):
            raise ValueError("replica indices must be 0..n-1 in order")
        self._index_of: dict[str, int] = {}
        self.replicas: list[Replica] = [r for r in self._all if r.member]
        """Current members, in index order."""
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold

    @classmethod
    def from_settings(cls, settings: Settings) -> ReplicaPool:
        replicas = []
        for i, spec in enumerate(settings.replicas):
            token = settings.token_for(i)
            replicas.append(Replica.from_spec(i, spec, token.get_secret_value() if token else None))
        pool = cls(
            replicas,
            unhealthy_threshold=settings.unhealthy_threshold,
            healthy_threshold=settings.healthy_threshold,
        )
        for i, spec in enumerate(settings.replicas):
            pool.track(i, spec)
        return pool

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self._all[index]

    def indices(self) -> list[int]:
        """Indices of the current members."""
        return [r.index for r in self.replicas]

    # --- membership (discovery) -----------------------------------------------------

    def add(self, spec: ReplicaSpec, token: str | None) -> int:
        """Add (or re-add) the replica at ``spec.url``, DOWN until probed; returns its index."""
        index = self._index_of.get(spec.url)
        fresh = Replica.from_spec(len(self._all) if index is None else index, spec, token)
        if index is None:
            index = fresh.index
            self._all.append(fresh)
            self._index_of[spec.url] = index
        else:
            old = self._all[index]
            if old.member:
                return index
            # Same address, same index: keep counters and in-flight, start DOWN again.
            old.auth_header, old.health, old.member = fresh.auth_header, Health.DOWN, True
            old.probe_failures = old.probe_successes = 0
        self.replicas = [r for r in self._all if r.member]
        return index

    def remove(self, index: int) -> None:
        """Take a replica out of the pool for good (until its address is added again)."""
        replica = self._all[index]
        if not replica.member:
            return
        replica.member = False
        replica.health = Health.DOWN
        self.replicas = [r for r in self._all if r.member]

    def track(self, index: int, spec: ReplicaSpec) -> None:
        """Record that configured replica ``index`` is ``spec`` (so discovery can diff)."""
        self._index_of[spec.url] = index

    def membership(self) -> dict[str, int]:
        """URL -> index of the current members that discovery knows the URL of."""
        return {url: i for url, i in self._index_of.items() if self._all[i].member}

    def loads(self, indices: Iterable[int]) -> dict[int, int]:
        """``index -> in flight`` for ``indices`` (what a routing decision reads)."""
        replicas = self._all
        return {i: replicas[i].in_flight for i in indices}

    def healthy_indices(self) -> list[int]:
        up = Health.UP
        return [r.index for r in self.replicas if r.health is up]

    def all_up(self) -> bool:
        return all(r.up for r in self.replicas)

    # --- in-flight accounting -------------------------------------------------------

    def acquire(self, index: int) -> None:
        replica = self._all[index]
        replica.in_flight += 1
        replica.served += 1

    def release(self, index: int) -> None:
        replica = self._all[index]
        replica.in_flight = max(0, replica.in_flight - 1)

    # --- health -----------------------------------------------------------------------

    def record_probe(self, index: int, ok: bool) -> Transition | None:
        replica = self._all[index]
        if not replica.member:
            return None
        if ok:
            replica.probe_failures = 0
            replica.probe_successes += 1
            if not replica.up and replica.probe_successes >= self.healthy_threshold:
                return Transition.READY
            return None
        replica.probe_successes = 0
        replica.probe_failures += 1
        if replica.up and replica.probe_failures >= self.unhealthy_threshold:
            return self._eject(replica)
        return None

    def record_connect_failure(self, index: int) -> Transition | None:
        """Passive ejection: a refused/reset connection takes the replica out at once."""
        replica = self._all[index]
        replica.probe_successes = 0
        return self._eject(replica) if replica.up else None

    def admit(self, index: int) -> None:
        """Put a READY replica into rotation (after the caller reconciled it)."""
        replica = self._all[index]
        if replica.member:
            replica.health = Health.UP

    def follow(self, healthy: Collection[int]) -> list[int]:
        """Make exactly the members in ``healthy`` UP (a data-plane worker adopting the
        owner's view); returns the ones that went down."""
        down = []
        for replica in self.replicas:
            up = replica.index in healthy
            if replica.up and not up:
                replica.health = Health.DOWN
                down.append(replica.index)
            elif up and not replica.up:
                replica.health = Health.UP
        return down

    def _eject(self, replica: Replica) -> Transition:
        replica.health = Health.DOWN
        replica.ejections += 1
        return Transition.EJECTED
