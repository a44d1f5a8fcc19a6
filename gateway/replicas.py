"""The replica pool: membership, health state and in-flight counts, with no I/O.

The pool decides; ``app.py``'s health loop and ``routes.py`` do the I/O and report back:

* ``record_probe(i, ok)`` after each active ``/health`` probe. ``unhealthy_threshold``
  consecutive failures eject an UP replica; ``healthy_threshold`` consecutive successes
  make a DOWN replica *ready to admit*. Admission is a separate step (``admit``) so the
  caller can reconcile adapters onto the replica before it receives traffic.
* ``record_connect_failure(i)``: passive ejection. A refused or reset connection is
  conclusive, so the replica leaves rotation at once instead of after N probes.
* ``acquire``/``release`` bracket every routed request (``release`` runs in ``finally``).

Replicas are identified by their index in the configured list; the index, never the URL
(which may carry credentials), is what appears in headers, metrics and error bodies.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

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
    base_url: httpx.URL
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

    @classmethod
    def from_spec(cls, index: int, spec: ReplicaSpec, token: str | None) -> Replica:
        url = httpx.URL(spec.url)
        auth: str | None = None
        if token:
            auth = f"Bearer {token}"
        elif url.username or url.password:
            raw = f"{url.username}:{url.password}".encode()
            auth = "Basic " + base64.b64encode(raw).decode("ascii")
        bare = url.copy_with(username=None, password=None)
        display = (
            f"{bare.scheme}://{bare.host}:{bare.port or (443 if bare.scheme == 'https' else 80)}"
        )
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
        self.replicas: list[Replica] = list(replicas)
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold

    @classmethod
    def from_settings(cls, settings: Settings) -> ReplicaPool:
        replicas = []
        for i, spec in enumerate(settings.replicas):
            token = settings.token_for(i)
            replicas.append(Replica.from_spec(i, spec, token.get_secret_value() if token else None))
        return cls(
            replicas,
            unhealthy_threshold=settings.unhealthy_threshold,
            healthy_threshold=settings.healthy_threshold,
        )

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def healthy_indices(self) -> list[int]:
        return [r.index for r in self.replicas if r.up]

    def all_up(self) -> bool:
        return all(r.up for r in self.replicas)

    # --- in-flight accounting -------------------------------------------------------

    def acquire(self, index: int) -> None:
        replica = self.replicas[index]
        replica.in_flight += 1
        replica.served += 1

    def release(self, index: int) -> None:
        replica = self.replicas[index]
        replica.in_flight = max(0, replica.in_flight - 1)

    # --- health -----------------------------------------------------------------------

    def record_probe(self, index: int, ok: bool) -> Transition | None:
        replica = self.replicas[index]
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
        replica = self.replicas[index]
        replica.probe_successes = 0
        return self._eject(replica) if replica.up else None

    def admit(self, index: int) -> None:
        """Put a READY replica into rotation (after the caller reconciled it)."""
        self.replicas[index].health = Health.UP

    def _eject(self, replica: Replica) -> Transition:
        replica.health = Health.DOWN
        replica.ejections += 1
        return Transition.EJECTED
