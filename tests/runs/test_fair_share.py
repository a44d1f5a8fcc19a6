"""The fair share end to end (real sockets, sim replicas, ``gateway.runs.fairness``): a run
that floods saturated replicas does not make another run wait behind its backlog, the
wait is bounded, a client that leaves while held frees its place, and single-run mode
never holds anything. Ordering, not time, is asserted: the sim's decode time only makes
rollouts long enough to overlap."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from tests.cluster import Cluster, cluster
from tests.eventually import eventually
from tests.runs.test_many_runs import as_run, homes, run_specs

ROLLOUT = {"prompt": [1, 2, 3], "max_tokens": 6, "model": "tiny-base"}
SLOW = SimConfig(latency=LatencyModel(decode=0.05))  # 6 tokens: 0.3 s


def fair(c: Any, run: str) -> dict[str, Any]:
    (entry,) = c.gateway.tenancy.status(run)
    return dict(entry["fair"])


@dataclass
class Pair:
    """Two runs on one slow sim replica of ``capacity`` slots, and the order in which
    their rollouts came back (each tagged by the caller)."""

    c: Cluster
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient]
    done: list[str] = field(default_factory=list)

    def rollout(self, run: int, who: str) -> asyncio.Future[int]:
        async def go() -> int:
            r = await self.clients[run].post("/v1/completions", json=ROLLOUT)
            self.done.append(who)
            return r.status_code

        return asyncio.ensure_future(go())


@asynccontextmanager
async def pair(
    tmp_path: Path, names: tuple[str, str], capacity: int, weights: tuple[float, float] = (1, 1)
) -> AsyncIterator[Pair]:
    specs = run_specs(tmp_path, names)
    for spec, weight in zip(specs, weights, strict=True):
        spec["weight"] = weight
    async with (
        cluster(1, SLOW, runs=specs, replica_capacity=capacity, lora_slots_per_replica=8) as c,
        as_run(c, names[0]) as a,
        as_run(c, names[1]) as b,
    ):
        yield Pair(c, (a, b))


async def test_a_run_under_its_share_passes_the_floods_backlog(tmp_path: Path) -> None:
    async with pair(tmp_path, ("flood", "steady"), capacity=2) as p:
        c, (a, _), done = p.c, p.clients, p.done
        flood = [p.rollout(0, f"a{i}") for i in range(8)]
        await eventually(lambda: fair(c, "flood")["waiting"] == 6, "6 of the flood held")
        assert fair(c, "flood")["slots"] == 2  # capacity, no more
        await eventually(lambda: c.sim(0).running == 2, "two at the replica")
        steady = [p.rollout(1, f"b{i}") for i in range(2)]
        await eventually(lambda: fair(c, "steady")["waiting"] == 2, "the steady run held")
        codes = await asyncio.wait_for(asyncio.gather(*flood, *steady), 30)
        assert codes == [200] * 10
        # b's first rollout took the first free slot (b under its share, a over it); its
        # second the next one its tag won, still ahead of most of a's backlog.
        assert done.index("b0") <= 2, done
        assert done.index("b1") <= 5, done
        assert fair(c, "flood") == fair(c, "steady") | {"weight": 1.0} == {
            "weight": 1.0, "slots": 0, "waiting": 0, "overflows": 0,
        }  # fmt: skip
        metrics = (await a.get("/metrics")).text
        assert 'gateway_run_fair_waiting{run="flood"} 0.0' in metrics
        assert 'gateway_run_weight{run="steady"} 1.0' in metrics
        held = [line for line in metrics.splitlines()
                if line.startswith('gateway_run_held_seconds_total{run="flood"}')]  # fmt: skip
        assert held and float(held[0].split()[-1]) > 0  # the flood's wait is accounted


async def test_weights_set_the_order_of_saturating_runs(tmp_path: Path) -> None:
    async with pair(tmp_path, ("heavy", "light"), capacity=1, weights=(3, 1)) as p:
        c, done = p.c, p.done
        first = p.rollout(0, "h")  # takes the one slot
        await eventually(lambda: c.sim(0).running == 1, "the slot taken")
        tasks = [p.rollout(0, "h") for _ in range(6)]
        await eventually(lambda: fair(c, "heavy")["waiting"] == 6, "heavy's backlog held")
        tasks += [p.rollout(1, "l") for _ in range(2)]
        await eventually(lambda: fair(c, "light")["waiting"] == 2, "light's held")
        codes = await asyncio.wait_for(asyncio.gather(first, *tasks), 30)
        assert codes == [200] * 9
        # The first ran alone. Then start tags: heavy's 0, 1/3, 2/3, 1, ... (weight 3) and
        # light's 0, 1 (weight 1); a tie goes to heavy, which was first in line: three of
        # heavy's for each of light's.
        assert "".join(done) == "hhlhhhlhh", done


async def test_the_wait_is_bounded_and_the_rollout_is_sent_at_the_bound(tmp_path: Path) -> None:
    specs = run_specs(tmp_path, ("only",))
    long = SimConfig(latency=LatencyModel(decode=0.5))  # 6 tokens: 3 s
    async with (
        cluster(1, long, runs=specs, replica_capacity=1, fair_wait_s=0.3,
                lora_slots_per_replica=8) as c,
        as_run(c, "only") as a,
    ):  # fmt: skip
        first = asyncio.ensure_future(a.post("/v1/completions", json=ROLLOUT))
        await eventually(lambda: c.sim(0).running == 1, "the slot taken")
        second = await a.post("/v1/completions", json=ROLLOUT)  # held 0.3 s, then sent
        assert second.status_code == 200
        assert (await first).status_code == 200
        assert fair(c, "only")["overflows"] == 1
        metrics = (await a.get("/metrics")).text
        assert 'gateway_run_fair_overflows_total{run="only"} 1.0' in metrics


async def test_a_client_leaving_while_held_frees_its_place(tmp_path: Path) -> None:
    specs = run_specs(tmp_path, ("only",))
    long = SimConfig(latency=LatencyModel(decode=0.5))
    async with (
        cluster(1, long, runs=specs, replica_capacity=1, lora_slots_per_replica=8) as c,
        as_run(c, "only") as a,
    ):
        tenant = c.gateway.tenancy.tenants["only"]
        first = asyncio.ensure_future(a.post("/v1/completions", json=ROLLOUT))
        await eventually(lambda: c.sim(0).running == 1, "the slot taken")
        held = asyncio.ensure_future(a.post("/v1/completions", json=ROLLOUT))
        await eventually(lambda: fair(c, "only")["waiting"] == 1, "the second held")
        held.cancel()  # the client closes its connection
        await eventually(lambda: fair(c, "only")["waiting"] == 0, "its place freed")
        await eventually(lambda: tenant.in_flight == 1, "its books closed")
        assert (await first).status_code == 200
        assert fair(c, "only") == {"weight": 1.0, "slots": 0, "waiting": 0, "overflows": 0}


async def test_single_run_mode_holds_nothing(tmp_path: Path) -> None:
    """The implicit run takes no slot: capacity does not apply to a lone run (vLLM's own
    queue is as fair as it needs to be), and its rollouts pay nothing for the books."""
    async with cluster(1, SLOW, replica_capacity=1) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=10) as client:
            tasks = [client.post("/v1/completions", json=ROLLOUT) for _ in range(4)]
            running = asyncio.ensure_future(asyncio.gather(*tasks))
            await eventually(lambda: c.sim(0).running == 4, "all four at the replica")
            assert [r.status_code for r in await running] == [200] * 4
        assert c.gateway.tenancy.fair is not None and c.gateway.tenancy.fair.share.used(0) == 0


async def test_a_flooding_runs_groups_wait_for_their_own_prefix_replica(tmp_path: Path) -> None:
    """Saturated replicas: a freed slot goes to a held rollout whose prompt's prefix lives
    there, not to the oldest held one, so each GRPO group is served whole by one replica
    (the replica's prefix cache computes the prompt once, not once per replica)."""
    rng = random.Random(5)
    specs = run_specs(tmp_path, ("flood",))
    async with (
        cluster(2, SLOW, runs=specs, replica_capacity=1, lora_slots_per_replica=8) as c,
        as_run(c, "flood") as a,
    ):
        assert homes(c)["flood"] == {0, 1}

        async def rollout(prompt: list[int], max_tokens: int = 6) -> int:
            body = {**ROLLOUT, "prompt": prompt, "max_tokens": max_tokens}
            r = await a.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return int(r.headers["x-gateway-replica"])

        # Where each prompt's prefix lives: one rollout each, one at a time (idle replicas).
        home: dict[int, list[int]] = {}
        for _ in range(16):
            prompt = [rng.randrange(1, 32_000) for _ in range(64)]
            home.setdefault(await rollout(prompt), prompt)
            if len(home) == 2:
                break
        assert sorted(home) == [0, 1]
        # Both slots taken by rollouts each replica holds until the test lets them go (a
        # marker, not a duration); then two groups of 4, interleaved, all held.
        for i in (0, 1):
            c.sim(i).faults.completion_hang = 1
        blockers = [asyncio.ensure_future(rollout([9, i, 9])) for i in (1, 2)]
        await eventually(lambda: c.sim(0).hanging == c.sim(1).hanging == 1, "both slots taken")
        groups = {r: [asyncio.ensure_future(rollout(home[r])) for _ in range(4)] for r in (0, 1)}
        order = [t for pair in zip(groups[0], groups[1], strict=True) for t in pair]
        await eventually(lambda: fair(c, "flood")["waiting"] == 8, "both groups held")
        for i in (0, 1):
            c.sim(i).clear_faults()  # the blockers go on; then the held groups
        await asyncio.wait_for(asyncio.gather(*blockers, *order), 30)
        for r, tasks in groups.items():
            assert [t.result() for t in tasks] == [r] * 4, (r, [t.result() for t in tasks])
