"""Bounded index of served prompt chains, and shared-template detection.

What it learns (only through :meth:`PrefixIndex.observe`, called after a decision):
    * **Served prompts.** For each routed request, in one LRU of ``index_capacity`` entries:
      its *exact* leaf (the last hash, which covers the partial tail when there is one) ->
      the replica, and its *anchor* (its deepest whole block) -> (replica, tail hash, tail
      length), filed under a short probe hash of the tail's first bytes (so many prompts
      can anchor on one node; tails of any length, even one token, are anchored). A GRPO
      sibling or a retry matches the exact leaf in O(1). A multi-turn continuation re-sends
      the conversation, so the previous turn's anchor is a node of its chain, and its bytes
      right after the anchor repeat the previous turn's tail: the deepest anchor that
      verifies says where that prefix's KV lives. Verification (one extra hash) is what
      stops a shared prefix that happens to end on a block boundary from attracting every
      prompt that passes through it. Interior nodes are never stored: a shared system
      prompt is an interior node of every chain.
    * **Templates.** For each interior node, its distinct successors (first one inline, a
      set from the second on, capped). A node reaching ``template_min_successors`` distinct
      successors is a *template*: many different prompts continue from it (a system prompt or
      chat-template header, a few-shot preamble). The template depth ``t`` of a chain is one
      past its deepest template node; blocks before ``t`` never decide affinity, and the ring
      key is taken ``key_blocks`` past ``t``. The threshold exceeds the group size G, so the
      G diverging samples of a multi-turn group do not turn their shared prompt into a
      template. ("Seen on every replica" is not used: after spills or churn a group can
      legitimately be on several replicas.)

Reads (:meth:`template_depth`, :meth:`lookup`, :meth:`exact`) are pure. ``observe`` is the
only mutator.

Memory is bounded: leaves <= ``index_capacity`` (LRU), nodes <= ``node_capacity``
(insertion-ordered eviction: a hot node is re-inserted when it branches), successor sets are
capped at the threshold, templates <= ``template_capacity`` (LRU). :meth:`stats` reports
sizes and an estimate of bytes.

Complexity: ``template_depth`` and ``lookup`` O(K) dict probes; ``observe`` O(1) when the leaf
is already known on that replica (every GRPO sibling after the first), else O(K).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.prefix import PromptKey

__all__ = ["IndexStats", "PrefixIndex"]

# Rough CPython sizes (64-bit) for the memory estimate: a dict slot with an int key and a
# small-int or int value, and a set slot.
_DICT_ENTRY_BYTES = 100
_SET_ENTRY_BYTES = 60
# A served entry is (replica, tail hash, tail length); tail hash _EXACT means a prompt ends
# exactly here, so anything passing through extends it.
_EXACT = 0
_ANCHOR = 1  # marks a node that some earlier prompt ends just after (with a tail)
# An anchored tail is filed under the hash of its first p bytes, p the largest of
# _PROBE_LENGTHS that fits in the tail (16 bytes = 4 token ids; a 1-3 token tail uses 4 or
# 8). The node's entry keeps a bit mask of the p in use under it, so a lookup hashes only
# those probe lengths (almost always just one). Short tails must be anchored too: a prompt
# ending 1-3 tokens past a block boundary happens 3 times in 64, and its conversation's
# next turn would otherwise fall back to the ring (measured: 2 % of continuations at N=32).
_PROBE_LENGTHS = (16, 8, 4, 2, 1)


_MAX_PROBE = max(_PROBE_LENGTHS)
# ``_PROBE_BY_LENGTH[n]``: the largest of _PROBE_LENGTHS <= n, for n = 1.._MAX_PROBE (a
# tail is never empty); a table, because a generator per observed prompt showed up in
# profiles.
_PROBE_BY_LENGTH = (
    0,
    *(max(p for p in _PROBE_LENGTHS if p <= n) for n in range(1, _MAX_PROBE + 1)),
)


def _probe_length(tail_len: int) -> int:
    """The largest of ``_PROBE_LENGTHS`` that fits in a tail of ``tail_len`` (>= 1) bytes."""
    return _PROBE_BY_LENGTH[tail_len if tail_len < _MAX_PROBE else _MAX_PROBE]


@dataclass(frozen=True, slots=True)
class IndexStats:
    served: int
    nodes: int
    branching_nodes: int
    templates: int
    approx_bytes: int


class PrefixIndex:
    """Served-prompt LRU plus successor counting for template detection."""

    __slots__ = (
        "_branch_entries",
        "_nodes",
        "_served",
        "_templates",
        "index_capacity",
        "min_successors",
        "node_capacity",
        "template_capacity",
    )

    def __init__(
        self,
        index_capacity: int,
        node_capacity: int,
        min_successors: int,
        template_capacity: int,
    ) -> None:
        self.index_capacity = index_capacity
        self.node_capacity = node_capacity
        self.min_successors = min_successors
        self.template_capacity = template_capacity
        self._served: OrderedDict[int, tuple[int, int, int]] = OrderedDict()
        self._nodes: dict[int, int | set[int]] = {}
        self._templates: OrderedDict[int, None] = OrderedDict()
        self._branch_entries = 0

    # -- reads (pure) ------------------------------------------------------------------

    def template_depth(self, hashes: Sequence[int]) -> int:
        """One past the deepest template block of ``hashes`` (0 when there is none)."""
        templates = self._templates
        if not templates:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in templates:
                return i + 1
        return 0

    def lookup(self, key: PromptKey, start: int) -> int | None:
        """Replica of the exact prompt, else of the deepest earlier prompt that ``key``
        verifiably extends, anchored at depth >= ``start - 1`` (an anchor may be the last
        template block: the tail after it is what identifies the earlier prompt)."""
        served = self._served
        hashes = key.hashes
        last = len(hashes) - 1
        if last < start:
            return None
        hit = served.get(hashes[last])
        if hit is not None and hit[1] == _EXACT:
            return hit[0]
        for i in range(last - 1 if key.has_tail else last, max(start - 1, 0) - 1, -1):
            hit = served.get(hashes[i])
            if hit is None:
                continue
            if hit[1] == _EXACT:
                if i >= start:
                    return hit[0]
                continue
            mask = hit[2]
            for length in _PROBE_LENGTHS:
                if not mask & length:
                    continue
                probe = key.tail_at(i, length)
                entry = served.get(probe) if probe is not None else None
                if (
                    entry is not None
                    and entry[1] != _EXACT
                    and key.tail_at(i, entry[2]) == entry[1]
                ):
                    return entry[0]
        return None

    def exact(self, key: PromptKey) -> int | None:
        """Replica this exact prompt was last served on (a sibling, a retry), else None.

        A tail exactly one probe length long (1, 2 or 4 token ids) has its probe hash equal
        to its leaf, so its exact entry is the probe entry filed by the prompt itself."""
        hashes = key.hashes
        if not hashes:
            return None
        leaf = hashes[-1]
        hit = self._served.get(leaf)
        if hit is None or (hit[1] != _EXACT and hit[1] != leaf):
            return None
        return hit[0]

    def is_template(self, block_hash: int) -> bool:
        return block_hash in self._templates

    def stats(self) -> IndexStats:
        branching = sum(1 for v in self._nodes.values() if isinstance(v, set))
        return IndexStats(
            served=len(self._served),
            nodes=len(self._nodes),
            branching_nodes=branching,
            templates=len(self._templates),
            approx_bytes=(len(self._served) + len(self._nodes) + len(self._templates))
            * _DICT_ENTRY_BYTES
            + self._branch_entries * _SET_ENTRY_BYTES,
        )

    # -- learning ----------------------------------------------------------------------

    def observe(self, key: PromptKey, replica: int) -> None:
        """Record that ``replica`` now serves the prompt ``key``."""
        hashes = key.hashes
        if not hashes:
            return
        served = self._served
        leaf = hashes[-1]
        known = served.get(leaf)
        if (
            known is not None
            and known[0] == replica
            and known[1] == _EXACT
            and self._refresh(key, replica, known[2])
        ):
            return  # a GRPO sibling, or a retry: the same entries, just refreshed
        probe = 0
        if key.has_tail and len(hashes) > 1:
            # Anchor: mark the deepest whole block, and file (replica, tail hash, tail length)
            # under the hash of the tail's first bytes, so several prompts can share a node.
            node = hashes[-2]
            tail_len = min(len(key.data) - (len(hashes) - 1) * key.block, key.block)
            length = _probe_length(tail_len)
            probe = key.tail_at(len(hashes) - 2, length) or 0
        # An exact entry keeps its anchor's probe hash, so a sibling refreshes by lookup.
        served[leaf] = (replica, _EXACT, probe)
        served.move_to_end(leaf)
        if probe:
            marked = served.get(node)
            if marked is None or marked[1] != _EXACT:
                mask = length if marked is None else marked[2] | length
                served[node] = (replica, _ANCHOR, mask)
                served.move_to_end(node)
            served[probe] = (replica, leaf, tail_len)
            served.move_to_end(probe)
        while len(served) > self.index_capacity:
            served.popitem(last=False)
        if known is not None and known[1] == _EXACT:
            return  # chain already counted: no new successor information
        self._count_successors(hashes)

    def _refresh(self, key: PromptKey, replica: int, probe: int) -> bool:
        """``observe`` again of a prompt already served exactly on ``replica``: what the
        full path would do (same entries, same LRU order) without re-hashing its tail.
        False when an entry changed meanwhile (evicted, or taken by another prompt)."""
        served = self._served
        hashes = key.hashes
        leaf = hashes[-1]
        if not (key.has_tail and len(hashes) > 1):
            served.move_to_end(leaf)
            return True
        entry = served.get(probe) if probe else None
        if entry is None or entry[0] != replica or entry[1] != leaf:
            return False
        node = hashes[-2]
        marked = served.get(node)
        if marked is None or (marked[1] != _EXACT and not marked[2] & _probe_length(entry[2])):
            return False
        served.move_to_end(leaf)
        if marked[1] != _EXACT:
            served[node] = (replica, _ANCHOR, marked[2])
            served.move_to_end(node)
        served.move_to_end(probe)
        return True

    def forget_replica(self, replica: int) -> int:
        """Drop every entry served by ``replica`` (its cache was lost); returns how many."""
        doomed = [h for h, entry in self._served.items() if entry[0] == replica]
        for h in doomed:
            del self._served[h]
        return len(doomed)

    def _count_successors(self, hashes: Sequence[int]) -> None:
        nodes = self._nodes
        templates = self._templates
        for i in range(len(hashes) - 1):
            parent = hashes[i]
            if parent in templates:
                templates.move_to_end(parent)
                continue
            child = hashes[i + 1]
            succ = nodes.get(parent)
            if succ is None:
                nodes[parent] = child
                if len(nodes) > self.node_capacity:
                    self._evict_node()
            elif isinstance(succ, int):
                if succ != child:
                    del nodes[parent]  # re-insert: branching nodes are the ones worth keeping
                    nodes[parent] = {succ, child}
                    self._branch_entries += 2
            elif child not in succ:
                succ.add(child)
                self._branch_entries += 1
                if len(succ) >= self.min_successors:
                    self._branch_entries -= len(succ)
                    del nodes[parent]
                    templates[parent] = None
                    if len(templates) > self.template_capacity:
                        templates.popitem(last=False)

    def _evict_node(self) -> None:
        oldest = next(iter(self._nodes))
        succ = self._nodes.pop(oldest)
        if isinstance(succ, set):
            self._branch_entries -= len(succ)
