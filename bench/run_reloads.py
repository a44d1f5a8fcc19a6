"""What a live reload of the run set costs the other runs (issue 29): run B's rollout
latency while run C joins and leaves every few seconds, against B alone, side by side.

One gateway process (``serve --config``, multi-run mode, 2 simulated replicas) serves run
B, which keeps ``--concurrency`` rollouts in flight naming its adapter (a GRPO group's
worth, closed loop). Measurements alternate, ``--rounds`` times each, in one process: a
*quiet* window (no reload) and a *reloading* window, in which a thread rewrites the
config file with run C added, posts ``/gateway/runs/reload`` with the admin key, loads an
adapter for C, sends it a rollout, then rewrites the file without C and reloads again,
every ``--period-s``. Reports B's p50 / p99 and errors per window kind, the ratio of the
medians over rounds, and every reload's outcome.

    .venv/bin/python bench/run_reloads.py     # writes bench/results/run-reloads.{json,md}
    .venv/bin/python bench/run_reloads.py --workers 2   # run-reloads-workers2.{json,md}

With ``--workers N`` the gateway is ``serve --workers N``: the owner applies each reload
and sends every worker the new run set before it answers; B's rollouts are spread over
the workers (a fresh connection per rollout, so the kernel spreads them).

Simulated replicas answer at once, so B's latency is the gateway's own: what a reload's
work (validation, placement, a run's manager built or drained, adapters unloaded) takes
from a run that is busy. Only 127.0.0.1; only processes started here are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from rollout_testbed.local import replicas as R
from rollout_testbed.procs import Proc, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.lib
from bench.lib import report
from bench.lib.percentile import pct

ADMIN = "bench-admin-key"
PROMPT = list(range(1, 97))


def config(root: Path, with_c: bool) -> str:
    runs = [{"name": "run-b", "key": "key-b", "adapter_root": str(root / "b"), "max_staleness": 1}]
    if with_c:
        runs.append(
            {"name": "run-c", "key": "key-c", "adapter_root": str(root / "c"), "max_staleness": 1}
        )
    return yaml.safe_dump({"admin_key": ADMIN, "lora_slots_per_replica": 8, "runs": runs})


async def load_b(
    url: str, seconds: float, concurrency: int, fresh: bool = False
) -> tuple[list[float], int]:
    """B's closed loop for ``seconds``: latencies (ms) and errors. ``fresh``: a new
    connection per rollout (``--workers N``: the kernel spreads them over the workers)."""
    lat: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    body = {"model": "trl-policy-v1", "prompt": PROMPT, "max_tokens": 8}
    limits = httpx.Limits(max_keepalive_connections=0) if fresh else httpx.Limits()
    async with httpx.AsyncClient(
        base_url=url, auth=("run-b", "key-b"), timeout=30, limits=limits
    ) as c:

        async def one() -> None:
            nonlocal errors
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    r = await c.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                lat.append((time.perf_counter() - t0) * 1000)
                errors += not ok

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return lat, errors


def reloader(
    url: str,
    cfg: Path,
    root: Path,
    period: float,
    stop: threading.Event,
    outcomes: list[dict[str, Any]],
) -> None:
    """Run C joins (and is used) then leaves, every ``period`` seconds, until ``stop``."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    run_c = httpx.Client(base_url=url, auth=("run-c", "key-c"), timeout=60)
    with_c = False
    while not stop.wait(period / 2):
        with_c = not with_c
        cfg.write_text(config(root, with_c))
        t0 = time.perf_counter()
        r = admin.post("/gateway/runs/reload")
        took = (time.perf_counter() - t0) * 1000
        answer = r.json().get("outcome") if r.status_code == 200 else r.text[:200]
        outcomes.append(
            {"with_c": with_c, "status": r.status_code, "ms": round(took, 1), "outcome": answer}
        )
        if with_c and r.status_code == 200:
            body = {"lora_name": "trl-policy-v1", "lora_path": str(root / "c" / "v1")}
            run_c.post("/v1/load_lora_adapter", json=body)
            run_c.post(
                "/v1/completions",
                json={"model": "trl-policy-v1", "prompt": PROMPT, "max_tokens": 8},
            )
    admin.close()
    run_c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--period-s", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out-stem", default=None, help="default: run-reloads[-workersN]")
    args = p.parse_args(argv)
    if args.out_stem is None:
        args.out_stem = "run-reloads" + (f"-workers{args.workers}" if args.workers > 1 else "")
    meta = report.machine_info(
        ("rollout-gateway",),
        **vars(args),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    windows: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="run-reloads-") as tmp:
        root = Path(tmp)
        for d in ("b", "c"):
            (root / d / "v1").mkdir(parents=True)
        cfg = root / "gateway.yaml"
        cfg.write_text(config(root, False))
        sims = R.start_replicas(
            2,
            sim=True,
            state_file=root / "replicas.json",
            base_port=R.free_base_port(2),
            timeout=60,
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        reps = [a for u in sims.urls for a in ("--replica", u)]
        argv_ = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            *reps,
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *(["--workers", str(args.workers)] if args.workers > 1 else []),
        ]
        try:
            with Proc("gateway", argv_, root / "gateway.log", url=url) as gw:
                gw.wait_http("/health", timeout=60)
                b = httpx.post(
                    url + "/v1/load_lora_adapter",
                    auth=("run-b", "key-b"),
                    json={"lora_name": "trl-policy-v1", "lora_path": str(root / "b" / "v1")},
                    timeout=30,
                )
                assert b.status_code == 200, b.text
                asyncio.run(load_b(url, 3, args.concurrency, args.workers > 1))  # warm-up
                for rnd in range(args.rounds):
                    for kind in ("quiet", "reloading") if rnd % 2 == 0 else ("reloading", "quiet"):
                        stop = threading.Event()
                        th = threading.Thread(
                            target=reloader,
                            daemon=True,
                            args=(url, cfg, root, args.period_s, stop, outcomes),
                        )
                        if kind == "reloading":
                            th.start()
                        lat, errors = asyncio.run(
                            load_b(url, args.window_s, args.concurrency, args.workers > 1)
                        )
                        stop.set()
                        if th.is_alive():
                            th.join(60)
                        windows.append(
                            {
                                "round": rnd,
                                "kind": kind,
                                "requests": len(lat),
                                "errors": errors,
                                "p50_ms": round(pct(lat, 0.5), 3),
                                "p99_ms": round(pct(lat, 0.99), 3),
                            }
                        )
                        print(windows[-1], flush=True)
        finally:
            R.stop_replicas(sims)
    med = {
        k: {
            m: statistics.median(w[m] for w in windows if w["kind"] == k)
            for m in ("p50_ms", "p99_ms")
        }
        for k in ("quiet", "reloading")
    }
    ratio = med["reloading"]["p99_ms"] / med["quiet"]["p99_ms"]
    data = {
        "meta": meta,
        "windows": windows,
        "reloads": outcomes,
        "median": med,
        "p99_ratio": round(ratio, 3),
        "errors_reloading": sum(w["errors"] for w in windows if w["kind"] == "reloading"),
    }
    report.write(report.RESULTS, args.out_stem, data, markdown(data))
    print(markdown(data))
    return 0


def markdown(d: dict[str, Any]) -> str:
    m, med = d["meta"], d["median"]
    applied = sum(1 for r in d["reloads"] if r["status"] == 200)
    ms = sorted(r["ms"] for r in d["reloads"])
    lines = [
        "# A live reload of the run set, as another run sees it (`bench/run_reloads.py`)",
        "",
        f"Run B keeps {m['concurrency']} rollouts in flight (closed loop, its adapter) "
        + (
            f"through `serve --workers {m['workers']}` (a fresh connection per rollout) "
            if m.get("workers", 1) > 1
            else "through one gateway process "
        )
        + "over 2 simulated replicas; in the *reloading* windows "
        f"run C joins, loads, rolls out once and leaves, a reload every {m['period_s'] / 2:.0f} s "
        f"(config file rewritten, `POST /gateway/runs/reload`). {m['rounds']} rounds of "
        f"{m['window_s']:.0f} s windows, alternating. {m['date']}, git `{m.get('git_head')}`, "
        f"{m.get('nproc')} CPUs.",
        "",
        "| window | rounds | B p50 (median) | B p99 (median) | B errors |",
        "|---|---|---|---|---|",
    ]
    for k in ("quiet", "reloading"):
        ws = [w for w in d["windows"] if w["kind"] == k]
        lines.append(
            f"| {k} | {len(ws)} | {med[k]['p50_ms']:.2f} ms | {med[k]['p99_ms']:.2f} ms "
            f"| {sum(w['errors'] for w in ws)} |"
        )
    lines += [
        "",
        f"**B's p99 while reloading / quiet: {d['p99_ratio']:.3f}x** (target ≤ 1.1x); "
        f"B's errors while reloading: {d['errors_reloading']}.",
        "",
        f"Reloads: {len(d['reloads'])}, {applied} answered 200; each took "
        f"{ms[len(ms) // 2] if ms else 0:.0f} ms (median), {ms[-1] if ms else 0:.0f} ms (max), "
        "from the POST to its answer (run C placed and its manager built, or drained and "
        "unloaded).",
        "",
        "| round | window | requests | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {w['round']} | {w['kind']} | {w['requests']} | {w['p50_ms']} | {w['p99_ms']} "
        f"| {w['errors']} |"
        for w in d["windows"]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
