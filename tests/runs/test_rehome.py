"""A run whose home replicas are all down moves to a replica with room, or is unplaced
(``docs/many-runs.md``, "When a run's homes go down"): the real CLI
(``python -m gateway serve --config``) over simulated replica processes, one of which is
killed (SIGKILL: a crash) or frozen (SIGSTOP: a hang the probes time out on)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from rollout_testbed.procs import SimFleet, sim_fleet
from rollout_testbed.serve import serve_asgi

from gateway.adapters.placement import Placement, place
from gateway.app import create_app
from gateway.config import load_settings
from tests.cluster import sims
from tests.eventually import STALL_S, eventually
from tests.runs.test_many_runs import COMPLETION, load

ADMIN = "admin-secret"
INTERVAL_S = 0.5
"""The gateway's health_interval_s here."""
TIMEOUT_S = 1.0
"""Its health_timeout_s: a frozen replica's probe fails after this long."""


def config(tmp_path: Path, slots: int) -> list[str]:
    """Two runs of ``max_staleness: 1`` (3 slots each) on replicas of ``slots`` slots."""
    runs = []
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({
        "runs": runs, "lora_slots_per_replica": slots, "admin_key": ADMIN,
        "health_interval_s": INTERVAL_S, "health_timeout_s": TIMEOUT_S,
        "unhealthy_threshold": 2,
    }))  # fmt: skip
    return ["--config", str(path)]


def client(fleet: SimFleet, run: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=fleet.url, auth=(run, f"key-{run}"), timeout=30)


async def homes(fleet: SimFleet) -> dict[str, list[int]]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as c:
        status = (await c.get("/gateway/status")).json()
    return {run["name"]: run["home_replicas"] for run in status["runs"]}


async def placed_homes(fleet: SimFleet) -> dict[str, list[int]] | None:
    """Every run's homes, once every run has one."""
    found = await homes(fleet)
    return found if len(found) == 2 and all(found.values()) else None


async def home_gauge(fleet: SimFleet, run: str) -> float | None:
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as c:
        text = (await c.get("/metrics")).text
    found = re.search(rf'^gateway_run_home_replicas{{run="{run}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


async def rollout(fleet: SimFleet, run: str) -> httpx.Response:
    async with client(fleet, run) as c:
        return await c.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})


async def published(fleet: SimFleet, tmp_path: Path) -> None:
    """Both runs load ``trl-policy-v1`` and roll out on it."""
    for run in ("run-a", "run-b"):
        async with client(fleet, run) as c:
            r = await c.post("/v1/load_lora_adapter", json=load(tmp_path, run, 1))
            assert r.status_code == 200, r.text
        assert (await rollout(fleet, run)).status_code == 200


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_a_run_whose_only_home_dies_moves_to_a_replica_with_room(
    tmp_path: Path, fault: str
) -> None:
    """3 replicas of 3 slots, 2 runs of 3: one run is homed on two replicas, the other
    on one. Its home dies: the run takes one of the other run's extra homes, its version
    is loaded there, and its rollouts succeed again within the stated bound; the other run
    keeps serving; when the dead replica returns the moved run stays where it is."""
    with sim_fleet(3, tmp_path, gateway_args=config(tmp_path, slots=3)) as fleet:
        placed = await eventually(lambda: placed_homes(fleet), "both runs placed")
        assert sorted(map(len, placed.values())) == [1, 2], placed
        poor = next(run for run, hs in placed.items() if len(hs) == 1)
        rich = next(run for run in placed if run != poor)
        (home,) = placed[poor]
        await published(fleet, tmp_path)

        dead = fleet.sims[home]
        started = time.monotonic()
        dead.kill() if fault == "kill" else dead.freeze()

        async def served() -> bool:
            return (await rollout(fleet, poor)).status_code == 200

        await eventually(served, f"{poor}'s rollouts served again after its home died")
        took = time.monotonic() - started
        # the bound of docs/many-runs.md: a refused connection is ejected at the next probe,
        # a hang after unhealthy_threshold probes (each up to health_timeout_s); the run is
        # re-placed in the round that ejects it and its version loaded in that round
        rounds = 1 if fault == "kill" else 2
        bound = rounds * (INTERVAL_S + TIMEOUT_S) + INTERVAL_S
        print(f"{fault}: {poor} served again {took:.2f} s after its home died (bound {bound} s)")
        assert took <= bound + STALL_S, (took, bound)
        now = await homes(fleet)
        assert len(now[poor]) == 1 and now[poor][0] != home, now
        assert now[poor][0] in placed[rich] and now[rich] == [h for h in placed[rich]
                                                             if h != now[poor][0]], now  # fmt: skip
        assert await home_gauge(fleet, poor) == 1.0
        assert (await rollout(fleet, rich)).status_code == 200
        # its old home returns: the run does not move back (the freed room may be spread)
        if fault == "kill":
            dead.start()
        else:
            dead.thaw()

        async def back() -> dict[str, list[int]] | None:
            found = await homes(fleet)
            return found if home in {h for hs in found.values() for h in hs} else None

        after = await eventually(back, "the returned replica homed again", timeout=30)
        assert now[poor][0] in after[poor], after
        assert (await rollout(fleet, poor)).status_code == 200


async def test_a_run_whose_only_home_dies_with_no_room_elsewhere_is_unplaced(
    tmp_path: Path,
) -> None:
    """2 replicas of 3 slots, 2 runs of 3: each run has exactly one home and there is no
    room anywhere else. One home dies: that run is unplaced (``gateway_run_home_replicas``
    0, which ``RolloutGatewayRunUnplaced`` selects), its rollouts get an answer that says
    why, the other run serves on; the replica's return places it again."""
    with sim_fleet(2, tmp_path, gateway_args=config(tmp_path, slots=3)) as fleet:
        placed = await eventually(lambda: placed_homes(fleet), "both runs placed")
        assert sorted(map(len, placed.values())) == [1, 1], placed
        await published(fleet, tmp_path)
        (home,) = placed["run-b"]
        dead = fleet.sims[home]
        dead.kill()

        async def unplaced() -> bool:
            return await home_gauge(fleet, "run-b") == 0.0

        await eventually(unplaced, "run-b unplaced: gateway_run_home_replicas 0")
        answer = await rollout(fleet, "run-b")
        assert answer.status_code == 507, answer.text
        assert f"lost its home replicas [{home}] (down)" in answer.text, answer.text
        assert await home_gauge(fleet, "run-a") == 1.0
        assert (await rollout(fleet, "run-a")).status_code == 200
        dead.start()

        async def served() -> bool:
            return (await rollout(fleet, "run-b")).status_code == 200

        await eventually(served, "run-b placed again, its version reloaded, once back")
        assert (await homes(fleet))["run-b"] == [home]
        assert await home_gauge(fleet, "run-b") == 1.0


async def test_a_run_placed_at_start_only_on_a_replica_that_is_down_moves_at_once(
    tmp_path: Path,
) -> None:
    """The start places the runs on every member, up or not (a replica that is slow to
    start keeps its homes); a run homed only on a replica that is down moves at the first
    health round after the placement. The replica to stop is the one the placement (pure,
    deterministic) gives the run that has one home."""
    plan = place(Placement.empty({}), {"run-a": 3, "run-b": 3}, {0: 3, 1: 3, 2: 3})
    assert isinstance(plan, Placement)
    poor = next(run for run in plan.runs if len(plan.homes(run)) == 1)
    (home,) = plan.homes(poor)
    runs = []
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    async with sims(3) as replicas:
        await replicas[home].stop()
        overrides = {"replicas": [r.url for r in replicas], "runs": runs,
                     "lora_slots_per_replica": 3, "health_interval_s": INTERVAL_S}  # fmt: skip
        app = create_app(load_settings(overrides, environ={}))
        async with serve_asgi(app) as url:
            tenancy = app.state.gateway.tenancy

            def moved() -> bool:
                homes = tenancy.tenants[poor].homes
                return tenancy.placement is not None and bool(homes) and home not in homes

            await eventually(moved, f"{poor} moved off replica {home}, down since the start")
            auth = (poor, f"key-{poor}")
            async with httpx.AsyncClient(base_url=url, auth=auth, timeout=30) as c:
                r = await c.post("/v1/load_lora_adapter", json=load(tmp_path, poor, 1))
                assert r.status_code == 200, r.text
                body = {**COMPLETION, "model": "trl-policy-v1"}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
