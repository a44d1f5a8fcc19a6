"""Several runs through ``serve --workers 2``: real processes, sim replicas, 127.0.0.1 only.

What ``--workers`` changes for a shared fleet: each run's adapter table, homes and pause
live in the owner and reach the data-plane workers as snapshots, while a run's rollouts
arrive on whichever worker the kernel picked. ``tests/runs`` proves the run semantics in
one process and ``tests/trl/test_trl_many_runs.py`` proves them with TRL's own trainer;
this module proves that they hold on every worker, which is why the ``--workers 2`` TRL
layer need not run the three-run scenario again (``scripts/test_layers.py``):

- a run's load answered 200 is routable by every worker at once, under the run's names;
- the same client-side name is three different adapters, one per run, on every worker;
- a run's staleness window evicts its own old names on every worker, not another run's;
- a run's pause holds its own rollouts on every worker and nobody else's;
- rollouts only reach the run's home replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from rollout_testbed.procs import SimFleet, sim_fleet

from tests.eventually import eventually

RUNS = ("run-a", "run-b", "run-c")
ADMIN = "admin-key-runs-across-workers"  # opens the whole /gateway/status
CONNECTIONS = 16  # fresh connections, spread over 2 workers by SO_REUSEPORT
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}


@contextlib.asynccontextmanager
async def runs_fleet(tmp_path: Path) -> AsyncIterator[SimFleet]:
    """2 sims of 6 slots, 3 runs of 3 slots (max_staleness 1): 4 (run, replica) pairs fit,
    so at least two runs are homed on one replica only."""
    runs = []
    for name in RUNS:
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump({"runs": runs, "lora_slots_per_replica": 6, "admin_key": ADMIN})
    )
    args = ["--workers", "2", "--config", str(config)]
    with sim_fleet(2, tmp_path, gateway_args=args) as fleet:
        yield fleet


def load(tmp_path: Path, run: str, version: int) -> dict[str, str]:
    return {"lora_name": f"trl-policy-v{version}", "lora_path": f"{tmp_path}/{run}/v{version}"}


async def burst(url: str, run: str, model: str) -> list[int]:
    """One completion on each of CONNECTIONS fresh connections (both workers, see below)."""

    async def one() -> int:
        async with httpx.AsyncClient(base_url=url, auth=(run, f"key-{run}"), timeout=30) as c:
            return (
                await c.post("/v1/completions", json={**COMPLETION, "model": model})
            ).status_code

    return list(await asyncio.gather(*(one() for _ in range(CONNECTIONS))))


async def status(url: str) -> dict[str, Any]:
    """The whole gateway's status (every run, every worker's counters): the admin's view."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.get("/gateway/status", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data


async def sim_stats(fleet: SimFleet) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as c:
        return [(await c.get(f"{sim.url}/sim/stats")).json() for sim in fleet.sims]


async def test_runs_keep_their_names_windows_and_homes_on_every_worker(tmp_path: Path) -> None:
    async with runs_fleet(tmp_path) as fleet:
        homes = {r["name"]: set(r["home_replicas"]) for r in (await status(fleet.url))["runs"]}
        assert all(homes[run] for run in RUNS), homes
        # Each run publishes v1..v3 under the same client-side names; run-c stops at v1.
        for version in (1, 2, 3):
            for run in RUNS if version == 1 else RUNS[:2]:
                async with httpx.AsyncClient(base_url=fleet.url, auth=(run, f"key-{run}"),
                                             timeout=30) as c:  # fmt: skip
                    r = await c.post("/v1/load_lora_adapter", json=load(tmp_path, run, version))
                    assert r.status_code == 200, (run, version, r.text)
                # At once, from both workers: never a 404 for the version just answered.
                codes = await burst(fleet.url, run, f"trl-policy-v{version}")
                assert codes == [200] * CONNECTIONS, (run, version, codes)
        # max_staleness 1 keeps v2 and v3 of run-a and run-b: their v1 is retired on every
        # worker (served by their oldest live version, v2: docs/adapters.md, "Retired
        # versions"; the live lists below show it gone), a version never published is a
        # 404, while run-c's v1 (another adapter under the same name) is still its own.
        for run in RUNS[:2]:
            assert set(await burst(fleet.url, run, "trl-policy-v1")) == {200}, run
            assert set(await burst(fleet.url, run, "trl-policy-v9")) == {404}, run
        assert await burst(fleet.url, "run-c", "trl-policy-v1") == [200] * CONNECTIONS

        gateway = await status(fleet.url)
        workers = gateway["workers"]
        assert [w["worker"] for w in workers] == [0, 1]
        # Both workers routed (2^-(16*12-1) likely otherwise): the above ran on each.
        assert all(w["routed"] > 0 for w in workers), workers
        live = {r["name"]: sorted(r["live"]) for r in gateway["runs"]}
        assert live == {"run-a": ["trl-policy-v2", "trl-policy-v3"],
                        "run-b": ["trl-policy-v2", "trl-policy-v3"],
                        "run-c": ["trl-policy-v1"]}, live  # fmt: skip

        # Every adapter a replica holds carries one run's prefix, on that run's homes only,
        # and every rollout that named an adapter reached a replica holding it.
        for index, stats in enumerate(await sim_stats(fleet)):
            owners = {name.split("~", 1)[0] for name in stats["adapters"]}
            assert owners <= {run for run in RUNS if index in homes[run]}, (index, stats)
            for model, count in stats["requests_by_model"].items():
                if "~" in model:
                    assert index in homes[model.split("~", 1)[0]], (index, model, count)


async def test_a_runs_pause_holds_only_its_own_rollouts_on_every_worker(tmp_path: Path) -> None:
    async with (
        runs_fleet(tmp_path) as fleet,
        httpx.AsyncClient(base_url=fleet.url, auth=("run-a", "key-run-a"), timeout=30) as a,
    ):
        r = await a.post("/pause", params={"mode": "keep"})
        assert r.json() == {"status": "paused"}, r.text
        held = asyncio.ensure_future(burst(fleet.url, "run-a", "tiny-base"))

        async def admitted() -> bool:
            # The workers' own in-flight counts (the per-run ``in_flight`` of
            # /gateway/status is the owner's, which serves no rollouts with --workers).
            workers = (await status(fleet.url))["workers"]
            return sum(int(w["in_flight"]) for w in workers) == CONNECTIONS

        # Positive marker: all of run-a's rollouts are inside the gateway (on both
        # workers) before run-b's go through the same workers and the replicas.
        await eventually(admitted, "all of run-a's rollouts admitted")
        held_by = [int(w["in_flight"]) for w in (await status(fleet.url))["workers"]]
        assert all(held_by), f"one worker held them all: {held_by}"  # 2^-15 likely
        assert await burst(fleet.url, "run-b", "tiny-base") == [200] * CONNECTIONS
        assert not held.done()  # run-a's rollouts wait for run-a's /resume
        assert not any(s["paused"] for s in await sim_stats(fleet))  # no replica paused
        assert (await a.post("/resume")).status_code == 200
        assert await asyncio.wait_for(held, 30) == [200] * CONNECTIONS
