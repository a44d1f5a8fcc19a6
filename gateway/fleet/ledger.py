"""One request, one ledger: every book a request touches, opened and closed in one place.

The books: the gateway's admission (in flight, per client), the run's cap and usage, the
retry budget, and per attempt the replica's in-flight count, its breaker, its abort
registration (``gateway.fleet.aborts``), the adapter copy's request count, and the
request metrics. A request's life, and the call that keeps each book:

==================  =============================================================
``enter``           admission (429), the key and the run (401), the run's cap (429)
``attempt``         the next replica (``Selection.take``) within the retry budget
                    (503 when none is left or the budget is spent), and its books;
                    a named run's slot is charged to that replica
``failed``          the attempt ended without a response: its books closed, the
                    breaker or the pool told why; True when another may be tried
``answered``        the response's status, for the breaker
``finished``        the upstream answer is over (a stream: when the relay closes):
                    the replica's books closed, the request metrics
``exit``            admission, the run's cap and its slot, once the answer was sent
==================  =============================================================

Why per-attempt calls: a request that fails before any byte is retried on another
replica, and each attempt holds that replica's books, which must be closed before the
next one is opened. Why ``finished`` apart from ``exit``: the replica is free when its
answer is over, before the client has read it; the admission slot is held until then.

No call here awaits: a book is never half-kept across a suspension.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.errors import (
    GatewayError,
    TooManyRequests,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.fleet.admission import Admission, Refusal
from gateway.fleet.retry_budget import RetryBudget
from gateway.fleet.rotation import Rotation
from gateway.fleet.selection import Plan, Selection
from gateway.http.relay import broken_mid_stream
from gateway.http.server.inbound import Inbound
from gateway.http.upstream import ReplicaConnectError
from gateway.metrics import Metrics, RouteKind
from gateway.runs.credentials import Credentials
from gateway.runs.fairness import Slot
from gateway.runs.tenancy import Tenant

__all__ = ["Entry", "Ledger"]

log = logging.getLogger("gateway.requests")


@dataclass(slots=True, eq=False)
class Entry:
    """One request's line in the ledger, from ``Ledger.enter`` to ``Ledger.exit``."""

    ledger: Ledger
    kind: RouteKind
    client: bytes
    """The admission key (the credential, else the peer address)."""
    task: asyncio.Task[Any]
    tenant: Tenant | None = None
    """A rollout's run (single-run mode: the implicit one)."""
    counted: Tenant | None = None
    """The named run whose cap the rollout counts against (None: the implicit run)."""
    slot: Slot | None = None
    """A named run's rollout: its slot on the replicas it shares (``Tenant.slot``)."""
    plan: Plan | None = None
    remaining: list[int] | None = None
    """Candidates not tried yet (None: no attempt yet)."""
    index: int = -1
    """The replica of the current attempt."""
    status: int = 0
    retrying: bool = False
    aborted: bool = False
    """Its run's ``/pause?mode=abort`` (or its removal) cut its stream: not a client that
    left (``gateway_client_disconnects_total`` does not count it)."""
    started: float = 0.0
    """When the first attempt began (``gateway_request_duration_seconds``)."""

    def closed(self, completed: bool) -> None:
        """``RelayResponse``'s ``on_close``: the stream is over."""
        self.ledger.finished(self, completed)

    def ejected(self) -> GatewayError | None:
        """``RelayResponse``'s ``ejected``: why the stream was cut, if the gateway cut it."""
        return self.ledger.ejected(self)


class Ledger:
    def __init__(
        self,
        credentials: Credentials,
        admission: Admission,
        retry_budget: RetryBudget,
        rotation: Rotation,
        selection: Selection,
        metrics: Metrics,
    ) -> None:
        self.admission = admission
        self.retry_budget = retry_budget
        self._credentials = credentials
        self._rotation = rotation
        self._pool = rotation.pool
        self._tasks = rotation.tasks
        self._selection = selection
        self._metrics = metrics

    def enter(self, inbound: Inbound, kind: RouteKind) -> Entry:
        """Count the request against the in-flight limits (429 when over); a rollout also
        against its run's, once its key names the run (401 when it names none). A
        FORWARDED request's key was checked by its handler."""
        client = inbound.header(b"authorization") or inbound.peer
        refusal = self.admission.enter(client)
        if refusal is not None:
            self._metrics.rejected.labels(refusal.value).inc()
            who = "this client" if refusal is Refusal.CLIENT_IN_FLIGHT else "the gateway"
            raise TooManyRequests(f"Too many requests in flight for {who}; retry shortly.",
                                  headers={"Retry-After": "1"})  # fmt: skip
        entry = Entry(self, kind, client, inbound.task)
        if kind is RouteKind.ROUTED:
            try:
                entry.tenant = self._credentials.tenant(inbound.header(b"authorization"))
                entry.counted = entry.tenant.admit_rollout(inbound.task)
            except BaseException:
                self.admission.leave(client)
                raise
        return entry

    def attempt(self, entry: Entry, plan: Plan) -> int:
        """The replica of the next attempt, its books opened; 503 when no candidate is
        left, or when this is a retry and the retry budget is spent."""
        remaining = entry.remaining
        if remaining is None:  # the first attempt (a named run's: where it has a slot)
            slot = entry.slot
            remaining = list(plan.candidates) if slot is None else slot.room(plan.candidates)
            entry.plan, entry.remaining = plan, remaining
            entry.started = time.perf_counter()
            self.retry_budget.record_request(self._rotation.clock())
        while True:
            if not remaining:
                raise UpstreamUnavailable("No healthy replica could take the request.")
            if entry.retrying and not self.retry_budget.try_retry(self._rotation.clock()):
                self._metrics.retry_budget_exhausted.inc()
                raise UpstreamUnavailable(
                    "A replica failed before answering and the retry budget is spent.",
                    headers={"Retry-After": "1"},
                )
            index = self._selection.take(plan, remaining)
            if index is not None:
                break
        if entry.retrying:
            self._metrics.retries.inc()
        self._pool.acquire(index)
        self._metrics.record_routed(index)
        self._tasks.enter(index, entry.task)
        entry.index = index
        if entry.slot is not None:
            entry.slot.place(index)
        return index

    def failed(self, entry: Entry, exc: BaseException) -> bool:
        """The attempt ended with ``exc`` and no response: close its books; True when the
        request may go to another replica (nothing of it reached the client)."""
        index = entry.index
        ejected = isinstance(exc, asyncio.CancelledError) and self._tasks.take(entry.task)
        self._tasks.leave(index, entry.task)
        self._rotation.outliers.abandoned(index)
        self._release(entry)
        if isinstance(exc, ReplicaConnectError):
            self._log_failure(entry, index, exc.kind, "before any answer; retryable")
            self._rotation.on_connect_failure(index, exc.kind)
        elif ejected:
            self._metrics.aborted.inc()
        else:
            if isinstance(exc, UpstreamError):  # timeout, or broken mid-body
                kind = "timeout" if isinstance(exc, UpstreamTimeout) else "broken"
                self._log_failure(entry, index, kind, "after it was sent; not retried")
                self._rotation.record_status(index, exc.status)
            return False
        entry.retrying = True
        return True

    def _log_failure(self, entry: Entry, index: int, kind: str, when: str) -> None:
        """One line per failed attempt, tagged with the request's id (the log's context):
        the line an on-call finds from the ``request_id`` of a client's error."""
        url = self._pool[index].display
        run = entry.counted.name if entry.counted is not None else None
        log.warning("replica %d (%s) failed a request %s: %s", index, url, when, kind,
                    extra={"event": "upstream_failed", "kind": kind, "replica": index,
                           "replica_url": url, "run": run})  # fmt: skip

    def answered(self, entry: Entry, status: int) -> None:
        entry.status = status
        self._rotation.record_status(entry.index, status)

    def finished(self, entry: Entry, completed: bool) -> None:
        """The upstream answer is over (``completed``: all of it reached the client)."""
        self._tasks.leave(entry.index, entry.task)
        self._release(entry)
        if not completed and not entry.aborted:
            self._metrics.client_disconnects.inc()
        self._metrics.record_request(entry.kind, entry.status, time.perf_counter() - entry.started)

    def ejected(self, entry: Entry) -> GatewayError | None:
        """The error a cut stream ends with: the replica left rotation mid-stream, or the
        run's ``/pause?mode=abort`` cancelled it (``Tenant.aborts``); None: neither."""
        if self._tasks.take(entry.task):
            self._metrics.aborted.inc()
            return broken_mid_stream()
        counted = entry.counted
        why = None if counted is None else counted.aborts.take(entry.task)
        entry.aborted = why is not None
        return why

    def exit(self, entry: Entry, status: int | None = None) -> None:
        """The answer was sent (``status``), or the request ended without one (None)."""
        self.admission.leave(entry.client)
        counted = entry.counted
        if counted is not None:
            if status is not None:
                counted.usage.answered(status)
            counted.leave(entry.task)
            if entry.slot is not None:
                entry.slot.release()
                entry.slot = None

    def _release(self, entry: Entry) -> None:
        self._pool.release(entry.index)
        plan = entry.plan
        assert plan is not None
        if plan.routes is not None:  # an adapter's copy may drain (hot path: no call else)
            plan.finished(entry.index)
