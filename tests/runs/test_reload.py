"""Runs join and leave a live gateway (docs/many-runs.md, "Runs join and leave live"):
real sockets, sim replicas, the config file rewritten and reloaded by the admin's
``POST /gateway/runs/reload``, by SIGHUP or by the file watch."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rollout_testbed.procs import sim_fleet
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from gateway.adapters.placement import Change, Placement, diff, place
from gateway.app import create_app
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.runs.tenancy import Tenant
from tests.cluster import SimReplica, sims
from tests.eventually import STALL_S, eventually
from tests.runs.test_many_runs import COMPLETION, load

ADMIN = "admin-secret"
RELOAD = "/gateway/runs/reload"


def spec(root: Path, name: str, key: str | None = None, **extra: Any) -> dict[str, Any]:
    (root / name).mkdir(exist_ok=True)
    return {"name": name, "key": key or f"key-{name}", "adapter_root": str(root / name),
            "max_staleness": 1, **extra}  # fmt: skip


@dataclass
class Live:
    url: str
    app: Any
    replicas: Sequence[SimReplica]
    path: Path
    base: dict[str, Any]

    @property
    def gateway(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    def write(self, runs: list[dict[str, Any]], **more: Any) -> None:
        """Replace the config file in one rename, as a ConfigMap update does: the file
        watch never reads it half written."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(yaml.safe_dump({**self.base, **more, "runs": runs}))
        stamp = self.path.stat().st_mtime_ns + 10_000_000  # a new mtime even within a tick
        os.utime(tmp, ns=(stamp, stamp))
        os.replace(tmp, self.path)

    def run(self, name: str, key: str | None = None) -> httpx.AsyncClient:
        auth = (name, key or f"key-{name}")
        return httpx.AsyncClient(base_url=self.url, auth=auth, timeout=30)

    def admin(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)

    def tenant(self, name: str) -> Tenant:
        return self.gateway.tenancy.tenants[name]

    async def reload(self) -> httpx.Response:
        async with self.admin() as admin:
            return await admin.post(RELOAD)


@asynccontextmanager
async def live(tmp_path: Path, runs: list[dict[str, Any]], n: int = 2,
               sim: SimConfig | None = None, **settings: Any) -> AsyncIterator[Live]:  # fmt: skip
    async with sims(n, sim) as replicas:
        base = {"replicas": [r.url for r in replicas], "health_interval_s": 0.2,
                "lora_slots_per_replica": 6, "admin_key": ADMIN,
                "discovery_interval_s": 60, **settings}  # fmt: skip
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump({**base, "runs": runs}))
        app = create_app(load_settings(config_file=path, environ={}))
        async with serve_asgi(app) as url:
            yield Live(url, app, replicas, path, base)


async def test_a_run_added_by_a_reload_loads_and_rolls_out_at_once(tmp_path: Path) -> None:
    a = spec(tmp_path, "run-a")
    async with live(tmp_path, [a]) as g:
        async with g.run("run-b") as b:
            assert (await b.get("/v1/models")).status_code == 401  # not a run yet
            g.write([a, spec(tmp_path, "run-b")])
            r = await g.reload()
            assert r.status_code == 200, r.text
            assert r.json()["added"] == ["run-b"] and r.json()["outcome"] == "applied"
            loaded = await b.post("/v1/load_lora_adapter", json=load(tmp_path, "run-b", 1))
            assert loaded.status_code == 200, loaded.text
            gen = await b.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v1"})
            assert gen.status_code == 200 and gen.json()["model"] == "trl-policy-v1", gen.text
        assert g.tenant("run-b").homes
        async with g.admin() as admin:
            names = [r["name"] for r in (await admin.get("/gateway/status")).json()["runs"]]
            metrics = (await admin.get("/metrics")).text
        assert names == ["run-a", "run-b"]
        assert 'gateway_run_reloads_total{outcome="applied"} 1.0' in metrics
        assert 'gateway_run_requests_total{run="run-b"} 1.0' in metrics


async def test_the_file_watch_does_not_reload_again_what_a_post_applied(tmp_path: Path) -> None:
    """The watch and the admin's POST share one record of the file: a change the POST
    applied is not reloaded again by the watch ("unchanged"), nor taken by the watch
    first so that the POST's answer names nothing."""
    a, b, c = (spec(tmp_path, n) for n in ("run-a", "run-b", "run-c"))
    async with live(tmp_path, [a], discovery_interval_s=0.1) as g:
        reloads = g.gateway.tenancy.reloads
        g.write([a, b])
        r = await g.reload()  # the watch may have taken it first: then the POST says so
        assert r.status_code == 200, r.text
        first = r.json()
        # Five ticks of the watch for it to reload [a, b] again (what it did: its own stamp
        # was stale). Correct code does nothing here at any speed, so this cannot fail it.
        await asyncio.sleep(0.5)
        g.write([a, b, c])  # the marker: the watch applies this one, after the POST
        await eventually(lambda: "run-c" in g.gateway.tenancy.tenants, "the watch's reload")
        await eventually(lambda: reloads.get("applied") == 2, "two applied reloads")
        # exactly one reload read [a, b]: the POST (applied) or the watch (then the POST's
        # answer is "unchanged"); never both
        took_it = first["outcome"] == "applied" and first["added"] == ["run-b"]
        assert reloads.get("unchanged", 0) == (0 if took_it else 1), (first, reloads)


async def test_a_removed_run_stops_at_once_and_its_rollout_is_aborted_after_its_grace(
    tmp_path: Path,
) -> None:
    # one replica of 6 slots, three runs of 3: one does not fit until another leaves
    runs = [spec(tmp_path, n, remove_grace_s=0.5) for n in ("run-a", "run-b", "run-c")]
    slow = SimConfig(latency=LatencyModel(decode=0.1))  # 100 tokens: 10 s
    async with live(tmp_path, runs, n=1, sim=slow) as g:
        tenants = list(g.gateway.tenancy)
        waiting = next(t.name for t in tenants if not t.homes)
        leaving = next(t.name for t in tenants if t.homes)
        async with g.run(leaving) as gone, g.run(waiting) as later:
            r = await later.post("/v1/load_lora_adapter", json=load(tmp_path, waiting, 1))
            assert r.status_code == 507, r.text
            ok = await gone.post("/v1/load_lora_adapter", json=load(tmp_path, leaving, 1))
            assert ok.status_code == 200, ok.text
            body = {**COMPLETION, "model": "trl-policy-v1", "max_tokens": 100}
            running = asyncio.ensure_future(gone.post("/v1/completions", json=body))
            await eventually(lambda: g.tenant(leaving).in_flight == 1, "the rollout admitted")
            g.write([r for r in runs if r["name"] != leaving])
            reloaded = await g.reload()
            assert reloaded.status_code == 200 and reloaded.json()["removed"] == [leaving]
            assert (await gone.get("/v1/models")).status_code == 401  # at once
            async with g.admin() as admin:  # shown as leaving while it drains
                shown = (await admin.get("/gateway/status")).json()["runs"]
                metrics = (await admin.get("/metrics")).text
            assert {r["name"]: r["state"] for r in shown}[leaving] == "leaving"
            assert f'gateway_run_leaving{{run="{leaving}"}} 1.0' in metrics
            assert f'gateway_run_leaving{{run="{waiting}"}} 0.0' in metrics
            answer = await asyncio.wait_for(running, 10)
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            assert "was removed from the gateway" in answer.json()["error"]["message"]

            def freed() -> bool:
                held = g.replicas[0].app.state.sim.adapters
                return not g.gateway.tenancy.leaving and not any(
                    n.startswith(f"{leaving}~") for n in held
                )

            await eventually(freed, "the removed run's adapters unloaded and its slots freed")
            assert leaving not in [r["name"] for r in g.gateway.tenancy.status()]  # gone
            await eventually(lambda: bool(g.gateway.tenancy.tenants[waiting].homes),
                             "the run that did not fit placed")  # fmt: skip

            async def loads() -> bool:
                r = await later.post("/v1/load_lora_adapter", json=load(tmp_path, waiting, 1))
                return r.status_code == 200

            await eventually(loads, "the run that did not fit loads")


async def test_a_removed_runs_held_rollouts_are_answered_after_its_grace(tmp_path: Path) -> None:
    # removed while its scoped /pause holds a rollout: its key can no longer /resume, so
    # the held rollout is answered (503) once the grace is over, not held for ever
    a, b = spec(tmp_path, "run-a", remove_grace_s=0.3), spec(tmp_path, "run-b")
    async with live(tmp_path, [a, b]) as g, g.run("run-a") as ra:
        assert (await ra.post("/pause", params={"mode": "keep"})).status_code == 200
        body = {**COMPLETION, "model": "tiny-base"}
        held = asyncio.ensure_future(ra.post("/v1/completions", json=body))
        await eventually(lambda: g.tenant("run-a").in_flight == 1, "the rollout held")
        g.write([b])
        assert (await g.reload()).json()["removed"] == ["run-a"]
        answer = await asyncio.wait_for(held, 10)
        assert answer.status_code == 503 and "removed" in answer.json()["error"]["message"]
        await eventually(lambda: not g.gateway.tenancy.leaving, "run-a gone")


async def test_a_run_moved_off_a_replica_finishes_its_rollouts_there_first(
    tmp_path: Path,
) -> None:
    """A joining run takes a home of a kept run: what the kept run already sent there
    (routed before the move, maybe still on its way) finishes before its adapter is
    unloaded from that replica, so none of it meets a 404. The reload's answer waits for
    that, up to ``adapter_unload_grace_s``."""
    a, b, c = (spec(tmp_path, n) for n in ("run-a", "run-b", "run-c"))
    slow = SimConfig(latency=LatencyModel(decode=0.05))  # 30 tokens: 1.5 s
    async with live(tmp_path, [a, b], sim=slow) as g:
        for name in ("run-a", "run-b"):
            async with g.run(name) as client:
                r = await client.post("/v1/load_lora_adapter", json=load(tmp_path, name, 1))
                assert r.status_code == 200, r.text
        tenancy = g.gateway.tenancy
        assert tenancy.placement is not None
        after = place(tenancy.placement, {**tenancy.placement.slots, "run-c": 3},
                      tenancy.placement.budgets)  # fmt: skip
        assert isinstance(after, Placement)
        ((mover, lost),) = [(m.run, m.replica) for m in diff(tenancy.placement, after)
                            if m.change is Change.LOSE]  # fmt: skip
        body = {**COMPLETION, "model": "trl-policy-v1", "max_tokens": 30}
        async with g.run(mover) as client:
            sent = []
            for i in range(8):  # until one of them runs on the replica the mover will lose
                one = {**body, "prompt": [i + 1] * 40}
                sent.append(asyncio.ensure_future(client.post("/v1/completions", json=one)))
                await eventually(lambda n=i: g.tenant(mover).in_flight == n + 1, "sent")
                if g.tenant(mover).manager.in_flight_on(lost):
                    break
            assert g.tenant(mover).manager.in_flight_on(lost), "none went to that replica"
            g.write([a, b, c])
            r = await g.reload()
            assert r.status_code == 200 and r.json()["added"] == ["run-c"], r.text
            assert all(task.done() for task in sent)  # drained before the reload answered
            assert [t.result().status_code for t in sent] == [200] * len(sent)
        assert lost not in g.tenant(mover).homes
        held = [n for n in g.replicas[lost].app.state.sim.adapters if n.startswith(f"{mover}~")]
        assert not held, held


async def test_a_larger_budget_places_the_run_that_did_not_fit(tmp_path: Path) -> None:
    runs = [spec(tmp_path, n) for n in ("run-a", "run-b", "run-c")]
    async with live(tmp_path, runs, n=1) as g:
        waiting = next(t.name for t in g.gateway.tenancy if not t.homes)
        g.write(runs, lora_slots_per_replica=9)
        r = await g.reload()
        assert r.status_code == 200 and r.json()["outcome"] == "applied", r.text
        assert r.json()["unplaced"] == {} and g.tenant(waiting).homes == {0}
        async with g.run(waiting) as client:
            loaded = await client.post("/v1/load_lora_adapter", json=load(tmp_path, waiting, 1))
            assert loaded.status_code == 200, loaded.text
        assert (await g.reload()).json()["outcome"] == "unchanged"


async def test_a_rotated_key_works_for_its_overlap_then_stops(tmp_path: Path) -> None:
    # The overlap outlasts two stalls of a loaded machine (STALL_S) between the reload's
    # answer and the old key's first use, so the first check cannot race the expiry.
    overlap_s = 2 * STALL_S
    a = spec(tmp_path, "run-a", key_overlap_s=overlap_s)
    async with live(tmp_path, [a]) as g:
        g.write([{**a, "key": "key-run-a-2"}])
        r = await g.reload()
        assert r.status_code == 200 and r.json()["rotated"] == ["run-a"], r.text
        async with g.run("run-a") as old, g.run("run-a", "key-run-a-2") as new:
            assert (await old.get("/v1/models")).status_code == 200
            assert (await new.get("/v1/models")).status_code == 200

            async def refused() -> bool:
                return (await old.get("/v1/models")).status_code == 401

            await eventually(refused, "the old key refused after its overlap",
                             timeout=overlap_s + STALL_S)  # fmt: skip
            assert (await new.get("/v1/models")).status_code == 200


async def test_an_invalid_reload_keeps_the_old_set_and_says_why(tmp_path: Path) -> None:
    a, b = spec(tmp_path, "run-a"), spec(tmp_path, "run-b", max_in_flight=2)
    async with live(tmp_path, [a, b]) as g:
        cases = [
            ([a, {**b, "key": "key-run-a"}], "its own key"),
            ([a, {**b, "name": "Run_B"}], "runs[1].name"),
            ([a, {**b, "adapter_root": str(tmp_path)}], "adapter_root cannot change"),
            ([a, a], "run names must be unique"),
        ]
        for runs, why in cases:
            g.write(runs)
            r = await g.reload()
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert why in error["message"] and "the old one keeps serving" in error["message"]
            assert "key-run" not in r.text  # never a key
        async with g.run("run-b") as client:  # the old set serves
            assert (await client.get("/v1/models")).status_code == 200
        assert g.tenant("run-b").run.max_in_flight == 2
        async with g.run("run-a") as run_key, httpx.AsyncClient(base_url=g.url) as anonymous:
            assert (await run_key.post(RELOAD)).status_code == 401  # a run's key is no admin
            assert (await anonymous.post(RELOAD)).status_code == 401
            assert (await run_key.get(RELOAD)).status_code == 405
        async with g.admin() as admin:
            metrics = (await admin.get("/metrics")).text
        assert 'gateway_run_reloads_total{outcome="refused"} 4.0' in metrics


async def test_another_run_sees_only_200s_through_every_reload(tmp_path: Path) -> None:
    a, b = spec(tmp_path, "run-a"), spec(tmp_path, "run-b", remove_grace_s=0.2)
    async with live(tmp_path, [a], discovery_interval_s=0.2) as g, g.run("run-a") as ra:
        assert (await ra.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", 1))).is_success
        statuses: list[int] = []
        stop = asyncio.Event()

        async def stream() -> None:
            body = {**COMPLETION, "model": "trl-policy-v1", "stream": True}
            while not stop.is_set():
                async with ra.stream("POST", "/v1/completions", json=body) as r:
                    await r.aread()
                    statuses.append(r.status_code)

        streams = [asyncio.ensure_future(stream()) for _ in range(4)]
        try:
            g.write([a, b])  # added: the file watch
            await eventually(lambda: "run-b" in g.gateway.tenancy.tenants, "run-b added")
            async with g.run("run-b") as rb:
                assert (await rb.post("/v1/load_lora_adapter",
                                      json=load(tmp_path, "run-b", 1))).is_success  # fmt: skip
            g.write([a, {**b, "key": "key-run-b-2", "max_in_flight": 3}])
            assert (await g.reload()).json()["rotated"] == ["run-b"]  # rotated: the POST
            g.write([a])
            os.kill(os.getpid(), signal.SIGHUP)  # removed: SIGHUP
            await eventually(lambda: "run-b" not in g.gateway.tenancy.tenants, "run-b removed")
            await eventually(lambda: not g.gateway.tenancy.leaving, "run-b gone")
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            for task in streams:
                with suppress(asyncio.CancelledError):
                    await task
        assert len(statuses) > 10 and set(statuses) == {200}, statuses
        tenant = g.tenant("run-a")
        assert tenant.paused is None and tenant.homes == {0, 1}


async def test_runs_reload_live_on_every_worker_by_post_and_by_sighup(tmp_path: Path) -> None:
    """``serve --workers 2``: the owner applies a reload and sends every worker the new run
    set before it answers, so whichever worker a rollout reaches knows it: an added run
    rolls out, a rotated key works old and new, a removed run's key is refused. SIGHUP to
    the supervisor reaches the owner (it does not end the gateway)."""
    config = tmp_path / "gateway.yaml"
    a, b = spec(tmp_path, "run-a"), spec(tmp_path, "run-b")

    def write(runs: list[dict[str, Any]]) -> None:
        tmp = config.with_name("gateway.yaml.tmp")
        tmp.write_text(yaml.safe_dump({"runs": runs, "lora_slots_per_replica": 12,
                                       "admin_key": ADMIN}))  # fmt: skip
        os.replace(tmp, config)

    async def burst(run: str, key: str) -> set[int]:
        """A rollout on each of 16 fresh connections: both workers take some."""

        async def one() -> int:
            async with httpx.AsyncClient(base_url=fleet.url, auth=(run, key), timeout=30) as c:
                body = {**COMPLETION, "model": "tiny-base"}
                return (await c.post("/v1/completions", json=body)).status_code

        return set(await asyncio.gather(*(one() for _ in range(16))))

    async def reload() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as c:
            r = await c.post(RELOAD)
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = r.json()
            return answer

    write([a, b])
    # The file watch is left out (an hour between its reads): each reload here is the
    # POST's or SIGHUP's, so the POST's answer names what it applied (the watch taking a
    # change first made it answer "unchanged", once in CI). The watch has its own tests.
    args = ["--workers", "2", "--config", str(config), "--discovery-interval-s", "3600"]
    with sim_fleet(1, tmp_path, gateway_args=args) as fleet:
        assert await burst("run-a", "key-run-a") == {200}
        assert await burst("run-c", "key-run-c") == {401}  # not a run yet
        c, rotated = spec(tmp_path, "run-c"), {**b, "key": "key-run-b-2"}
        write([a, rotated, c])
        answer = await reload()
        assert (answer["added"], answer["rotated"]) == (["run-c"], ["run-b"]), answer
        assert await burst("run-c", "key-run-c") == {200}
        assert await burst("run-b", "key-run-b-2") == {200}
        assert await burst("run-b", "key-run-b") == {200}  # the overlap (60 s)
        write([rotated, c])
        assert (await reload())["removed"] == ["run-a"]
        assert await burst("run-a", "key-run-a") == {401}
        # SIGHUP to the supervisor: the owner reloads the file and tells the workers
        write([rotated, c, spec(tmp_path, "run-d")])
        assert fleet.gateway.popen is not None
        fleet.gateway.popen.send_signal(signal.SIGHUP)

        async def known() -> bool:
            return await burst("run-d", "key-run-d") == {200}

        await eventually(known, "run-d known to both workers after SIGHUP")
        assert fleet.gateway.popen.poll() is None  # the gateway lives on
        assert await burst("run-c", "key-run-c") == {200}
        # the owner dies: the one the supervisor starts reads the file's runs as they are
        # now (the gateway started with run-a and run-b), and the workers rejoin it
        async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as anyone:
            status = await anyone.get(
                "/gateway/status", headers={"Authorization": f"Bearer {ADMIN}"}
            )
            owner = status.json()["owner_pid"]
            os.kill(owner, signal.SIGKILL)

            async def restarted() -> bool:
                r = await anyone.get(
                    "/gateway/status", headers={"Authorization": f"Bearer {ADMIN}"}
                )
                return r.status_code == 200 and r.json()["owner_pid"] != owner

            await eventually(restarted, "a new owner")
            models = await anyone.get("/v1/models", auth=("run-d", "key-run-d"))
            assert models.status_code == 200, models.text  # the owner knows run-d
            assert (await anyone.get("/v1/models", auth=("run-a", "key-run-a"))).status_code == 401
        assert await burst("run-d", "key-run-d") == {200}


async def test_max_staleness_changes_live_and_a_window_too_wide_is_refused(
    tmp_path: Path,
) -> None:
    a = spec(tmp_path, "run-a")  # max_staleness 1: 3 of the 6 slots on each replica

    def held(version: int) -> list[bool]:
        name = f"run-a~trl-policy-v{version}"
        return [name in r.app.state.sim.adapters for r in g.replicas]

    async with live(tmp_path, [a]) as g, g.run("run-a") as ra:
        for v in (1, 2):
            r = await ra.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", v))
            assert r.status_code == 200, r.text
        assert held(1) == held(2) == [True, True]  # window [1, 2]
        # narrower: the version now outside [head - 0, head] is evicted at once
        g.write([{**a, "max_staleness": 0}])
        r = await g.reload()
        assert r.status_code == 200, r.text
        assert r.json()["max_staleness"] == ["run-a"] and r.json()["outcome"] == "applied"
        await eventually(lambda: held(1) == [False, False], "v1 evicted from both replicas")
        assert held(2) == [True, True]
        gen = await ra.post("/v1/completions", json={**COMPLETION, "model": "trl-policy-v2"})
        assert gen.status_code == 200, gen.text
        # wider, and it fits (5 slots of 6): nothing is evicted while the window fills
        g.write([{**a, "max_staleness": 3}])
        assert (await g.reload()).status_code == 200
        for v in (3, 4, 5):
            r = await ra.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", v))
            assert r.status_code == 200, r.text
        assert all(held(v) == [True, True] for v in (2, 3, 4, 5))
        assert g.tenant("run-a").run.max_staleness == 3
        # too wide for the budget (7 slots of 6): refused whole, the old window serves
        g.write([{**a, "max_staleness": 5}])
        r = await g.reload()
        assert r.status_code == 400, r.text
        assert "would no longer fit" in r.json()["error"]["message"]
        assert g.tenant("run-a").run.max_staleness == 3 and g.tenant("run-a").homes == {0, 1}
        async with g.admin() as admin:
            (run,) = (await admin.get("/gateway/status")).json()["runs"]
        assert run["max_staleness"] == 3


async def test_a_removed_runs_rollout_on_a_worker_is_aborted_after_its_grace(
    tmp_path: Path,
) -> None:
    """``serve --workers 2``: the worker that runs a removed run's rollout drains it, and
    past the run's ``remove_grace_s`` aborts it with the 503 the owner's own abort gives."""
    config = tmp_path / "gateway.yaml"
    a, b = spec(tmp_path, "run-a", remove_grace_s=0.5), spec(tmp_path, "run-b")
    config.write_text(yaml.safe_dump({"runs": [a, b], "lora_slots_per_replica": 12,
                                      "admin_key": ADMIN}))  # fmt: skip
    args = ["--workers", "2", "--config", str(config)]
    slow = ["--latency-model", "decode=0.1"]  # 100 tokens: 10 s
    with sim_fleet(1, tmp_path, gateway_args=args, sim_args=slow) as fleet:
        async with (
            httpx.AsyncClient(base_url=fleet.url, auth=("run-a", "key-run-a"), timeout=60) as ra,
            httpx.AsyncClient(base_url=fleet.url, headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=30) as admin,
        ):  # fmt: skip
            body = {**COMPLETION, "model": "tiny-base", "max_tokens": 100}
            rollout = asyncio.ensure_future(ra.post("/v1/completions", json=body))

            async def running() -> bool:
                r = await admin.get("/gateway/status")
                return sum(w["in_flight"] for w in r.json()["workers"]) == 1

            await eventually(running, "the rollout in flight on a worker")
            config.write_text(yaml.safe_dump({"runs": [b], "lora_slots_per_replica": 12,
                                              "admin_key": ADMIN}))  # fmt: skip
            r = await admin.post(RELOAD)
            assert r.status_code == 200 and r.json()["removed"] == ["run-a"], r.text
            answer = await asyncio.wait_for(rollout, 8)  # well before its 10 s
            assert answer.status_code == 503, answer.text
            assert "removed" in answer.json()["error"]["message"]
            assert answer.headers["retry-after"] == "1"
