"""A run's ``lora_path`` is checked on the gateway and the replicas are sent the path it
resolved to (real sockets, sim replicas that read the path): a symlink inside the run's
root cannot redirect a replica once checked, and a path resolving outside the root is
refused (docs/many-runs.md, "Trust model between runs")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.config import SimConfig

from gateway.app import create_app
from gateway.config import load_settings
from tests.cluster import Cluster, sims
from tests.eventually import eventually
from tests.runs.test_many_runs import COMPLETION, as_run, shared

READS_PATHS = SimConfig(check_lora_paths=True)  # "No adapter found" unless a directory


def _adapter_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """run-a's ``current`` symlink to its ``gen1`` (holding ``v1``), and a lookalike in
    run-b's root."""
    (tmp_path / "run-a" / "gen1" / "v1").mkdir(parents=True)
    (tmp_path / "run-b" / "v1").mkdir(parents=True)
    (tmp_path / "run-a" / "current").symlink_to(tmp_path / "run-a" / "gen1")
    return tmp_path / "run-a" / "current" / "v1", tmp_path / "run-a" / "gen1" / "v1"


def _sent(c: Cluster, name: str) -> set[str]:
    """The paths the replicas holding ``name`` were asked to read."""
    return {c.sim(i).adapters[name].path for i in (0, 1) if name in c.sim(i).adapters}


async def test_a_symlinked_path_is_sent_resolved(tmp_path: Path) -> None:
    async with shared(tmp_path, sim_config=READS_PATHS) as c, as_run(c, "run-a") as a:
        given, real = _adapter_dirs(tmp_path)
        r = await a.post("/v1/load_lora_adapter",
                         json={"lora_name": "trl-policy-v1", "lora_path": str(given)})  # fmt: skip
        assert r.status_code == 200, r.text
        assert _sent(c, "run-a~trl-policy-v1") == {str(real)}
        models = (await a.get("/v1/models")).json()["data"]
        assert {m["id"]: m["root"] for m in models if m.get("parent")} == {
            "trl-policy-v1": str(real)
        }


async def test_a_path_resolving_outside_the_runs_root_is_refused(tmp_path: Path) -> None:
    async with shared(tmp_path, sim_config=READS_PATHS) as c, as_run(c, "run-a") as a:
        _adapter_dirs(tmp_path)
        (tmp_path / "run-a" / "escape").symlink_to(tmp_path / "run-b")
        (tmp_path / "run-a" / "loop").symlink_to(tmp_path / "run-a" / "loop")
        for path, why in (
            (tmp_path / "run-a" / "escape" / "v1", "resolves outside the allowed adapter roots"),
            (tmp_path / "run-a" / ".." / "run-b" / "v1", "resolves outside"),
            (tmp_path / "run-a" / "loop" / "v1", "cannot be resolved"),
        ):
            body = {"lora_name": "trl-policy-v1", "lora_path": str(path)}
            r = await a.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "lora_path" and why in error["message"], error
        assert c.sim(0).stats.loads == c.sim(1).stats.loads == []  # nothing went upstream


async def test_a_file_symlinked_out_of_the_runs_root_is_refused(tmp_path: Path) -> None:
    async with shared(tmp_path, sim_config=READS_PATHS) as c, as_run(c, "run-a") as a:
        _, real = _adapter_dirs(tmp_path)
        (tmp_path / "run-b" / "v1" / "adapter_model.safetensors").write_bytes(b"run-b's")
        (tmp_path / "run-a" / "shared.json").write_text("{}")
        (real / "adapter_config.json").symlink_to(tmp_path / "run-a" / "shared.json")  # inside
        body = {"lora_name": "trl-policy-v1", "lora_path": str(real)}
        assert (await a.post("/v1/load_lora_adapter", json=body)).status_code == 200
        (tmp_path / "run-a" / "gen1" / "v2").mkdir()
        stolen = tmp_path / "run-a" / "gen1" / "v2" / "adapter_model.safetensors"
        stolen.symlink_to(tmp_path / "run-b" / "v1" / "adapter_model.safetensors")
        body = {"lora_name": "trl-policy-v2", "lora_path": str(stolen.parent)}
        r = await a.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_path"
        assert "'adapter_model.safetensors', a symlink that resolves outside" in error["message"]
        assert "trl-policy-v2" not in str(c.sim(0).stats.loads + c.sim(1).stats.loads)


async def test_a_swap_after_the_check_does_not_redirect_the_replicas(tmp_path: Path) -> None:
    """The replicas read the path late and maybe more than once: here the first two
    attempts find nothing (mount lag) and the run points its symlink at run-b's root
    meanwhile; every attempt, and the copy loaded, still reads what was checked."""
    async with shared(tmp_path, sim_config=READS_PATHS) as c, as_run(c, "run-a") as a:
        given, real = _adapter_dirs(tmp_path)
        homes = sorted(c.gateway.tenancy.tenants["run-a"].homes)
        for i in homes:
            c.sim(i).faults.load_not_found = 2
        body = {"lora_name": "trl-policy-v1", "lora_path": str(given)}
        loading = asyncio.ensure_future(a.post("/v1/load_lora_adapter", json=body))
        await eventually(lambda: len(c.sim(homes[0]).stats.loads) >= 1, "a first attempt")
        current = tmp_path / "run-a" / "current"
        current.unlink()
        current.symlink_to(tmp_path / "run-b")  # after the check, before the replica reads
        r = await asyncio.wait_for(loading, 30)
        assert r.status_code == 200, r.text
        assert all(len(c.sim(i).stats.loads) >= 3 for i in homes)  # retried: read 3 times
        assert _sent(c, "run-a~trl-policy-v1") == {str(real)}


async def test_resolved_paths_survive_a_gateway_restart_and_a_same_path_reload(
    tmp_path: Path,
) -> None:
    """The registry is rebuilt from the replicas' ``/v1/models`` roots, which are the
    resolved paths: after a restart the adapter is live again, and a reload of the same
    client path is the same resolved path, loaded again in place rather than refused.
    Single-run mode with ``adapter_roots`` (a multi-run restart's adoption:
    ``tests/runs/test_restart_adopts.py``)."""
    given, real = _adapter_dirs(tmp_path)
    body = {"lora_name": "trl-policy-v1", "lora_path": str(given)}
    async with sims(2, READS_PATHS) as replicas:
        overrides = {"replicas": [r.url for r in replicas],
                     "adapter_roots": [str(tmp_path / "run-a")]}  # fmt: skip
        for restart in (False, True):
            app = create_app(load_settings(overrides, environ={}))
            async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as a:
                if not restart:
                    assert (await a.post("/v1/load_lora_adapter", json=body)).status_code == 200
                    continue
                models = (await a.get("/v1/models")).json()["data"]
                assert [(m["id"], m["root"]) for m in models if m.get("parent")] == [
                    ("trl-policy-v1", str(real))
                ]
                gen = await a.post("/v1/completions",
                                   json={**COMPLETION, "model": "trl-policy-v1"})  # fmt: skip
                assert gen.status_code == 200, gen.text
                r = await a.post("/v1/load_lora_adapter", json={**body, "load_inplace": True})
                assert r.status_code == 200, r.text
        for replica in replicas:
            assert replica.app.state.sim.adapters["trl-policy-v1"].path == str(real)
