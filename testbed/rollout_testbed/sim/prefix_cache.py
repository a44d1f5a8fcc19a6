"""A block-granular, LRU prefix cache that counts hits the way vLLM's does.

Algorithm (mirrors vLLM's automatic prefix caching, in miniature):

* A prompt is cut into whole blocks of ``block_size`` token ids. A trailing partial block is
  never cached, because vLLM only hashes full KV blocks.
* Block *i*'s key is ``xxh3_64(parent_hash || token ids of block i)``, seeded per adapter, so
  a block key identifies the whole prefix up to and including it, and two adapters never
  share entries (vLLM keys its cache by LoRA too).
* ``query`` walks the chain from the first block and counts leading blocks already present;
  the first miss ends the hit run (a later block can only be reused after its parent).
  Then every whole block is inserted or touched. They are touched tail first, so a prompt's
  root block is the most recently used: as in vLLM's free-block queue, a chain is evicted
  from its tail, and parents outlive their children.
* Capacity is a number of blocks across all adapters; the least recently used block is
  evicted first. Evicting a parent before its child only shortens future hits, exactly as in
  vLLM, where a child without its parent is unreachable.

Counters follow ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``:
both in tokens, ``queries_tokens`` counting every prompt token offered, ``hits_tokens`` the
tokens served from cache. Pure: no I/O, no clock.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

__all__ = ["BlockPrefixCache", "block_hashes"]

# Token ids are packed as little-endian uint32; vLLM's vocabularies fit comfortably.
_MASK32 = 0xFFFFFFFF


def _adapter_seed(adapter: str | None) -> int:
    """Root of the hash chain: the base model and each adapter get disjoint chains."""
    if adapter is None:
        return 0
    return int(xxhash.xxh3_64_intdigest(b"lora:" + adapter.encode()))


def block_hashes(adapter: str | None, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained xxh3_64 hashes of every whole block of ``token_ids`` (partial tail dropped)."""
    n_blocks = len(token_ids) // block_size
    parent = _adapter_seed(adapter)
    out: list[int] = []
    fmt = f"<Q{block_size}I"
    for b in range(n_blocks):
        chunk = token_ids[b * block_size : (b + 1) * block_size]
        data = struct.pack(fmt, parent, *(t & _MASK32 for t in chunk))
        parent = int(xxhash.xxh3_64_intdigest(data))
        out.append(parent)
    return out


class BlockPrefixCache:
    """LRU set of chained block hashes; ``query`` returns cached prompt tokens, then inserts."""

    def __init__(self, block_size: int = 32, capacity_blocks: int = 4096) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens = 0
        self.hits_tokens = 0

    def __len__(self) -> int:
        return len(self._lru)

    def query(self, adapter: str | None, token_ids: Sequence[int]) -> int:
        """Count tokens in leading whole blocks already cached, then cache all whole blocks."""
        hashes = block_hashes(adapter, token_ids, self.block_size)
        hit_blocks = 0
        for h in hashes:
            if h not in self._lru:
                break
            hit_blocks += 1
        hit_tokens = hit_blocks * self.block_size
        self.queries_tokens += len(token_ids)
        self.hits_tokens += hit_tokens
        self._insert(hashes)
        return hit_tokens

    def _insert(self, hashes: list[int]) -> None:
        if self.capacity_blocks == 0:
            return
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def reset(self) -> None:
        """Drop every cached block (like ``POST /reset_prefix_cache``); counters are kept."""
        self._lru.clear()
