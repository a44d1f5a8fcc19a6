"""BlockPrefixCache: examples, and a hypothesis comparison against a naive reference model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_testbed.sim.prefix_cache import BlockPrefixCache, block_hashes


def test_partial_block_never_hits() -> None:
    cache = BlockPrefixCache(block_size=4)
    assert cache.query(None, [1, 2, 3]) == 0
    assert cache.query(None, [1, 2, 3]) == 0
    assert len(cache) == 0


def test_repeat_hits_whole_blocks_only() -> None:
    cache = BlockPrefixCache(block_size=4)
    prompt = list(range(10))
    assert cache.query(None, prompt) == 0
    assert cache.query(None, prompt) == 8
    assert (cache.queries_tokens, cache.hits_tokens) == (20, 8)


def test_shared_prefix_then_divergence() -> None:
    cache = BlockPrefixCache(block_size=4)
    cache.query(None, [1, 1, 1, 1, 2, 2, 2, 2])
    assert cache.query(None, [1, 1, 1, 1, 9, 9, 9, 9]) == 4
    # A matching second block behind a differing first block is a different chain.
    assert cache.query(None, [7, 7, 7, 7, 2, 2, 2, 2]) == 0


def test_adapters_are_isolated() -> None:
    cache = BlockPrefixCache(block_size=2)
    cache.query("a", [1, 2, 3, 4])
    assert cache.query("b", [1, 2, 3, 4]) == 0
    assert cache.query(None, [1, 2, 3, 4]) == 0
    assert cache.query("a", [1, 2, 3, 4]) == 4


def test_lru_evicts_least_recent() -> None:
    cache = BlockPrefixCache(block_size=2, capacity_blocks=2)
    cache.query(None, [1, 1])
    cache.query(None, [2, 2])
    cache.query(None, [1, 1])  # touch: [2,2] is now least recent
    cache.query(None, [3, 3])
    assert len(cache) == 2
    assert cache.query(None, [1, 1]) == 2
    assert cache.query(None, [2, 2]) == 0


def test_chain_evicted_from_its_tail() -> None:
    cache = BlockPrefixCache(block_size=1, capacity_blocks=3)
    cache.query(None, [1, 2, 3])
    cache.query(None, [9])  # evicts the tail block (3), not the root
    assert cache.query(None, [1, 2, 3]) == 2


def test_reset_clears_blocks_keeps_counters() -> None:
    cache = BlockPrefixCache(block_size=2)
    cache.query(None, [1, 2])
    cache.query(None, [1, 2])
    cache.reset()
    assert len(cache) == 0
    assert cache.query(None, [1, 2]) == 0
    assert (cache.queries_tokens, cache.hits_tokens) == (6, 2)


def test_zero_capacity_never_hits() -> None:
    cache = BlockPrefixCache(block_size=1, capacity_blocks=0)
    cache.query(None, [1])
    assert cache.query(None, [1]) == 0


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"capacity_blocks": -1}])
def test_rejects_bad_parameters(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        BlockPrefixCache(**bad)


def test_block_hashes_are_chained() -> None:
    a = block_hashes(None, [1, 2, 3, 4], 2)
    b = block_hashes(None, [5, 6, 3, 4], 2)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes(None, [1, 2, 3], 2) == a[:1]


class _Reference:
    """Naive model: LRU over (adapter, whole-block prefix tuple), touched tail first."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.bs = block_size
        self.cap = capacity
        self.lru: OrderedDict[tuple[str | None, tuple[int, ...]], None] = OrderedDict()

    def query(self, adapter: str | None, tokens: list[int]) -> int:
        n = len(tokens) // self.bs
        keys = [(adapter, tuple(tokens[: (i + 1) * self.bs])) for i in range(n)]
        hits = 0
        for k in keys:
            if k not in self.lru:
                break
            hits += 1
        if self.cap:
            for k in reversed(keys):
                self.lru[k] = None
                self.lru.move_to_end(k)
            while len(self.lru) > self.cap:
                self.lru.popitem(last=False)
        return hits * self.bs


_queries = st.lists(
    st.tuples(
        st.sampled_from([None, "a", "b"]),
        st.lists(st.integers(0, 3), max_size=12),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 4),
    capacity=st.integers(0, 8),
    queries=_queries,
)
def test_matches_reference_model(
    block_size: int, capacity: int, queries: list[tuple[str | None, list[int]]]
) -> None:
    cache = BlockPrefixCache(block_size=block_size, capacity_blocks=capacity)
    ref = _Reference(block_size, capacity)
    total = 0
    for adapter, tokens in queries:
        got = cache.query(adapter, tokens)
        assert got == ref.query(adapter, tokens)
        assert got % block_size == 0 and got <= len(tokens)
        assert len(cache) <= capacity
        total += len(tokens)
    assert cache.queries_tokens == total
    assert len(cache) == len(ref.lru)


@given(tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=100))
def test_immediate_repeat_hits_every_whole_block(tokens: list[int]) -> None:
    cache = BlockPrefixCache(block_size=8, capacity_blocks=64)
    cache.query("x", tokens)
    assert cache.query("x", tokens) == len(tokens) // 8 * 8
