"""The one-command demo: a TRL-shaped async GRPO run through the gateway, on sim replicas.

    make demo        (or: python -m gateway.demo [--replicas 2] [--steps 6])

What it does, exactly as TRL 1.16's AsyncGRPOTrainer would on the wire
(``shared/reference/trl-wire.md``):

1. starts N simulated vLLM replicas and the gateway on 127.0.0.1 (real sockets);
2. checks ``/server_info`` says ``data_parallel_size == 1`` with a ``lora_config``;
3. for each policy version: ``/pause?mode=keep``, ``/v1/load_lora_adapter`` (all or
   nothing on every replica), ``/resume``, then unloads ``v(N - max_staleness - 1)``;
4. between syncs, sends rollouts: P prompts x G=8 *separate* ``n=1`` token-id completion
   requests that share a system prefix, 16 in flight, with TRL's exact payload;
5. prints what the gateway did: group co-location, per-replica load, the replicas' own
   prefix-cache hit rate, adapters listed everywhere, and routing decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections import Counter, defaultdict
from typing import Any

import httpx

from gateway.app import create_app
from gateway.config import load_settings
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from gateway.sim.latency import LatencyModel
from gateway.testing import serve_asgi

GROUP = 8
SYSTEM = [random.Random(7).randrange(4, 2000) for _ in range(120)]


def prompt(rng: random.Random) -> list[int]:
    return SYSTEM + [rng.randrange(4, 2000) for _ in range(rng.randrange(40, 200))]


def rollout_payload(model: str, ids: list[int], rng: random.Random) -> dict[str, Any]:
    return {  # TRL 1.16 _generate_one_turn, key for key
        "model": model, "prompt": ids, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True,
        "logprobs": 0, "seed": rng.getrandbits(63),
    }  # fmt: skip


async def run(replicas: int, steps: int, prompts_per_step: int, max_staleness: int) -> int:
    sim = SimConfig(max_loras=max_staleness + 2, latency=LatencyModel(prefill=2e-5, decode=5e-4))
    rng = random.Random(0)
    async with contextlib.AsyncExitStack() as stack:
        sims = [create_sim_app(sim) for _ in range(replicas)]
        urls = [await stack.enter_async_context(serve_asgi(app)) for app in sims]
        settings = load_settings(
            {"replicas": urls, "max_staleness": max_staleness, "health_interval_s": 1.0},
            environ={},
        )
        url = await stack.enter_async_context(serve_asgi(create_app(settings)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        print(f"gateway {url} in front of {replicas} sim replicas")

        info = (await client.get("/server_info", params={"config_format": "json"})).json()
        cfg = info["vllm_config"]
        print(f"/server_info: data_parallel_size={cfg['parallel_config']['data_parallel_size']}"
              f" lora_config={cfg['lora_config']}")  # fmt: skip

        placement: dict[int, Counter[str]] = defaultdict(Counter)
        failures = 0
        sem = asyncio.Semaphore(16)

        async def one(model: str, group: int, ids: list[int]) -> None:
            nonlocal failures
            async with sem:
                r = await client.post("/v1/completions", json=rollout_payload(model, ids, rng))
            if r.status_code != 200:
                failures += 1
                return
            placement[group][r.headers["x-gateway-replica"]] += 1

        group_id = 0
        for version in range(1, steps + 1):
            name = f"trl-policy-v{version}"
            for call in (
                client.post("/pause", params={"mode": "keep"}),
                client.post("/v1/load_lora_adapter", json={
                    "lora_name": name, "lora_path": f"/tmp/demo/.vllm_lora/{name}",
                    "load_inplace": False}),
                client.post("/resume"),
            ):  # fmt: skip
                r = await call
                if r.status_code != 200:
                    print(f"sync of {name} failed: {r.status_code} {r.text}", file=sys.stderr)
                    return 1
            old = version - max_staleness - 1
            if old >= 1:
                await client.post(
                    "/v1/unload_lora_adapter", json={"lora_name": f"trl-policy-v{old}"}
                )
            tasks = []
            for _ in range(prompts_per_step):
                ids = prompt(rng)
                tasks += [one(name, group_id, ids) for _ in range(GROUP)]
                group_id += 1
            await asyncio.gather(*tasks)
            print(f"  v{version}: published to every replica, {prompts_per_step * GROUP} rollouts")

        await asyncio.sleep(0.6)  # let the adapter manager apply deferred unloads
        together = sum(1 for c in placement.values() if len(c) == 1)
        served = Counter(r for c in placement.values() for r in c.elements())
        hits = sum(app.state.sim.cache.hits_tokens for app in sims)
        queries = sum(app.state.sim.cache.queries_tokens for app in sims)
        models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        per_replica = [sorted(app.state.sim.adapters) for app in sims]
        status = (await client.get("/gateway/status")).json()
        print()
        print(f"rollouts: {sum(served.values())} ok, {failures} failed")
        print(f"groups on one replica: {together}/{len(placement)}")
        print(f"requests per replica: {dict(sorted(served.items()))}")
        print(f"replica prefix-cache hit rate: {hits / max(queries, 1):.3f} (tokens)")
        print(f"/v1/models through the gateway: {models}")
        print(f"adapters on each replica: {per_replica}")
        print(f"routing decisions: {status['routing']}")
        ok = failures == 0 and together == len(placement)
        print("demo OK" if ok else "demo FAILED")
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.demo", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-staleness", type=int, default=2)
    args = p.parse_args(argv)
    return asyncio.run(run(args.replicas, args.steps, args.prompts_per_step, args.max_staleness))


if __name__ == "__main__":
    sys.exit(main())
