"""Weighted fair share of the replicas' rollout slots across runs: the pure core.

Why: a replica runs at most ``--max-num-seqs`` sequences at once and queues the rest first
come, first served. When one run floods the replicas it shares with others, every
co-tenant's rollout queues behind that backlog, and a GRPO step waits for its slowest
rollout. So in multi-run mode the gateway counts each replica's rollouts against a
capacity (``replica_capacity``: set it to the replicas' ``--max-num-seqs``) and holds the
excess itself, where it can choose the order.

Two rules, both per replica, among the runs *active* there (a rollout in flight there,
one waiting that may go there, or one that ended there less than ``idle_s`` ago: a GRPO
run between two steps is still active where its last group ran, and only there):

- **Guaranteed share.** Run X's share of replica r is ``capacity * w_X / sum(w)`` over the
  runs active on r. X may always use its share. It may borrow beyond it only slots that
  the unused shares of the other active runs, those not waiting for it, do not need:
  ``used[r] + reserved < capacity``. So a run under its share finds its slots free when
  its next GRPO group arrives, instead of waiting for another run's rollouts to end (no
  replica can preempt them), and an idle run's share is lent out in full once it has been
  idle for ``idle_s``. (A run that waits for the replica needs no reserve there: it
  claims its slots by its tags.)
- **Fair order.** What cannot start waits in its run's FIFO queue. Each waiting rollout
  gets a start tag (start-time fair queueing, unit cost per rollout): ``max(V, F_X)``,
  and the run's finish tag ``F_X`` advances by ``1 / w_X``; ``V`` is the tag last granted.
  A freed slot goes to the smallest tag among the queue heads it is permitted for, so
  saturating runs get slots in proportion to their weights and a run that only now starts
  waiting is served before another run's long backlog.

- **Affinity.** A rollout may name the replica its routing prefers (``prefer``: where its
  prompt's prefix is cached, or will be, for a GRPO group's first rollout). A slot freed
  on replica r goes, within the run the fair order picked, to the oldest of its first
  ``LOOKAHEAD`` waiting rollouts that prefers r; only when none does may the run's oldest
  take it instead. So a flooding run's groups keep to their prefix's replica instead of
  being sprayed over whichever frees a slot first, and no slot stays free while a rollout
  that may take it waits. Granting out of order within a run keeps the run's tags: the
  grant consumes the run's smallest tag.

A ticket is charged to a replica from the moment it is admitted, so two grants can never
take the same slot; the routing decision then picks the replica it sends to (prefix
affinity) among those with room for it (``room``: where it is charged, and where its run
may take a slot), and ``place`` moves the charge there. So no replica is sent more than
its capacity: what exceeds it would wait in the replica's own first-come queue, behind
whoever came first. The shell bounds the wait: at the bound
a ticket is charged beyond capacity (``overflow``) and sent anyway, since a rollout held
forever would stall its run's step; the overflow is counted and alerted on.

Pure: no I/O, no clock but the ``now`` each call is given.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["LOOKAHEAD", "FairShare", "Ticket"]

LOOKAHEAD = 64
"""How deep into a run's queue a freed slot looks for a rollout that prefers its replica:
eight GRPO groups of eight. It bounds the work of one grant."""


@dataclass(eq=False, slots=True)
class Ticket:
    """One rollout's claim on a slot. ``replica`` is where it is charged (-1 while it waits)."""

    run: str
    candidates: tuple[int, ...]
    owner: _Run = field(repr=False)
    prefer: int | None = None
    """The replica its routing prefers (None: no preference)."""
    passed: int = 0
    """Times a later ticket of its run was granted first while it headed the queue."""
    tag: float = 0.0
    replica: int = -1
    overflow: bool = False

    @property
    def waiting(self) -> bool:
        return self.replica < 0


@dataclass(slots=True)
class _Run:
    weight: float = 1.0
    used: Counter[int] = field(default_factory=Counter)
    until: dict[int, float] = field(default_factory=dict)
    """Per replica, until when it counts as active there with nothing in flight: its last
    rollout there ended ``idle_s`` before."""
    finish: float = 0.0
    """Its finish tag (start-time fair queueing)."""
    queue: deque[Ticket] = field(default_factory=deque)
    charged: int = 0
    gone: bool = False
    """A reload removed the run (``forget``): its tickets still out free nothing."""


class FairShare:
    """The slot books of every replica and every run; see the module docstring."""

    def __init__(self, capacity: int, idle_s: float) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.idle_s = idle_s
        self._used: Counter[int] = Counter()
        self._runs: dict[str, _Run] = {}
        self._vtime = 0.0

    # -- what the shell calls

    def request(
        self, run: str, weight: float, candidates: Sequence[int], now: float,
        prefer: int | None = None,
    ) -> tuple[Ticket, list[Ticket]]:  # fmt: skip
        """A rollout of ``run`` that may go to ``candidates`` (``prefer``: the one its
        routing prefers): charged at once when a slot permits it (``ticket.waiting``
        False), on ``prefer`` if it may, else queued behind the run's earlier ones. Also
        returns the waiting tickets granted meanwhile: a changed weight moves the shares
        (rare: a reload)."""
        state = self._run(run)
        moved = state.weight != weight
        state.weight = weight
        ticket = Ticket(run, tuple(candidates), state, prefer if prefer in candidates else None)
        if not state.queue:
            replica = self._permitted(state, ticket.candidates, now, ticket.prefer)
            if replica is not None:
                self._charge(ticket, state, replica)
                return ticket, self.grant(now) if moved else []
        ticket.tag = max(self._vtime, state.finish)
        state.finish = ticket.tag + 1.0 / weight
        state.queue.append(ticket)
        return ticket, self.grant(now)  # a run that waits claims by tags, not by reserve

    def prefer(self, ticket: Ticket, replica: int | None) -> None:
        """The replica a ticket that has to wait prefers (the shell reads it only then: it
        costs a prompt hash, which a rollout charged at once does not need)."""
        ticket.prefer = replica if replica in ticket.candidates else None

    def room(self, ticket: Ticket, candidates: Sequence[int], now: float) -> list[int]:
        """Those of ``candidates`` the ticket's rollout may be sent to: where it is charged,
        and where its run may take a slot now (the routing decision chooses among these,
        so no replica is sent more than its capacity). An overflow may go anywhere."""
        state = ticket.owner
        if ticket.overflow or state.gone:
            return list(candidates)
        return [r for r in candidates if r == ticket.replica or self._open(state, r, now)]

    def place(self, ticket: Ticket, replica: int, now: float) -> list[Ticket]:
        """The routing decision sent the ticket's rollout to ``replica``: charge it there;
        returns the waiting tickets the slot it left now serves."""
        state = ticket.owner
        if ticket.replica == replica or ticket.waiting or state.gone:
            return []
        self._uncharge(ticket, state)
        self._charge(ticket, state, replica)
        return self.grant(now)

    def release(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The ticket's rollout ended (or left while waiting): free what it held; returns the
        waiting tickets that now have a slot, in the order they were granted."""
        state = ticket.owner
        if state.gone:
            return []
        if ticket.waiting:
            if ticket in state.queue:
                state.queue.remove(ticket)
            return self.grant(now)
        state.until[ticket.replica] = now + self.idle_s
        self._uncharge(ticket, state)
        return self.grant(now)

    def overflow(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The ticket waited as long as the shell allows: charge it beyond capacity, on its
        least used candidate, and let it go. Returns the tickets granted once it left the
        head of its queue (the next one may fit elsewhere)."""
        state = ticket.owner
        if not ticket.waiting or state.gone:
            return []
        state.queue.remove(ticket)
        ticket.overflow = True
        self._charge(ticket, state, min(ticket.candidates, key=lambda r: (self._used[r], r)))
        return self.grant(now)

    def grant(self, now: float) -> list[Ticket]:
        """Give free slots to waiting tickets: a run under its share first, then the
        smallest tag, then the run holding least per weight, among those permitted; within
        the run, a ticket that prefers the slot's replica (``_pick``)."""
        granted: list[Ticket] = []
        while True:
            best: tuple[tuple[bool, float, float], int, _Run, int] | None = None
            for state in self._runs.values():
                if not state.queue:
                    continue
                picked = self._pick(state, now)
                if picked is None:
                    continue
                position, replica = picked
                over = state.used[replica] >= self._share_of(state, replica, now)
                key = (over, state.queue[0].tag, state.charged / state.weight)
                if best is None or key < best[0]:
                    best = (key, position, state, replica)
            if best is None:
                return granted
            _, position, state, replica = best
            ticket = self._dequeue(state, position)
            self._vtime = max(self._vtime, ticket.tag)
            self._charge(ticket, state, replica)
            granted.append(ticket)

    def forget(self, run: str, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """A reload removed the run: drop its books. Returns its waiting tickets (the shell
        lets them go: nothing waits on a run that no longer exists), and the other runs'
        tickets that the slots it held now serve."""
        state = self._runs.pop(run, None)
        if state is None:
            return [], []
        state.gone = True
        for replica, n in state.used.items():
            self._used[replica] -= n
        return list(state.queue), self.grant(now)

    # -- what status and metrics read

    def waiting(self, run: str) -> int:
        state = self._runs.get(run)
        return 0 if state is None else len(state.queue)

    def charged(self, run: str) -> int:
        state = self._runs.get(run)
        return 0 if state is None else state.charged

    def used(self, replica: int) -> int:
        return self._used[replica]

    # -- the rules

    def _pick(self, state: _Run, now: float) -> tuple[int, int] | None:
        """Which of the run's waiting tickets gets a slot now, and where: (its position in
        the queue, the replica). The oldest of the first ``LOOKAHEAD`` whose preferred
        replica may take it; else the head, on the least used replica it may take. A head
        passed over ``LOOKAHEAD`` times goes first, wherever it may: the reordering is
        bounded, so no rollout waits on its preferred replica for ever."""
        queue = state.queue
        head = queue[0]
        if head.passed >= LOOKAHEAD:
            replica = self._permitted(state, head.candidates, now, head.prefer)
            return None if replica is None else (0, replica)
        free: dict[int, bool] = {}
        for position in range(min(len(queue), LOOKAHEAD)):
            prefer = queue[position].prefer
            if prefer is None:
                continue
            ok = free.get(prefer)
            if ok is None:
                ok = free[prefer] = self._open(state, prefer, now)
            if ok:
                return position, prefer
        replica = self._permitted(state, head.candidates, now)
        return None if replica is None else (0, replica)

    @staticmethod
    def _dequeue(state: _Run, position: int) -> Ticket:
        """Take the ticket at ``position`` out of the run's queue. The grant consumes the
        run's smallest tag (the head's): the tickets before it move one tag on."""
        queue = state.queue
        ticket = queue[position]
        tags = [queue[i].tag for i in range(position + 1)]
        del queue[position]
        for i in range(position):
            queue[i].tag = tags[i + 1]
        ticket.tag = tags[0]
        if position:
            queue[0].passed += 1
        return ticket

    def _permitted(
        self, state: _Run, candidates: Iterable[int], now: float, prefer: int | None = None
    ) -> int | None:
        """``prefer`` if ``state``'s run may take a slot there, else the least used of
        ``candidates`` where it may, or None."""
        if prefer is not None and self._open(state, prefer, now):
            return prefer
        best: int | None = None
        for replica in candidates:
            used = self._used[replica]
            if used >= self.capacity:
                continue
            if best is not None and used >= self._used[best]:
                continue
            if self._may_take(state, replica, used, now):
                best = replica
        return best

    def _open(self, state: _Run, replica: int, now: float) -> bool:
        """``replica`` has a free slot and ``state``'s run may take it."""
        used = self._used[replica]
        return used < self.capacity and self._may_take(state, replica, used, now)

    def _share_of(self, state: _Run, replica: int, now: float) -> float:
        """``state``'s guaranteed slots on ``replica``, counting it as active there."""
        return self.capacity * state.weight / self._weights(replica, now, also=state)

    def _may_take(self, state: _Run, replica: int, used: int, now: float) -> bool:
        total = self._weights(replica, now, also=state)
        if state.used[replica] < self.capacity * state.weight / total:
            return True  # within its guaranteed share
        reserved = 0.0  # the unused shares of the other active runs that do not wait for this
        for other in self._runs.values():  # replica: one that does claims it by its tags
            if other is state or not self._active(other, replica, now):
                continue
            if other.queue and replica in other.queue[0].candidates:
                continue
            reserved += max(0.0, self.capacity * other.weight / total - other.used[replica])
        return used + reserved < self.capacity

    def _weights(self, replica: int, now: float, also: _Run | None = None) -> float:
        total = 0.0
        for state in self._runs.values():
            if state is also or self._active(state, replica, now):
                total += state.weight
        return total

    def _active(self, state: _Run, replica: int, now: float) -> bool:
        """In flight there, waiting for it, or there less than ``idle_s`` ago."""
        if state.used[replica]:
            return True
        if state.queue and replica in state.queue[0].candidates:
            return True
        return now < state.until.get(replica, -1.0)

    def _run(self, run: str) -> _Run:
        state = self._runs.get(run)
        if state is None:
            state = self._runs[run] = _Run()
        return state

    def _charge(self, ticket: Ticket, state: _Run, replica: int) -> None:
        ticket.replica = replica
        self._used[replica] += 1
        state.used[replica] += 1
        state.charged += 1

    def _uncharge(self, ticket: Ticket, state: _Run) -> None:
        replica = ticket.replica
        self._used[replica] -= 1
        state.used[replica] -= 1
        state.charged -= 1
        ticket.replica = -1
