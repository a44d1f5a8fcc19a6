"""index.py: exact leaves, verified continuation anchors, template detection, bounded memory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.routing.config import RoutingConfig
from gateway.routing.index import _PROBE_LENGTHS, PrefixIndex, _probe_length
from gateway.routing.prefix import PromptKey, PromptKind, prompt_key

CFG = RoutingConfig(block_size=8, max_blocks=16)


def k(ids: list[int]) -> PromptKey:
    key = prompt_key("/v1/completions", "m-v1", {"prompt": ids}, None, CFG)
    assert key is not None
    return key


def make(cap: int = 100, nodes: int = 1000, succ: int = 4, tmpl: int = 10) -> PrefixIndex:
    return PrefixIndex(cap, nodes, succ, tmpl)


def test_exact_and_verified_continuation() -> None:
    idx = make()
    turn1 = list(range(22))  # 2 whole blocks + a 6-token tail
    idx.observe(k(turn1), replica=4)
    assert idx.lookup(k(turn1), 0) == 4
    assert idx.lookup(k([*turn1, 77, 78, 79, 80, 81]), 0) == 4  # extends turn 1
    # another prompt anchored on the same node does not hide turn 1
    idx.observe(k([*turn1[:16], 90, 91, 92, 93, 94]), replica=2)
    assert idx.lookup(k([*turn1, 1, 2, 3, 4, 5, 6, 7, 8, 9]), 0) == 4
    # shares turn 1's whole blocks but not its tail: not a continuation
    assert idx.lookup(k([*turn1[:16], 55, 56, 57, 58, 59]), 0) is None
    assert idx.lookup(k(turn1[:16]), 0) is None  # interior nodes never attract
    assert idx.lookup(k([*turn1, 1, 2, 3, 4, 5, 6, 7, 8]), 4) is None  # depths < start - 1


def test_template_detected_after_enough_successors() -> None:
    idx = make(succ=4)
    prefix = list(range(16))
    for q in range(3):
        idx.observe(k([*prefix, 100 + q, 1, 2, 3]), replica=q)
    probe = k([*prefix, 555, 1, 2, 3])
    assert idx.template_depth(probe.hashes) == 0
    idx.observe(k([*prefix, 200, 1, 2, 3]), replica=0)
    assert idx.is_template(probe.hashes[1])
    assert idx.template_depth(probe.hashes) == 2


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(0, 7)),
        max_size=100,
    )
)
def test_memory_bounded(ops: list[tuple[list[int], int]]) -> None:
    idx = make(cap=10, nodes=20, succ=3, tmpl=5)
    for ids, replica in ops:
        idx.observe(k(ids), replica)
        s = idx.stats()
        assert s.served <= 10 and s.nodes <= 20 and s.templates <= 5
        assert (s.approx_bytes > 0) == bool(s.served or s.nodes or s.templates)


def test_forget_replica() -> None:
    idx = make()
    idx.observe(k(list(range(13))), 0)  # one block + a 5-token tail
    idx.observe(k([6, 7, 8, 9]), 1)
    assert idx.forget_replica(0) == 3  # exact leaf, anchor mark, anchored tail
    assert idx.lookup(k(list(range(13))), 0) is None and idx.lookup(k([6, 7, 8, 9]), 0) == 1


def test_session_key_has_no_tail() -> None:
    idx = make()
    key = PromptKey(PromptKind.SESSION, (42,))
    idx.observe(key, 3)
    assert idx.lookup(key, 0) == 3


def test_short_tails_are_anchored() -> None:
    """A prompt ending 1-3 tokens past a block boundary is still found by its next turn."""
    idx = make()
    for tail in (1, 2, 3, 5):
        turn1 = [100 * tail + i for i in range(16 + tail)]  # 2 whole blocks + a short tail
        idx.observe(k(turn1), replica=tail)
        assert idx.lookup(k([*turn1, 7, 8, 9, 10, 11, 12, 13]), 0) == tail
        # same whole blocks, a different short tail: not a continuation of turn 1
        assert idx.lookup(k([*turn1[:16], 999, 998, 997, 996, 995, 994]), 0) is None


def test_keys_compare_by_value() -> None:
    a, b = k(list(range(20))), k(list(range(20)))
    assert a == b and hash(a) == hash(b) and a != k(list(range(21)))
    assert "PromptKey(" in repr(a)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # which of a few prompts sharing prefixes (siblings repeat)
            st.integers(0, 30),  # its length in tokens
            st.integers(0, 2),  # the replica
        ),
        max_size=120,
    )
)
def test_refreshing_a_served_prompt_matches_the_full_path(
    ops: list[tuple[int, int, int]],
) -> None:
    """The sibling fast path leaves exactly the entries, in exactly the LRU order, that
    the full path would (small capacity: evictions and takeovers happen)."""

    class FullPath(PrefixIndex):
        def _refresh(self, key: PromptKey, replica: int, probe: int) -> bool:
            return False

    fast, full = make(cap=12, nodes=20, succ=3), FullPath(12, 20, 3, 10)
    refreshed = 0
    for which, length, replica in ops:
        ids = [which] * 8 + list(range(length))  # 1 shared block, then their own tails
        key = k(ids)
        known = fast._served.get(key.hashes[-1])
        refreshed += known is not None and known[0] == replica
        fast.observe(key, replica)
        full.observe(key, replica)
        assert list(fast._served.items()) == list(full._served.items())
        assert fast._nodes == full._nodes and fast._templates == full._templates


def test_a_sibling_on_the_same_replica_takes_the_refresh_path() -> None:
    class Counting(PrefixIndex):
        hits = 0

        def _refresh(self, key: PromptKey, replica: int, probe: int) -> bool:
            hit = super()._refresh(key, replica, probe)
            Counting.hits += hit
            return hit

    idx = Counting(100, 1000, 4, 10)
    key = k(list(range(22)))  # anchored: 2 whole blocks + a tail
    idx.observe(key, 1)
    idx.observe(key, 1)
    assert Counting.hits == 1 and idx.lookup(key, 0) == 1
    idx.observe(key, 2)  # moved (a spill): the full path re-files it
    assert Counting.hits == 1 and idx.lookup(key, 0) == 2
    idx.observe(key, 2)
    assert Counting.hits == 2


def test_probe_length_is_the_largest_probe_that_fits_the_tail() -> None:
    for tail_len in range(1, 600):
        fits = [p for p in _PROBE_LENGTHS if p <= tail_len]
        assert _probe_length(tail_len) == max(fits)


def test_exact_names_only_the_prompt_itself() -> None:
    """``exact``: the replica of this very prompt, for every tail length (a 1, 2 or 4 token
    tail's probe hash is its leaf, so its exact entry is the probe entry), never of a
    prompt it extends or of one that extends it."""
    idx = make()
    for tail in range(0, 9):
        prompt = [1000 * tail + i for i in range(16 + tail)]  # 2 whole blocks + a tail
        assert idx.exact(k(prompt)) is None
        idx.observe(k(prompt), replica=tail)
        assert idx.exact(k(prompt)) == tail
        assert idx.exact(k([*prompt, 5, 6, 7])) is None  # a continuation: lookup's job
        if tail:
            assert idx.exact(k(prompt[:16])) is None  # its whole blocks: interior nodes
        idx.observe(k(prompt), replica=9)  # served again elsewhere: the latest wins
        assert idx.exact(k(prompt)) == 9
