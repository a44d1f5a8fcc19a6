"""The one-command demo: async LoRA GRPO through the gateway, learning on CPU.

    make demo                         (python -m rollout_testbed.demo)
    python -m rollout_testbed.demo --sim      (fast, torch-free: TRL-shaped traffic on sim replicas)

Real mode (the default), on a fresh machine after ``make vllm``:

1. builds the tiny local model (``.run/tiny-model``) if it is missing;
2. starts 2 real vLLM replicas (one per core, ``--logprobs-mode processed_logprobs`` so
   the returned logprobs are those of the temperature-scaled distribution the driver
   trains on) and the gateway in front of them, ``max_staleness`` on both sides;
3. runs the companion driver (``python -m trainer``, the vLLM venv's python) on the
   learnable ``digits`` task for a few minutes: async LoRA GRPO with TRL 1.16's exact
   wire protocol, adapters published through ``<out>/train/.vllm_lora``;
4. prints the driver's summary (reward first/last 10 steps, staleness, drops, sync time,
   the gateway's routing and adapter counters), writes the reward/staleness plot, and
   shows what each replica holds: live adapter versions and prefix-cache hit rate;
5. shuts everything down (only the processes it started, by process group).

Measured here (2 cores, venvs installed): 3 min 38 s end to end, reward 0.011 -> 0.554
(first vs last 10 of 80 steps), staleness <= 1, 0 samples dropped, both replicas holding
the two live versions, vLLM prefix-cache hit rate 0.82.

Sim mode is the previous demo: N sim replicas + the gateway in-process, a TRL-shaped
workload (pause / load / resume / unload per version, G separate ``n=1`` requests per
prompt), printing group co-location, per-replica load and adapters everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.config import load_settings
from rollout_testbed.local.vllm_env import checkout_root
from rollout_testbed.procs import Proc, free_port, free_ports, gateway_argv
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

GROUP = 8
SYSTEM = [random.Random(7).randrange(4, 2000) for _ in range(120)]


def prompt(rng: random.Random) -> list[int]:
    return SYSTEM + [rng.randrange(4, 2000) for _ in range(rng.randrange(40, 200))]


async def run_sim(replicas: int, steps: int, prompts_per_step: int, max_staleness: int) -> int:
    from trainer.payload import build_payload  # ``driver_missing`` put it on the path

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
                r = await client.post(
                    "/v1/completions",
                    json=build_payload(model, ids, max_tokens=16, seed=rng.getrandbits(63)),
                )
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


# ---------------------------------------------------------------------------------------
# Real mode: 2 vLLM replicas + gateway + the companion driver
# ---------------------------------------------------------------------------------------

# The driver (``python -m trainer``, run with the vLLM venv's python) comes from the checkout;
# so do the tiny model and the outputs, under .run/.
REPO = checkout_root() or Path.cwd()


def _prefix_cache_rate(url: str) -> float | None:
    from rollout_testbed.local.replicas import http_get

    try:
        status, body = http_get(url + "/metrics", timeout=10)
    except OSError:
        return None
    if status != 200:
        return None
    hits = queries = 0.0
    for line in body.decode().splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.split()[-1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.split()[-1])
    return hits / queries if queries else None


def _live_adapters(url: str) -> list[str]:
    from rollout_testbed.local.replicas import http_get

    try:
        status, body = http_get(url + "/v1/models", timeout=10)
    except OSError:
        return []
    if status != 200:
        return []
    return [str(m["id"]) for m in json.loads(body)["data"][1:]]


def start_gateway(urls: list[str], max_staleness: int, log: Path) -> tuple[Proc, str]:
    """The gateway as a subprocess of this python (its own process group); stop it with
    ``proc.stop(grace=15)``."""
    port = free_port()
    extra = ["--max-staleness", str(max_staleness), "--log-level", "WARNING"]
    url = f"http://127.0.0.1:{port}"
    proc = Proc("gateway", gateway_argv(port, urls, extra=extra), log, cwd=str(REPO), url=url)
    proc.start()
    try:
        proc.wait_http("/health", timeout=60, interval=0.2)
    except (RuntimeError, TimeoutError) as exc:
        proc.stop(grace=15)
        raise RuntimeError(f"gateway did not come up; see {log}") from exc
    return proc, url


def run_trainer(python: Path, args: list[str], log: Path | None = None,
                timeout: float = 3600.0) -> int:  # fmt: skip
    """``python -m trainer ARGS`` with the repository on PYTHONPATH; output streamed."""
    env = dict(os.environ, ROLLOUT_GATEWAY_TRAIN_NO_DELEGATE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VIRTUAL_ENV", None)
    extra = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + extra if extra else "")
    proc = Proc("trainer", [str(python), "-m", "trainer", *args], log, env=env, cwd=str(REPO),
                inherit_output=True)  # fmt: skip
    proc.start()
    assert proc.popen is not None
    try:
        return proc.popen.wait(timeout=timeout)
    finally:
        proc.stop(grace=15)


def ensure_plot(metrics: Path, png: Path, max_staleness: int) -> str | None:
    """Draw the reward/staleness PNG here when the driver's python had no matplotlib
    (this venv has it through the ``[bench]`` extra)."""
    from trainer.report import plot_curves, read_jsonl

    if not metrics.exists():
        return None
    title = "digits: async LoRA GRPO, 2 vLLM replicas behind the gateway"
    out = plot_curves(read_jsonl(metrics), png, title=title, max_staleness=max_staleness)
    return str(out) if out else None


def trainer_args(model_dir: Path, url: str, out: Path, *, steps: int, duration_s: float,
                 max_staleness: int, seed: int) -> list[str]:  # fmt: skip
    return [
        "--gateway", url, "--model", str(model_dir), "--task", "digits",
        "--output-dir", str(out), "--max-steps", str(steps), "--max-duration-s", str(duration_s),
        "--max-staleness", str(max_staleness), "--seed", str(seed), "--save-steps", "20",
        "--learning-rate", "1e-2", "--epsilon-high", "0.28",
    ]  # fmt: skip


def run_real(*, replicas: int, steps: int, duration_s: float, max_staleness: int, seed: int,
             out: Path) -> int:  # fmt: skip
    from rollout_testbed.local.replicas import (
        ReplicaError,
        start_replicas,
        stop_replicas,
    )
    from rollout_testbed.local.vllm_env import VllmNotInstalledError, check_vllm_python

    t0 = time.monotonic()
    if not (REPO / "trainer" / "__main__.py").is_file():
        print(
            f"demo: the real demo runs the driver from a checkout of the repository; "
            f"{REPO} has no trainer/ (run `make demo` from the checkout)",
            file=sys.stderr,
        )
        return 2
    try:
        python = check_vllm_python(None)
    except VllmNotInstalledError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    model_dir = REPO / ".run" / "tiny-model"
    out = out.resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)  # a fresh run each time: numbering restarts at v1
    out.mkdir(parents=True)
    print(f"[demo] starting {replicas} vLLM replicas (cold start ~1 min) ...", flush=True)
    try:
        rs = start_replicas(
            replicas, model_dir, ports=free_ports(replicas), max_staleness=max_staleness,
            state_file=out / "replicas.json", vllm_python=python, timeout=600,
            extra_args=["--logprobs-mode", "processed_logprobs"],
        )  # fmt: skip
    except (ReplicaError, OSError) as exc:
        print(f"demo: replicas failed to start: {exc}", file=sys.stderr)
        return 1
    gw: Proc | None = None
    try:
        print(f"[demo] replicas up in {time.monotonic() - t0:.0f} s: {rs.urls}", flush=True)
        gw, url = start_gateway(rs.urls, max_staleness, out / "gateway.log")
        print(f"[demo] gateway {url}; driver: {steps} steps or {duration_s:.0f} s", flush=True)
        train_dir = out / "train"
        rc = run_trainer(python, trainer_args(model_dir, url, train_dir, steps=steps,
                                              duration_s=duration_s, seed=seed,
                                              max_staleness=max_staleness))  # fmt: skip
        print()
        for i, u in enumerate(rs.urls):
            rate = _prefix_cache_rate(u)
            shown = f"{rate:.3f}" if rate is not None else "n/a"
            print(f"replica {i}: live adapters {_live_adapters(u)}, prefix-cache hit rate {shown}")
        written = train_dir / "summary.json"
        summary = json.loads(written.read_text()) if rc in (0, 1) and written.is_file() else {}
        if not summary:
            print(f"demo: the driver exited with {rc} and no summary; see its output above")
        if summary and not summary.get("plot_file"):
            summary["plot_file"] = ensure_plot(train_dir / "metrics.jsonl",
                                               train_dir / "curves.png", max_staleness)  # fmt: skip
        first, last = summary.get("reward_first10", 0.0), summary.get("reward_last10", 0.0)
        ok = rc == 0 and last > first
        print(f"plot: {summary.get('plot_file')}")
        print(f"reward {first:.3f} -> {last:.3f} (first vs last 10 steps)")
        print(f"demo {'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s")
        return 0 if ok else 1
    finally:
        if gw is not None:
            gw.stop(grace=15)
        stop_replicas(rs)
        print(f"[demo] shut down; total {time.monotonic() - t0:.0f} s", flush=True)


def driver_missing() -> str | None:
    """Both modes use the repository's ``trainer/`` (the sim mode its request body, the
    real mode the whole driver). It is not packaged (a top-level ``trainer`` in
    site-packages would shadow any other), so it comes from the checkout: importable
    already (an editable install), or put on the path from ``REPO`` (the checkout this
    package lives in, else the working directory). None when found, else the one line to
    print."""
    if importlib.util.find_spec("trainer") is None and (REPO / "trainer" / "payload.py").is_file():
        sys.path.insert(0, str(REPO))
    if importlib.util.find_spec("trainer") is not None:
        return None
    return (
        "rollout-testbed demo: needs a checkout of rollout-gateway (its trainer/ is the "
        "demo's driver and is not installed by pip): run it from the checkout's top "
        "directory (`rollout-testbed demo --sim`, or `make demo`)"
    )


def main(argv: list[str] | None = None) -> int:
    description = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="rollout-testbed demo", description=description)
    p.add_argument("--sim", action="store_true", help="fast torch-free sim mode")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="sim: versions; real: driver steps")
    p.add_argument("--prompts-per-step", type=int, default=16, help="sim mode only")
    p.add_argument("--duration-s", type=float, default=300.0, help="real: driver time cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / ".run" / "demo")
    args = p.parse_args(argv)
    if missing := driver_missing():
        print(missing, file=sys.stderr)
        return 2
    if args.sim:
        steps = 6 if args.steps is None else args.steps
        return asyncio.run(run_sim(args.replicas, steps, args.prompts_per_step, args.max_staleness))
    return run_real(replicas=args.replicas, steps=args.steps or 80, duration_s=args.duration_s,
                    max_staleness=args.max_staleness, seed=args.seed, out=args.out)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
