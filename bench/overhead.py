"""Gateway overhead vs direct access and vs vllm-router, side by side in one run.

Starts two instant fake upstreams (``bench/instant_upstream.py``), the gateway (current
tree, ``--log-level WARNING``) and ``vllm-router`` (round_robin) on free 127.0.0.1 ports,
warms each front up, then runs interleaved rounds of, per front:

* latency: 1 request in flight, ``--lat-requests`` requests -> p50/p99;
* saturated: 64 in flight (closed loop), ``--tput-requests`` requests -> req/s, p50/p99;
* paced: 64 connections at an open-loop offered rate of ``--paced-rate`` req/s in total
  (default 300) for ``--paced-seconds`` -> p50/p99 from the scheduled send, late sends;
* paced at ``--capacity-fraction`` (default 0.5) of the gateway's saturated req/s measured
  in the same round (0 disables it). All fronts get the same rate within a round.

Issue 2's latency target ("added p50 <= 1 ms, p99 <= 5 ms at 64 concurrent requests") is
reported for the paced rows *and* the saturated rows: at saturation, latency is queueing
(p50 ~ 64 / req/s), so the saturated numbers measure throughput, not per-request overhead.

Added latency = front - direct, per round; the table shows medians across rounds.
Ratio = gateway req/s / vllm-router req/s (saturated), per round, median across rounds.

Placement (2 cores): the proxy under test gets CPU 1 to itself; the load client and both
upstreams share CPU 0 (``--placement split``, the default). Every front, including
``direct``, uses the same placement, so the client+upstream side is identical and only the
front differs. ``vllm-router`` is multi-threaded but is confined to CPU 1 like the
single-process gateway. ``--placement none`` leaves scheduling to the kernel.

    .venv/bin/python bench/overhead.py            # full run, <= ~5 minutes
    .venv/bin/python bench/overhead.py --quick    # CI smoke, <= 30 s
    .venv/bin/python bench/overhead.py --floor    # + Python's floor (bench/ceiling.py)

Writes ``bench/results/overhead.json`` and ``bench/results/overhead.md`` (``--out-dir``).
Only processes started here are stopped, by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rollout_testbed.procs import Proc, free_port, stop_all, wait_http

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
BIN = Path(sys.executable).parent

CLIENT_CPU = 0
FRONT_CPU = 1
CONCURRENCY = 64
PACED_KINDS = ("paced", "paced_cap")


def _affinity(cpus: set[int] | None) -> Callable[[], None] | None:
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


@dataclass
class Fleet:
    placement: str
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def cpus(self, role: str) -> set[int] | None:
        if self.placement == "none" or (os.cpu_count() or 1) < 2:
            return None
        return {FRONT_CPU} if role == "front" else {CLIENT_CPU}

    def start(
        self,
        name: str,
        argv: list[str],
        role: str,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> Proc:
        # SIGTERM to this PID only (no session of its own), output to NAME.log.
        pin = _affinity(self.cpus(role))
        proc = Proc(name, argv, self.log_dir / f"{name}.log", env=env, cwd=cwd,
                    new_session=False, append=False, preexec_fn=pin)  # fmt: skip
        self.procs.append(proc.start())
        return proc

    def stop_all(self) -> None:
        stop_all(list(reversed(self.procs)), grace=10, kill_wait=5)


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of ``pid`` and of its descendants
    (``/proc/PID/task/*/schedstat``; ``serve --workers N`` is a tree of processes)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(cpu_ns(int(child)) for child in f.read().split())
    return total


def run_loadgen(
    fleet: Fleet,
    url: str,
    mode: str,
    requests: int,
    warmup: int,
    max_seconds: float,
    pid: int | None = None,
    rate: float = 0.0,
) -> dict[str, object]:
    def argv(n: int) -> list[str]:
        cmd = [
            PY,
            str(HERE / "loadgen.py"),
            "--url",
            url,
            "--mode",
            mode,
            "--requests",
            str(n),
            "--max-seconds",
            str(max_seconds),
        ]
        if rate:
            cmd += ["--rate", f"{rate:g}", "--concurrency", str(CONCURRENCY)]
        return cmd

    pin = _affinity(fleet.cpus("client"))
    if warmup:  # separate process, so the CPU reading below covers only measured requests
        subprocess.run(
            argv(warmup),
            capture_output=True,
            timeout=2 * max_seconds + 30,
            preexec_fn=pin,
            check=False,
        )
    before = cpu_ns(pid) if pid else 0
    out = subprocess.run(
        argv(requests),
        capture_output=True,
        timeout=2 * max_seconds + 30,
        preexec_fn=pin,
        check=False,
    )
    try:
        result: dict[str, object] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"loadgen failed: {out.stderr.decode()[-2000:]}") from exc
    if pid and result.get("requests"):
        # The front's own CPU time per request (all its threads): robust to a noisy machine.
        used = cpu_ns(pid) - before
        served = int(result["requests"]) + int(result.get("primed", 0))  # type: ignore[call-overload]
        result["front_cpu_us_per_req"] = round(used / 1000 / served, 1)
    return result


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(placement: str) -> dict[str, object]:
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, cwd=ROOT, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "gateway"],
        capture_output=True,
        cwd=ROOT,
        check=False,
    )
    module = subprocess.run(
        [PY, "-c", "import gateway; print(gateway.__file__)"],
        capture_output=True,
        cwd=ROOT,
        check=False,
    )
    return {
        "nproc": os.cpu_count(),
        "affinity_available": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_head": git.stdout.decode().strip(),
        "gateway_tree_dirty": bool(dirty.stdout.strip()),
        "gateway_module": module.stdout.decode().strip(),  # which tree the gateway runs from
        "placement": placement,
        "packages": {
            d: _version(d)
            for d in (
                "rollout-gateway",
                "fastapi",
                "starlette",
                "uvicorn",
                "uvloop",
                "httptools",
                "httpx",
                "httpx-aiohttp",
                "aiohttp",
                "orjson",
                "vllm-router",
            )
        },
    }


def num(value: object) -> float:
    return float(value)  # type: ignore[arg-type]


def med(values: list[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return round(statistics.median(vals), 4) if vals else float("nan")


def start_vllm_router(
    fleet: Fleet, up_urls: list[str], policy: str = "round_robin"
) -> tuple[Proc, str] | None:
    """vllm-router (``policy``) over ``up_urls`` on the front core, or None if it is not
    installed; returns the process and its URL (wait for ``/health`` before use)."""
    router_bin = BIN / "vllm-router"
    if not router_bin.exists() and shutil.which("vllm-router"):
        router_bin = Path(shutil.which("vllm-router") or "")
    if not router_bin.exists():
        return None
    rport, mport = free_port(), free_port()
    argv = [str(router_bin), "--host", "127.0.0.1", "--port", str(rport), "--worker-urls",
            *up_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(mport)]  # fmt: skip
    return fleet.start("vllm-router", argv, "front"), f"http://127.0.0.1:{rport}"


@contextlib.contextmanager
def fleet_up(
    args: argparse.Namespace, log_dir: Path
) -> Iterator[tuple[Fleet, dict[str, str], dict[str, int]]]:
    fleet = Fleet(args.placement, log_dir)
    try:
        up_ports = [free_port(), free_port()]
        ups = []
        for i, port in enumerate(up_ports):
            proc = fleet.start(
                f"upstream{i + 1}",
                [PY, str(HERE / "instant_upstream.py"), "--port", str(port)],
                "client",
            )
            ups.append(proc)
        up_urls = [f"http://127.0.0.1:{p}" for p in up_ports]
        for url, proc in zip(up_urls, ups, strict=True):
            wait_http(url + "/health", proc=proc, timeout=30)
        fronts: dict[str, str] = {"direct": up_urls[0]}
        pids: dict[str, int] = {"direct": ups[0].popen.pid}

        gw_port = free_port()
        gw_argv = [str(BIN / "rollout-gateway"), "serve"]
        for url in up_urls:
            gw_argv += ["--replica", url]
        gw_argv += ["--host", "127.0.0.1", "--port", str(gw_port), "--log-level", "WARNING"]
        gw = fleet.start("gateway", gw_argv, "front")
        fronts["gateway"] = f"http://127.0.0.1:{gw_port}"
        pids["gateway"] = gw.popen.pid
        if args.baseline is not None:  # the same flags, another tree's code
            base_port = free_port()
            argv = [PY, "-m", "gateway", *gw_argv[1:]]
            argv[argv.index(str(gw_port))] = str(base_port)
            src = args.baseline.resolve()  # cwd first on sys.path: that tree's package
            env = {**os.environ, "PYTHONPATH": str(src)}
            base = fleet.start("gateway-before", argv, "front", env=env, cwd=src)
            fronts["gateway-before"] = f"http://127.0.0.1:{base_port}"
            pids["gateway-before"] = base.popen.pid
            wait_http(fronts["gateway-before"] + "/health", proc=base, timeout=30)

        for k in args.workers_variant:  # the same flags, ``--workers K``, same placement
            w_port = free_port()
            argv = [*gw_argv, "--workers", str(k)]
            argv[argv.index(str(gw_port))] = str(w_port)
            name = f"gateway-w{k}"
            proc = fleet.start(name, argv, "front")
            fronts[name] = f"http://127.0.0.1:{w_port}"
            pids[name] = proc.popen.pid
            wait_http(fronts[name] + "/health", proc=proc, timeout=30)

        if args.floor:  # Python's floor on this core: bench/ceiling.py's ``_floor`` front
            floor_port = free_port()
            argv = [PY, str(HERE / "ceiling.py"), "_floor", "--port", str(floor_port)]
            for url in up_urls:
                argv += ["--replica", url]
            floor = fleet.start("floor", argv, "front")
            fronts["floor"] = f"http://127.0.0.1:{floor_port}"
            pids["floor"] = floor.popen.pid
            wait_http(fronts["floor"] + "/health", proc=floor, timeout=30)

        router = None
        started = None if args.no_router else start_vllm_router(fleet, up_urls)
        if started is not None:
            router, fronts["vllm-router"] = started
            pids["vllm-router"] = router.popen.pid

        wait_http(fronts["gateway"] + "/health", proc=gw, timeout=30)
        if router is not None:
            wait_http(fronts["vllm-router"] + "/health", proc=router, timeout=60)
        yield fleet, fronts, pids
    finally:
        fleet.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: 1 round, few requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lat-requests", type=int, default=1000)
    parser.add_argument("--tput-requests", type=int, default=5000)
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=300.0,
        help="offered req/s (total, open loop) over 64 connections for the paced phase",
    )
    parser.add_argument("--paced-seconds", type=float, default=8.0, help="per paced run")
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.5,
        help="second paced rate = this x the gateway's saturated req/s in the round (0 = off)",
    )
    parser.add_argument("--placement", choices=("split", "none"), default="split")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=285.0,
        help="do not start a round expected to end later than this (seconds since start)",
    )
    parser.add_argument("--no-router", action="store_true", help="skip vllm-router")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="SRC",
        help="also run the gateway of another checkout (e.g. a `git worktree` of an older "
        "commit) as front 'gateway-before', same venv and flags: a before/after in one run",
    )
    parser.add_argument(
        "--workers-variant",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="also run the gateway with --workers K as front 'gateway-wK' (repeatable); "
        "pinned like the others (CPU time of its whole process tree is what it costs)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run front 'floor' (bench/ceiling.py: a bare uvloop + httptools protocol "
        "forwarding round robin through the gateway's upstream client, no gateway feature): "
        "what any Python front costs on this core",
    )
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.lat_requests, args.tput_requests = 1, 200, 600
        args.paced_seconds = min(args.paced_seconds, 1.0)
        args.budget_s = 25.0
    lat_warm = max(20 if args.quick else 50, args.lat_requests // 10)
    tput_warm = max(64 if args.quick else 200, args.tput_requests // 10)
    per_run_max = 8.0 if args.quick else 40.0
    paced_max = 3 * args.paced_seconds + 5.0

    t0 = time.monotonic()
    info = machine_info(args.placement)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"overhead-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict[str, dict[str, object]]]] = []
    round_info: list[dict[str, object]] = []
    with fleet_up(args, log_dir) as (fleet, fronts, pids):
        names = list(fronts)
        # Warm-up: connections, JIT-free but caches/pools/allocators settle.
        for name in names:
            run_loadgen(fleet, fronts[name], "throughput", tput_warm, 0, per_run_max)
            run_loadgen(fleet, fronts[name], "latency", lat_warm, 0, per_run_max)
        longest = 0.0
        for r in range(args.rounds):
            now = time.monotonic() - t0
            if r > 0 and now + longest > args.budget_s:
                print(f"budget reached; stopping after {r} rounds", file=sys.stderr)
                break
            r0 = time.monotonic()
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate per round
            this: dict[str, dict[str, dict[str, object]]] = {name: {} for name in order}
            for name in order:
                lat = run_loadgen(
                    fleet,
                    fronts[name],
                    "latency",
                    args.lat_requests,
                    lat_warm // 2,
                    per_run_max,
                    pids[name],
                )
                tput = run_loadgen(
                    fleet,
                    fronts[name],
                    "throughput",
                    args.tput_requests,
                    tput_warm // 2,
                    per_run_max,
                    pids[name],
                )
                this[name].update(latency=lat, throughput=tput)
                print(
                    f"round {r + 1} {name:>12}: 1-in-flight p50 {lat['p50_ms']:.3f} ms "
                    f"p99 {lat['p99_ms']:.3f} ms | 64-in-flight {tput['rps']:>8.0f} req/s "
                    f"p50 {tput['p50_ms']:.2f} ms p99 {tput['p99_ms']:.2f} ms "
                    f"cpu {tput.get('front_cpu_us_per_req')} us/req "
                    f"errors {int(lat['errors']) + int(tput['errors'])}",  # type: ignore[call-overload]
                    file=sys.stderr,
                )
            # Paced rates for this round: the fixed one, and a fraction of the gateway's
            # saturated capacity measured just above (same rate for every front).
            cap_rate = 0.0
            if args.capacity_fraction > 0 and "gateway" in this:
                cap_rate = float(
                    round(args.capacity_fraction * num(this["gateway"]["throughput"]["rps"]), -1)
                )
            rates = {"paced": args.paced_rate, "paced_cap": cap_rate}
            for name in order:
                for kind, rate in rates.items():
                    if rate <= 0:
                        continue
                    n = max(CONCURRENCY, int(rate * args.paced_seconds))
                    res = run_loadgen(
                        fleet, fronts[name], "throughput", n, 0, paced_max, pids[name], rate
                    )
                    this[name][kind] = res
                    print(
                        f"round {r + 1} {name:>12}: 64 conns paced {rate:>6.0f} req/s: "
                        f"p50 {res['p50_ms']:.3f} ms p99 {res['p99_ms']:.3f} ms "
                        f"(service p50 {res['service_p50_ms']:.3f} p99 "
                        f"{res['service_p99_ms']:.3f}) late {res['late_sends']} "
                        f"unsent {res['unsent']} in-flight max {res['max_in_flight']} "
                        f"achieved {res['achieved_ratio']} errors {res['errors']}",
                        file=sys.stderr,
                    )
            rounds.append(this)
            dur = time.monotonic() - r0
            longest = max(longest, dur)
            round_info.append(
                {
                    "round": r + 1,
                    "order": order,
                    "paced_rate": args.paced_rate,
                    "capacity_rate": cap_rate,
                    "duration_s": round(dur, 1),
                    "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
                }
            )
    elapsed = time.monotonic() - t0

    summary = summarize(rounds, names)
    report: dict[str, object] = {
        "machine": info,
        "config": {
            "rounds": len(rounds),
            "lat_requests": args.lat_requests,
            "tput_requests": args.tput_requests,
            "concurrency": CONCURRENCY,
            "paced_rate": args.paced_rate,
            "paced_seconds": args.paced_seconds,
            "capacity_fraction": args.capacity_fraction,
            "quick": args.quick,
            "placement": args.placement,
            "placement_detail": (
                f"front (gateway / vllm-router) on CPU {FRONT_CPU}; load client and both "
                f"upstreams on CPU {CLIENT_CPU}"
                if args.placement == "split"
                else "unpinned"
            ),
            "gateway_flags": "--log-level WARNING",
            "httpx_default_transport_variant": "skipped: the gateway exposes no transport switch",
            "elapsed_s": round(elapsed, 1),
            "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "round_info": round_info,
        "rounds": rounds,
        "summary": summary,
    }
    table = render(report)
    print(table)
    if not args.no_write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "overhead.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out_dir / "overhead.md").write_text(table)
    errors = sum(int(m["errors"]) for rnd in rounds for f in rnd.values() for m in f.values())  # type: ignore[call-overload]
    return 0 if errors == 0 else 1


def kept_up(s: dict[str, float], kind: str) -> bool:
    """The front served the paced schedule: ≤ 1 % late sends, nothing unsent, rate achieved."""
    return (
        s.get(f"{kind}_late_fraction", 1.0) <= 0.01
        and s.get(f"{kind}_unsent", 1.0) == 0
        and s.get(f"{kind}_achieved_ratio_min", 0.0) >= 0.95
    )


def summarize(
    rounds: list[dict[str, dict[str, dict[str, object]]]], names: list[str]
) -> dict[str, dict[str, float]]:
    def col(name: str, kind: str, key: str) -> list[float]:
        return [num(rnd[name][kind][key]) for rnd in rounds if kind in rnd.get(name, {})]

    def added(name: str, kind: str, key: str) -> list[float]:
        return [
            num(rnd[name][kind][key]) - num(rnd["direct"][kind][key])
            for rnd in rounds
            if kind in rnd.get(name, {}) and kind in rnd.get("direct", {})
        ]

    out: dict[str, dict[str, float]] = {}
    for name in names:
        s = {
            "lat_p50_ms": med(col(name, "latency", "p50_ms")),
            "lat_p99_ms": med(col(name, "latency", "p99_ms")),
            "tput_rps": med(col(name, "throughput", "rps")),
            "tput_p50_ms": med(col(name, "throughput", "p50_ms")),
            "tput_p99_ms": med(col(name, "throughput", "p99_ms")),
            "cpu_us_per_req_64": med(col(name, "throughput", "front_cpu_us_per_req")),
            "cpu_us_per_req_1": med(col(name, "latency", "front_cpu_us_per_req")),
            "errors": sum(
                num(m["errors"]) for rnd in rounds if name in rnd for m in rnd[name].values()
            ),
        }
        for kind, prefix in (("latency", "lat"), ("throughput", "tput")):
            for q in ("p50", "p99"):
                s[f"{prefix}_added_{q}_ms"] = med(added(name, kind, f"{q}_ms"))
        for kind in PACED_KINDS:
            if not col(name, kind, "p50_ms"):
                continue
            sent = sum(col(name, kind, "requests"))
            late = sum(col(name, kind, "late_sends"))
            s.update(
                {
                    f"{kind}_offered_rps": med(col(name, kind, "offered_rps")),
                    f"{kind}_offered_rps_min": min(col(name, kind, "offered_rps")),
                    f"{kind}_offered_rps_max": max(col(name, kind, "offered_rps")),
                    f"{kind}_p50_ms": med(col(name, kind, "p50_ms")),
                    f"{kind}_p99_ms": med(col(name, kind, "p99_ms")),
                    f"{kind}_added_p50_ms": med(added(name, kind, "p50_ms")),
                    f"{kind}_added_p99_ms": med(added(name, kind, "p99_ms")),
                    f"{kind}_service_p50_ms": med(col(name, kind, "service_p50_ms")),
                    f"{kind}_service_p99_ms": med(col(name, kind, "service_p99_ms")),
                    f"{kind}_service_added_p50_ms": med(added(name, kind, "service_p50_ms")),
                    f"{kind}_service_added_p99_ms": med(added(name, kind, "service_p99_ms")),
                    f"{kind}_send_lag_p50_ms": med(col(name, kind, "send_lag_p50_ms")),
                    f"{kind}_send_lag_p99_ms": med(col(name, kind, "send_lag_p99_ms")),
                    f"{kind}_requests": sent,
                    f"{kind}_late_sends": late,
                    f"{kind}_late_fraction": round(late / sent, 4) if sent else 1.0,
                    f"{kind}_max_late_ms": max(col(name, kind, "max_late_ms")),
                    f"{kind}_unsent": sum(col(name, kind, "unsent")),
                    f"{kind}_achieved_ratio_min": min(col(name, kind, "achieved_ratio")),
                    f"{kind}_mean_in_flight": med(col(name, kind, "mean_in_flight")),
                    f"{kind}_max_in_flight": max(col(name, kind, "max_in_flight")),
                    f"{kind}_cpu_us_per_req": med(col(name, kind, "front_cpu_us_per_req")),
                }
            )
            s[f"{kind}_kept_up"] = float(kept_up(s, kind))
        if "vllm-router" in names:
            ratios = [
                num(rnd[name]["throughput"]["rps"]) / num(rnd["vllm-router"]["throughput"]["rps"])
                for rnd in rounds
            ]
            s["rps_vs_vllm_router"] = med(ratios)
            cpu_ratios = [
                num(rnd["vllm-router"]["throughput"]["front_cpu_us_per_req"])
                / num(rnd[name]["throughput"]["front_cpu_us_per_req"])
                for rnd in rounds
            ]
            s["cpu_efficiency_vs_vllm_router"] = med(cpu_ratios)
        out[name] = s
    return out


def _rate_label(summary: dict[str, dict[str, float]], kind: str) -> str:
    rows = [s for s in summary.values() if f"{kind}_p50_ms" in s]
    if not rows:
        return ""
    low = min(s.get(f"{kind}_offered_rps_min", s[f"{kind}_offered_rps"]) for s in rows)
    high = max(s.get(f"{kind}_offered_rps_max", s[f"{kind}_offered_rps"]) for s in rows)
    if low == high:
        return f"{low:,.0f} req/s"
    return f"{low:,.0f}-{high:,.0f} req/s"  # the capacity rate varies per round


def render(report: dict[str, object]) -> str:
    summary: dict[str, dict[str, float]] = report["summary"]  # type: ignore[assignment]
    cfg: dict[str, object] = report["config"]  # type: ignore[assignment]
    machine: dict[str, object] = report["machine"]  # type: ignore[assignment]
    paced = [k for k in PACED_KINDS if any(f"{k}_p50_ms" in s for s in summary.values())]
    labels = {k: _rate_label(summary, k) for k in paced}
    if "paced_cap" in labels:
        labels["paced_cap"] += f" (= {cfg['capacity_fraction']:g} x gateway saturated req/s)"
    lines = [
        f"Overhead: medians over {cfg['rounds']} interleaved rounds; "
        f"{cfg['lat_requests']} requests at 1 in flight, {cfg['tput_requests']} at 64 in flight "
        f"(closed loop), {cfg['paced_seconds']:g} s per paced run over 64 connections "
        f"(open loop; latency from the scheduled send). nproc={machine['nproc']}, placement: "
        f"{cfg['placement_detail']}. Load average (1/5/15 min) at start "
        f"{fmt_load(machine['loadavg_at_start'])}, at end {fmt_load(cfg['loadavg_at_end'])}.",
        "",
        "**Latency** (added = front - direct per round, median over rounds):",
        "",
    ]
    head = "| front | p50 @1 | p99 @1 | added p50 @1 | added p99 @1 "
    sep = "|---|---|---|---|---"
    for k in paced:
        tag = "64 paced" if k == "paced" else "64 paced@cap"
        head += f"| p50 {tag} | p99 {tag} | added p50 {tag} | added p99 {tag} | late sends {tag} "
        sep += "|---|---|---|---|---"
    lines += [head + "|", sep + "|"]
    for name, s in summary.items():
        row = (
            f"| {name} | {s['lat_p50_ms']:.3f} ms | {s['lat_p99_ms']:.3f} ms "
            f"| {s['lat_added_p50_ms']:+.3f} ms | {s['lat_added_p99_ms']:+.3f} ms "
        )
        for k in paced:
            if f"{k}_p50_ms" not in s:
                row += "| | | | | "
                continue
            late = f"{int(s[f'{k}_late_sends'])}/{int(s[f'{k}_requests'])}"
            if not s[f"{k}_kept_up"]:
                late += " (did NOT keep up)"
            row += (
                f"| {s[f'{k}_p50_ms']:.3f} ms | {s[f'{k}_p99_ms']:.3f} ms "
                f"| {s[f'{k}_added_p50_ms']:+.3f} ms | {s[f'{k}_added_p99_ms']:+.3f} ms "
                f"| {late} "
            )
        lines.append(row + "|")
    lines.append("")
    for k in paced:
        tag = "64 paced" if k == "paced" else "64 paced@cap"
        parts = [
            f"{name} {s[f'{k}_mean_in_flight']:.2f}/{int(s[f'{k}_max_in_flight'])}"
            for name, s in summary.items()
            if f"{k}_p50_ms" in s
        ]
        svc = [
            f"{name} {s[f'{k}_service_added_p50_ms']:+.3f}/{s[f'{k}_service_added_p99_ms']:+.3f} ms"
            for name, s in summary.items()
            if f"{k}_p50_ms" in s and name != "direct"
        ]
        d = summary.get("direct", {})
        lines.append(
            f"- *{tag}* = {labels[k]} offered in total, each connection on its own schedule "
            f"(interval 64/rate, staggered). In flight mean/max: {', '.join(parts)}. Added "
            f"p50/p99 measured from the actual write instead: {', '.join(svc)}. Client timer "
            f"lag (write - slot) p50/p99 on direct: {d.get(f'{k}_send_lag_p50_ms', 0):.3f}/"
            f"{d.get(f'{k}_send_lag_p99_ms', 0):.3f} ms (client-side, present for every front)."
        )
    lines += [
        "",
        "**Saturated** (closed loop, 64 always in flight; latency here is queueing, "
        "p50 ≈ 64 / req/s):",
        "",
        "| front | req/s @64 | req/s vs vllm-router | p50 @64 | p99 @64 | added p50 @64 "
        "| added p99 @64 | front CPU µs/req @64 | CPU efficiency vs vllm-router | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ratio = s.get("rps_vs_vllm_router")
        eff = s.get("cpu_efficiency_vs_vllm_router")
        lines.append(
            f"| {name} | {s['tput_rps']:,.0f} | {'' if ratio is None else f'{ratio:.2f}x'} "
            f"| {s['tput_p50_ms']:.2f} ms | {s['tput_p99_ms']:.2f} ms "
            f"| {s['tput_added_p50_ms']:+.2f} ms | {s['tput_added_p99_ms']:+.2f} ms "
            f"| {s['cpu_us_per_req_64']:.0f} | {'' if eff is None else f'{eff:.2f}x'} "
            f"| {int(s['errors'])} |"
        )
    lines += ["", *render_targets(summary, paced, labels), ""]
    dirty = " + uncommitted gateway/ changes" if machine["gateway_tree_dirty"] else ""
    lines.append(
        f"Gateway: git {machine['git_head']}{dirty}, "
        f"flags {cfg['gateway_flags']}; httpx default-transport variant: "
        f"{cfg['httpx_default_transport_variant']}."
    )
    return "\n".join(lines) + "\n"


def fmt_load(value: object) -> str:
    if not value:
        return "n/a"
    return "/".join(f"{v:.2f}" for v in value)  # type: ignore[attr-defined]


def render_targets(
    summary: dict[str, dict[str, float]], paced: list[str], labels: dict[str, str]
) -> list[str]:
    gw = summary.get("gateway")
    if gw is None:
        return []
    rt = summary.get("vllm-router", {})

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**NOT met**"

    def lat_rows(what: str, prefix: str, fmt: str, note: str = "") -> list[str]:
        rows = []
        for q, limit in (("p50", 1.0), ("p99", 5.0)):
            key = f"{prefix}_added_{q}_ms"
            router = f"{rt[key]:{fmt}} ms" if key in rt else ""
            ok = gw[key] <= limit and (not note or note == "kept up")
            extra = f" ({note})" if note else ""
            rows.append(
                f"| added {q} ≤ {limit:g} ms, {what} | {gw[key]:{fmt}} ms{extra} | {router} "
                f"| {verdict(ok)} |"
            )
        return rows

    lines = [
        "**Targets (issue 2), gateway:**",
        "",
        "| target | gateway | vllm-router (same run) | result |",
        "|---|---|---|---|",
    ]
    if "rps_vs_vllm_router" in gw:
        ratio = gw["rps_vs_vllm_router"]
        lines.append(
            f"| req/s ≥ 0.35 x vllm-router, 64 in flight (saturated) | {ratio:.2f}x "
            f"({gw['tput_rps']:,.0f} req/s) | 1.00x ({rt.get('tput_rps', 0):,.0f} req/s) "
            f"| {verdict(ratio >= 0.35)} |"
        )
    lines += lat_rows("1 in flight", "lat", "+.3f")
    for k in paced:
        if f"{k}_p50_ms" not in gw:
            continue
        note = "kept up" if gw[f"{k}_kept_up"] else "did NOT keep up with the schedule"
        lines += lat_rows(f"64 connections paced at {labels[k]}", k, "+.3f", note)
    lines += lat_rows("64 in flight saturated (queueing, see above)", "tput", "+.2f")
    return lines


if __name__ == "__main__":
    sys.exit(main())
