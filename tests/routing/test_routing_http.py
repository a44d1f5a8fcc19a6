"""Prefix-affinity routing through the real HTTP path: 4 sim replicas behind the gateway.

TRL's rollout shape (``reference/trl-wire.md``): the G=8 samples of a GRPO prompt are 8
separate ``n=1`` completions with the same token-id prompt, sent back to back; multi-turn
rollouts re-send the whole conversation. ``X-Gateway-Replica`` says where each one went,
and the sims' own request counters confirm it.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from typing import Any

import httpx

from tests.cluster import Cluster, cluster
from trainer.payload import build_payload

MODEL = "tiny-base"
G = 8
N = 4


def trl_payload(prompt: list[int], rng: random.Random) -> dict[str, Any]:
    """Exactly the fields TRL 1.16's rollout worker sends per sample."""
    return build_payload(MODEL, prompt, max_tokens=8, seed=rng.getrandbits(63))


def prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 150-255 tokens sharing a ~100-token system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32_000) for _ in range(100)]
    return [
        system + [rng.randrange(1, 32_000) for _ in range(rng.randrange(50, 156))]
        for _ in range(count)
    ]


async def send_group(
    client: httpx.AsyncClient, prompt: list[int], rng: random.Random, **headers: str
) -> list[int]:
    """One GRPO group: G separate n=1 requests, back to back (all in flight together)."""
    responses = await asyncio.gather(
        *(
            client.post("/v1/completions", json=trl_payload(prompt, rng), headers=headers)
            for _ in range(G)
        )
    )
    for r in responses:
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
    return [int(r.headers["x-gateway-replica"]) for r in responses]


def served(c: Cluster) -> list[int]:
    return [c.sim(i).stats.requests_by_model[MODEL] for i in range(N)]


async def test_grpo_groups_colocate_and_spread() -> None:
    rng = random.Random(1)
    async with cluster(N) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as client:
        homes = []
        for prompt in prompts(12, seed=7):
            before = served(c)
            replicas = await send_group(client, prompt, rng)
            assert len(set(replicas)) == 1, replicas  # the whole group on one replica
            home = replicas[0]
            delta = [a - b for a, b in zip(served(c), before, strict=True)]
            assert delta == [G if i == home else 0 for i in range(N)]  # the sims agree
            homes.append(home)
        # Different prompts spread over the pool (deterministic ring placement).
        assert len(set(homes)) >= 3, homes
        assert max(Counter(homes).values()) <= 6, homes


async def test_multi_turn_continuation_follows_its_conversation() -> None:
    rng = random.Random(2)
    async with cluster(N) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as client:
        for k, prompt in enumerate(prompts(6, seed=11)):
            first = await send_group(client, prompt, rng)
            conversation = list(prompt)
            for turn in range(3):  # re-send the growing conversation, as TRL's tool loop does
                conversation += [rng.randrange(1, 32_000) for _ in range(40 + 13 * turn + k)]
                r = await client.post("/v1/completions", json=trl_payload(conversation, rng))
                assert r.status_code == 200, r.text
                assert int(r.headers["x-gateway-replica"]) == first[0], (k, turn)


async def test_session_id_overrides_the_prompt_key() -> None:
    rng = random.Random(3)
    async with cluster(N) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as client:
        ps = prompts(8, seed=13)
        # One session: different prompts all go where the session lives.
        pinned = {
            int(
                (
                    await client.post(
                        "/v1/completions",
                        json=trl_payload(p, rng),
                        headers={"X-Session-ID": "episode-42"},
                    )
                ).headers["x-gateway-replica"]
            )
            for p in ps
        }
        assert len(pinned) == 1
        # Many sessions: the same prompt is placed by the session, not by the prompt.
        by_session = set()
        for s in range(12):
            r = await client.post(
                "/v1/completions", json=trl_payload(ps[0], rng), headers={"X-Session-ID": f"s{s}"}
            )
            by_session.add(int(r.headers["x-gateway-replica"]))
        assert len(by_session) >= 2
        # A GRPO group sent under one session id still lands together.
        assert len(set(await send_group(client, ps[1], rng, **{"X-Session-ID": "g"}))) == 1


async def test_routing_decisions_are_exported() -> None:
    rng = random.Random(4)
    async with cluster(N) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as client:
        for prompt in prompts(3, seed=17):
            await send_group(client, prompt, rng)
        text = (await client.get("/metrics")).text
        counts = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'^gateway_routing_decisions_total\{reason="(\w+)"\} (\S+)$', text, re.M
            )
        }
        # First sample of each group: a new key placed on the ring; siblings: affinity.
        assert counts.get("ring") == 3
        assert counts.get("affinity") == 3 * (G - 1)
        assert sum(served(c)) == 3 * G
