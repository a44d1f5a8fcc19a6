"""A restarted multi-run gateway takes every run's adapters back from the replicas, as a
single-run one does (``docs/many-runs.md``): the registry is rebuilt from the replicas'
own ``/v1/models``, so TRL's next rollout and sync find their versions live."""

from __future__ import annotations

from pathlib import Path

import httpx
from rollout_testbed.serve import serve_asgi

from gateway.app import create_app
from gateway.config import load_settings
from tests.cluster import sims
from tests.eventually import eventually
from tests.runs.test_many_runs import COMPLETION, load, run_specs


async def test_a_restarted_gateway_adopts_every_runs_adapters(tmp_path: Path) -> None:
    async with sims(2) as replicas:
        overrides = {"replicas": [r.url for r in replicas], "runs": run_specs(tmp_path),
                     "lora_slots_per_replica": 9}  # fmt: skip
        for restart in (False, True):
            app = create_app(load_settings(overrides, environ={}))
            async with serve_asgi(app) as url:
                for name in ("run-a", "run-b"):
                    auth = (name, f"key-{name}")
                    async with httpx.AsyncClient(base_url=url, auth=auth, timeout=10) as c:
                        if not restart:
                            r = await c.post("/v1/load_lora_adapter", json=load(tmp_path, name, 1))
                            assert r.status_code == 200, r.text
                            continue

                        async def live(c: httpx.AsyncClient = c) -> bool:
                            models = (await c.get("/v1/models")).json()["data"]
                            return "trl-policy-v1" in [m["id"] for m in models]

                        await eventually(live, "the run's adapter live again after the restart")
                        rollout = {**COMPLETION, "model": "trl-policy-v1"}
                        gen = await c.post("/v1/completions", json=rollout)
                        assert gen.status_code == 200, gen.text
        held = [sorted(r.app.state.sim.adapters) for r in replicas]
        assert all("run-a~trl-policy-v1" in h and "run-b~trl-policy-v1" in h for h in held), held
