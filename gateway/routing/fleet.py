"""The fleet-wide load snapshot N data-plane workers route new keys by.

With ``serve --workers N`` each worker has its own ``PrefixAffinityRouter``: its learned
index (served prompts, templates) and its in-flight counts are private, and the kernel
spreads a GRPO group's 8 samples over the workers. ``set_workers(n > 1)`` switches the
router to a choice every worker makes alike (``PrefixAffinityRouter._choose_fleet``):

    F(request) = the bounded-load ring walk from ring key k over the candidates, bounded
    by this table: ``bound = max(ceil((1 + load_epsilon)(L + 1) / n),
    fleet_min_load_bound)``, L the table's total over the candidates.

Why a group lands whole. F reads the request's key, the candidate set, the config and the
last snapshot: nothing a worker learned privately but the template depth t that picks k
(below). Two siblings (identical prompts) routed under the same snapshot and candidates
therefore get the same F on any worker. The private index does not get a say: a prompt the
worker has served verbatim before (an earlier sibling; the same prompt in a later epoch)
is placed by F like a new one, its record only naming the reason (``affinity`` when F
agrees with it, ``spill`` when not). Following the record instead would send a repeat to
wherever *this* worker sent it last time while workers without a record take F, and split
its group. (The price: a repeat whose F moved since the last epoch misses the prefix still
cached where it went then; docs/decisions.md, 'Routing: a repeat follows the fleet's
choice'.)
The index steers only a prompt that extends an earlier one (a multi-turn continuation: the
previous turn's KV is where this worker sent it), within bound + ``fleet_affinity_slack``.
One exception: a prompt capped at ``max_blocks`` (1024 tokens) is keyed by its first K
blocks, so a verbatim repeat and a later turn of a long conversation look alike; those
follow the index as before.

The template depth is learned per worker. k = the chain hash ``fleet_key_blocks`` (1)
past the template, or of the whole capped prompt when no template is known: workers agree
on k once each has seen the template's 32 distinct successors; until then (warm-up, per
template) a worker that knows it and one that does not key the prompt differently. One
block past the template is also a block every turn of a conversation and every sample of
its group share, so a continuation landing on a worker that never saw the conversation
still computes its replica (unless the walk moved it).

What the table must be (the caller's part). One snapshot, the same for every worker, held
between refreshes: siblings agree because they read the same table. Live counts are the
worst input, not the best: a sibling's own dispatch changes the next sibling's view
(docs/decisions.md, 'Routing: one load snapshot for all workers'). So publish the sum once
per period (one writer at a time, a sequence number) and let every worker adopt it as soon
as it is published. The period is a few ms (``gateway.fleet.shared.FLEET_LOADS_S``): when
the replicas saturate, a replica over the bound drains in a few ms, and a table older than
that keeps every worker's new keys off it for as long, so the fleet herds
(docs/decisions.md, 'Workers: fleet-load period').

Sans-I/O: no clock, no shared memory; the caller brings the table.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["FleetLoads"]


class FleetLoads:
    """The last fleet-wide ``replica -> in flight`` snapshot, and its total.

    ``update`` copies the table (O(n), once per refresh), so the caller may reuse its
    mapping. A replica missing from the table reads 0, never this worker's own count: that
    would make the decision private again.
    """

    __slots__ = ("loads", "total")

    def __init__(self) -> None:
        self.loads: dict[int, int] = {}
        self.total = 0

    def update(self, loads: Mapping[int, int]) -> None:
        table = {int(replica): max(0, int(n)) for replica, n in loads.items()}
        self.loads = table
        self.total = sum(table.values())

    def over(self, candidates: Mapping[int, int]) -> tuple[Mapping[int, int], int]:
        """The table restricted to the keys of ``candidates``, and its total.

        When the candidates are exactly the table's replicas (the common case) this is one
        C-level key-set comparison and no copy; otherwise O(n) to build the view.
        """
        fleet = self.loads
        if candidates.keys() == fleet.keys():
            return fleet, self.total
        get = fleet.get
        view = {m: get(m, 0) for m in candidates}
        return view, sum(view.values())
