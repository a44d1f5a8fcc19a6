"""Which replicas are in rotation, as the requests see it: the breakers, the ejections a
request or a probe causes, and what leaving rotation undoes.

Three causes take a replica out (each counted in ``gateway_replica_ejections_total``):
``outlier`` (its answers opened its breaker, ``gateway.fleet.outliers``), ``passive`` (a
refused connection, or a control call it did not answer) and ``probe`` (the health part,
``gateway.fleet.health``). Leaving rotation forgets its prefix cache, closes its breaker's
books and aborts what still waits on it (``gateway.fleet.aborts``), so that the request
is retried elsewhere.

One clock serves the breakers and the retry budget (``clock``: tests move it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from gateway.errors import UpstreamUnavailable
from gateway.fleet.aborts import ReplicaTasks
from gateway.fleet.outliers import OutlierDetector, OutlierEvent
from gateway.fleet.replicas import ReplicaPool, Transition
from gateway.metrics import Metrics
from gateway.roles import Reporter
from gateway.routing.policy import Router

__all__ = ["Rotation"]

log = logging.getLogger("gateway")


class Rotation:
    def __init__(
        self,
        pool: ReplicaPool,
        router: Router,
        metrics: Metrics,
        outliers: OutlierDetector,
        tasks: ReplicaTasks,
        reporter: Reporter,
        health_min_replicas: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.outliers = outliers
        self.tasks = tasks
        """Requests waiting on each replica: aborted when it leaves rotation."""
        self.clock = clock
        """``now`` for the pure cores that take it (breakers, retry budget)."""
        self.cache_resets: Counter[int] = Counter()
        """Replica -> prefix caches forgotten (a worker's snapshot carries it)."""
        self._router = router
        self._metrics = metrics
        self._reporter = reporter
        self._min_replicas = health_min_replicas

    # --- how many must be up --------------------------------------------------------

    def min_healthy(self) -> int:
        """Replicas that must be up for ``/health`` to answer 200."""
        wanted = self._min_replicas
        return len(self.pool) if wanted is None else min(wanted, len(self.pool))

    def quorum(self) -> int:
        """Replicas that must apply a control call (``gateway.fleet.quorum``): the degraded
        mode's ``health_min_replicas`` when set, else one -- a lost replica is left out."""
        wanted = self._min_replicas or 1
        return max(1, min(wanted, len(self.pool)))

    # --- who may take a request -------------------------------------------------------

    def healthy_or_503(self) -> list[int]:
        healthy = self.pool.healthy_indices()
        if not healthy:
            raise UpstreamUnavailable("No healthy replica.", headers={"Retry-After": "2"})
        return healthy

    def routable_or_503(self) -> list[int]:
        """Healthy replicas whose outlier breaker lets a routed request through."""
        routable = self.outliers.routable(self.healthy_or_503(), self.clock())
        if not routable:
            raise UpstreamUnavailable(
                "Every healthy replica is ejected for errors.", headers={"Retry-After": "1"}
            )
        return routable

    # --- what the requests and probes saw ---------------------------------------------

    def record_status(self, index: int, status: int) -> None:
        """Feed one routed answer to outlier detection."""
        event = self.outliers.record(index, status, self.clock(), len(self.pool))
        if event is OutlierEvent.EJECTED:
            self._metrics.ejections.labels(str(index), "outlier").inc()
            reopen_at = self.outliers.breaker(index).reopen_at
            log.warning("replica %d (%s) ejected for %.1f s: HTTP %d errors in a row",
                        index, self.pool[index].display, reopen_at - self.clock(), status,
                        extra={"event": "replica_ejected", "kind": "outlier",
                               "status": status, "replica": index,
                               "replica_url": self.pool[index].display})  # fmt: skip
        elif event is OutlierEvent.RESTORED:
            log.info("replica %d (%s) answered its trial request; breaker closed",
                     index, self.pool[index].display,
                     extra={"event": "breaker_closed", "replica": index,
                            "replica_url": self.pool[index].display})  # fmt: skip

    def on_connect_failure(self, index: int, kind: str) -> None:
        """A request or a control call could not reach ``index``: an upstream error."""
        self._metrics.upstream_errors.labels(str(index), kind).inc()
        self.unreachable(index, kind)

    def unreachable(self, index: int, kind: str) -> None:
        """``index`` refused a connection: passive ejection. A health probe's failure
        comes here directly: it counts in ``gateway_health_probes_total``, not as an
        upstream error, so a replica that is down pages once (RolloutGatewayReplicaDown),
        not a second time as RolloutGatewayUpstreamErrors."""
        if self.pool.record_connect_failure(index) is Transition.EJECTED:
            self._metrics.ejections.labels(str(index), "passive").inc()
            log.warning("replica %d (%s) ejected: %s", index, self.pool[index].display, kind,
                        extra={"event": "replica_ejected", "kind": kind, "replica": index,
                               "replica_url": self.pool[index].display})  # fmt: skip
            self.out_of_rotation(index)
            self._reporter.report({"op": "connect_failure", "replica": index, "kind": kind})

    def lost(self, index: int, kind: str) -> None:
        """A control call got no answer from ``index``: eject it at once, if it is in."""
        if index in self.pool.indices() and self.pool[index].up:
            self.on_connect_failure(index, kind)

    def out_of_rotation(self, index: int) -> None:
        """The replica is out: forget its cache, abort what still waits on it."""
        self.forget_cache(index)
        self.outliers.forget(index)
        aborted = self.tasks.abort(index)
        if aborted:
            log.warning("replica %d: aborted %d requests in flight (retried elsewhere when "
                        "no byte had arrived)", index, aborted)  # fmt: skip

    def forget_cache(self, index: int) -> None:
        """The replica's prefix cache is gone (restart, reset): stop steering by it."""
        self._router.forget_replica(index)
        self.cache_resets[index] += 1

    def removed(self, index: int) -> None:
        """The replica left the fleet (discovery): nothing of it is kept."""
        self.forget_cache(index)
        self.outliers.forget(index)
