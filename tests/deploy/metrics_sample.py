"""A /metrics sample of a gateway (and of a sim replica) that has served every kind of
traffic, so each metric family the gateway exports has samples: shared by the promtool,
dashboard and alert-rule checks."""

from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Sample:
    gateway: str
    replica: str

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


async def _collect() -> Sample:
    async with cluster(2, max_staleness=1) as c:
        await drive_load(c)
        async with httpx.AsyncClient(timeout=10) as client:
            gw = (await client.get(c.url + "/metrics")).text
            rep = (await client.get(c.replica_urls[0] + "/metrics")).text
        return Sample(gw, rep)


@functools.cache
def metrics_sample() -> Sample:
    return asyncio.run(_collect())
