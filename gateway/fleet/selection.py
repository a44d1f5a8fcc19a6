"""The whole routing decision for one request, in one place: which replicas may serve it
and which one does.

The candidate set (``rollout``, ``forwarded``) is, in this order:

1. the healthy replicas whose outlier breaker lets a request through (503 when none);
2. of those, the run's homes (multi-run mode; 507 while it has none);
3. of those, the ones holding the adapter the body names (``AdapterRoutes.candidates``),
   under the run's name on the replicas; a retired version's rollout goes to its live
   successor (docs/adapters.md, "Retired versions"); none left: 503 when the model is
   live (or the run has no home up), else vLLM's own 404.

The choice (``take``) asks the router (with the fleet-wide loads, ``LoadsFeed``, in a
data-plane worker), or, for FORWARDED paths, takes the least loaded. Two vetoes follow
it: the breaker may refuse (its half-open trial slot is taken), and so may the adapter
copy (it is being retired); the request then chooses again among the others. The
failover loop around it (``gateway.fleet.ledger``) decides whether there is an "again".

Pure: no I/O, no clock but the rotation's; the caller parsed the body.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.adapters.cache_salt import check_client_salt, salted
from gateway.adapters.naming import retired_successor
from gateway.errors import UpstreamUnavailable
from gateway.fleet.rotation import Rotation
from gateway.metrics import Metrics
from gateway.roles import LoadsFeed
from gateway.routing.policy import CandidateLoads, Router, RouteRequest
from gateway.runs.scope import scoped_model, unknown_model
from gateway.runs.tenancy import AdapterRoutes, Tenant

__all__ = ["Plan", "Selection"]

_NONE: frozenset[int] = frozenset()


@dataclass(slots=True)
class Plan:
    """One request's candidates, how to choose among them, and what each one is sent.

    ``route`` is None for a FORWARDED request (least loaded wins); ``routes`` is the
    run's adapter books when the body names an adapter (``model``), else None; ``scope``
    is the named run whose names a FORWARDED answer must show (a rollout's is its
    ledger entry's run)."""

    candidates: list[int]
    body: bytes
    route: RouteRequest | None = None
    routes: AdapterRoutes | None = None
    model: str = ""
    payload: dict[str, Any] | None = None
    scope: Tenant | None = None

    def body_for(self, index: int) -> bytes:
        """The body as replica ``index`` must see it: its adapter copy's ``cache_salt``."""
        if self.routes is None:
            return self.body
        assert self.payload is not None
        return salted(self.body, self.payload, self.routes.salt(self.model, index))

    def finished(self, index: int) -> None:
        """The request on ``index`` ended: its adapter copy may drain."""
        if self.routes is not None:
            self.routes.request_finished(self.model, index)


class Selection:
    def __init__(
        self, rotation: Rotation, router: Router, metrics: Metrics, feed: LoadsFeed
    ) -> None:
        self._rotation = rotation
        self._pool = rotation.pool
        self._router = router
        self._metrics = metrics
        self._feed = feed

    def routable_or_503(self) -> list[int]:
        """Healthy replicas whose outlier breaker lets a routed request through."""
        rotation = self._rotation
        routable = rotation.outliers.routable(rotation.healthy_or_503(), rotation.clock())
        if not routable:
            raise UpstreamUnavailable(
                "Every healthy replica is ejected for errors.", headers={"Retry-After": "1"}
            )
        return routable

    def forwarded(
        self, body: bytes, tenant: Tenant, parse: Callable[[bytes], dict[str, Any]]
    ) -> Plan:
        """FORWARDED: the least loaded of the routable replicas the request may go to.
        Single-run mode: any, the body as it came (never parsed: it may not be JSON).
        Multi-run mode: the run's homes, and of those the ones holding the adapter the
        body (``parse``d) names, sent under the run's name there (``scoped_model``)."""
        healthy = self.routable_or_503()
        homes = tenant.fan_in_replicas(healthy)
        if homes is None:  # the implicit run
            return Plan(healthy, body)
        if not homes:
            raise UpstreamUnavailable("No healthy replica is home to this run right now.",
                                      headers={"Retry-After": "1"})  # fmt: skip
        if not body:
            return Plan(homes, body, scope=tenant)
        payload = parse(body)
        asked = payload.get("model")
        model, allowed, body = scoped_model(tenant, payload, body)
        if allowed is None:
            return Plan(homes, body, scope=tenant)
        candidates = [i for i in homes if i in allowed]
        if not candidates:
            if isinstance(model, str) and tenant.routes.is_live(model):
                raise UpstreamUnavailable(f"No healthy replica holds `{asked}` right now.",
                                          headers={"Retry-After": "1"})  # fmt: skip
            raise unknown_model(asked)
        return Plan(candidates, body, scope=tenant)

    def rollout(
        self, path: str, payload: dict[str, Any], body: bytes, session: str | None, tenant: Tenant
    ) -> Plan:
        """ROUTED (completions and chat completions): the replicas that may serve
        ``payload`` and what to send them (in multi-run mode the ``model`` named as the
        run's adapter is on the replicas). Synchronous: no coroutine."""
        asked = payload.get("model")
        healthy = tenant.rollout_replicas(self.routable_or_503())
        routes = tenant.routes
        model, allowed, body = scoped_model(tenant, payload, body)
        candidates = healthy if allowed is None else [i for i in healthy if i in allowed]
        if not candidates and isinstance(model, str) and allowed is not None:
            pattern = tenant.manager.policy.name_pattern
            successor = retired_successor(pattern, model, routes.live_names())
            if successor is not None:  # docs/adapters.md, "Retired versions"
                self._metrics.retired_rollouts.inc()
                model = payload["model"] = successor
                body = orjson.dumps(payload)
                allowed = routes.candidates(model) or frozenset()
                candidates = [i for i in healthy if i in allowed]
        if not candidates:
            if isinstance(model, str) and routes.is_live(model):
                raise UpstreamUnavailable(f"No healthy replica holds `{asked}` right now.",
                                          headers={"Retry-After": "1"})  # fmt: skip
            if allowed is None:
                raise UpstreamUnavailable("No healthy replica is home to this run right now.",
                                          headers={"Retry-After": "1"})  # fmt: skip
            raise unknown_model(asked)
        lacking = _NONE if allowed is None else frozenset(healthy) - frozenset(candidates)
        route = RouteRequest(path, model, payload, session, lacking)
        if allowed is None:
            return Plan(candidates, body, route)
        assert isinstance(model, str)
        check_client_salt(payload)
        return Plan(candidates, body, route, routes, model, payload)

    def preferred(self, plan: Plan) -> int | None:
        """The candidate the policy would choose for ``plan`` were every candidate idle
        (``Router.prefers``): the replica a named run's rollout waits for when the
        replicas are saturated. Reads the learned index, changes nothing."""
        if plan.route is None:
            return None
        return self._router.prefers(plan.route, plan.candidates)

    def take(self, plan: Plan, remaining: list[int]) -> int | None:
        """Choose among ``remaining`` (non-empty) and strike the choice off; the replica
        that takes the request, or None when the breaker or the adapter copy refused it
        (the caller chooses again among the others)."""
        index = self._choose(plan.route, remaining)
        remaining.remove(index)
        outliers = self._rotation.outliers
        if not outliers.dispatched(index):
            return None
        if plan.routes is not None and not plan.routes.request_started(plan.model, index):
            outliers.abandoned(index)
            return None
        return index

    def _choose(self, route: RouteRequest | None, remaining: Sequence[int]) -> int:
        pool = self._pool
        if route is None:
            return min(remaining, key=lambda i: (pool[i].in_flight, i))
        router = self._router
        loads = CandidateLoads(pool.loads(remaining))
        self._feed.refresh(router)
        t0 = time.perf_counter()
        decision = router.choose(route, loads)
        self._metrics.record_decision(decision, time.perf_counter() - t0)
        router.observe(decision)
        return decision.replica
