"""A /metrics sample of a gateway (and of a sim replica) that has served every kind of
traffic, so each metric family the gateway exports has samples, and of a multi-run gateway
(docs/many-runs.md) whose runs served a little traffic, so the per-run families have
samples too, and of the single-run gateway while a fleet-wide /pause holds (the pause
gauges' other state): shared by the promtool, dashboard and alert-rule checks."""

from __future__ import annotations

import asyncio
import functools
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.cluster import Cluster, cluster

_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)")


async def drive_load(c: Cluster, *, groups: int = 4, versions: int = 3, base: int = 1) -> None:
    """GRPO-shaped traffic: a few adapter versions published (with staleness evictions),
    groups of 8 identical prompts on the newest one, a pause/resume, a stream."""
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as client:
        for v in range(base, base + versions):
            r = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": f"policy-v{v}", "lora_path": f"/adapters/policy-v{v}"},
            )
            assert r.status_code == 200, r.text
            prompts = [f"step {v} question {g}: " + "context " * 40 for g in range(groups)]
            body = {"model": f"policy-v{v}", "max_tokens": 8}
            sends = [
                client.post("/v1/completions", json={**body, "prompt": p})
                for p in prompts
                for _ in range(8)
            ]
            for r in await asyncio.gather(*sends):
                assert r.status_code == 200, r.text
        assert (await client.post("/pause")).status_code == 200
        assert (await client.post("/resume")).status_code == 200
        body = {"model": f"policy-v{base + versions - 1}", "prompt": "s", "max_tokens": 4,
                "stream": True}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            async for _ in s.aiter_bytes():
                pass
        await client.get("/v1/models")
        await client.get("/health")


# Multi-run sample: 2 replicas of 3 adapter slots, runs of 3 slots (max_staleness 1), so
# two runs get one home each and the third does not fit (home replicas 0).
RUNS = ("run-a", "run-b", "run-c")
SLOTS_PER_REPLICA = 3


async def drive_runs(c: Cluster, root: Path, run: str) -> str:
    """One run's TRL-shaped traffic: a load, a completion, a scoped pause (its /metrics
    while paused is returned) and a resume, then a stream."""
    async with httpx.AsyncClient(base_url=c.url, auth=(run, f"key-{run}"), timeout=30) as client:
        load = {"lora_name": "trl-policy-v1", "lora_path": f"{root}/{run}/v1"}
        r = await client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        body = {"model": "trl-policy-v1", "prompt": "step 1: " + "context " * 20, "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        paused = (await client.get("/metrics")).text
        assert (await client.post("/resume")).status_code == 200
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            async for _ in s.aiter_bytes():
                pass
        await client.get("/v1/models")
    return paused


@dataclass(frozen=True)
class Sample:
    gateway: str  # single-run mode (no ``runs`` configured)
    replica: str
    multi_run: str  # multi-run mode, after drive_runs
    multi_run_paused: str  # multi-run mode, while one run's scoped pause held
    gateway_paused: str = ""  # single-run mode, while a fleet-wide /pause held

    @property
    def gateway_names(self) -> set[str]:
        """Every name either mode of the gateway exports."""
        return self.names(self.gateway) | self.names(self.multi_run)

    @staticmethod
    def names(text: str) -> set[str]:
        """Sample names (with _bucket/_sum/_count/_total suffixes) and family names."""
        out = set()
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                out.add(line.split()[2])
            elif line and not line.startswith("#") and (m := _NAME.match(line)):
                out.add(m.group(1))
        return out


async def _collect_multi_run() -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = []
        for name in RUNS:
            (root / name).mkdir()
            runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(root / name),
                         "max_staleness": 1})  # fmt: skip
        async with cluster(2, runs=runs, lora_slots_per_replica=SLOTS_PER_REPLICA) as c:
            placed = sorted(t.name for t in c.gateway.tenancy if t.homes)
            assert len(placed) == 2, placed
            paused = await drive_runs(c, root, placed[0])
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.get(c.url + "/metrics")).text, paused


async def _collect() -> Sample:
    async with cluster(2, max_staleness=1) as c:
        await drive_load(c)
        async with httpx.AsyncClient(timeout=10) as client:
            gw = (await client.get(c.url + "/metrics")).text
            rep = (await client.get(c.replica_urls[0] + "/metrics")).text
            assert (await client.post(c.url + "/pause")).status_code == 200
            gw_paused = (await client.get(c.url + "/metrics")).text
            assert (await client.post(c.url + "/resume")).status_code == 200
    multi, paused = await _collect_multi_run()
    return Sample(gw, rep, multi, paused, gw_paused)


@functools.cache
def metrics_sample() -> Sample:
    return asyncio.run(_collect())
