"""Gateway overhead vs direct access and vs vllm-router, side by side in one run.

Starts two instant fake upstreams (``bench/instant_upstream.py``), the gateway (current
tree, ``--log-level WARNING``) and ``vllm-router`` (round_robin) on free 127.0.0.1 ports,
warms each front up, then runs interleaved rounds of, per front:

* latency: 1 request in flight, ``--lat-requests`` requests -> p50/p99;
* throughput: 64 in flight (closed loop), ``--tput-requests`` requests -> req/s, p50/p99.

Added latency = front - direct, per round; the table shows medians across rounds.
Ratio = gateway req/s / vllm-router req/s, per round, median across rounds.

Placement (2 cores): the proxy under test gets CPU 1 to itself; the load client and both
upstreams share CPU 0 (``--placement split``, the default). Every front, including
``direct``, uses the same placement, so the client+upstream side is identical and only the
front differs. ``vllm-router`` is multi-threaded but is confined to CPU 1 like the
single-process gateway. ``--placement none`` leaves scheduling to the kernel.

    .venv/bin/python bench/overhead.py            # full run, ~2-4 minutes
    .venv/bin/python bench/overhead.py --quick    # CI smoke, <= 30 s

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
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
BIN = Path(sys.executable).parent

CLIENT_CPU = 0
FRONT_CPU = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _affinity(cpus: set[int] | None) -> Callable[[], None] | None:
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class Fleet:
    placement: str
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def cpus(self, role: str) -> set[int] | None:
        if self.placement == "none" or (os.cpu_count() or 1) < 2:
            return None
        return {FRONT_CPU} if role == "front" else {CLIENT_CPU}

    def start(self, name: str, argv: list[str], role: str) -> Proc:
        log = self.log_dir / f"{name}.log"
        fh = log.open("wb")
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=_affinity(self.cpus(role)),
            cwd=ROOT,
        )
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.terminate()  # SIGTERM to this PID only
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)


def wait_ready(url: str, proc: Proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout}s")


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of ``pid`` (``/proc/PID/task/*/schedstat``)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    return total


def run_loadgen(
    fleet: Fleet,
    url: str,
    mode: str,
    requests: int,
    warmup: int,
    max_seconds: float,
    pid: int | None = None,
) -> dict[str, object]:
    def argv(n: int) -> list[str]:
        return [
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
        result["front_cpu_us_per_req"] = round(used / 1000 / int(result["requests"]), 1)  # type: ignore[call-overload]
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
            wait_ready(url + "/health", proc)
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

        router_bin = BIN / "vllm-router"
        if not router_bin.exists() and shutil.which("vllm-router"):
            router_bin = Path(shutil.which("vllm-router") or "")
        router = None
        if router_bin.exists() and not args.no_router:
            rport, mport = free_port(), free_port()
            router = fleet.start(
                "vllm-router",
                [
                    str(router_bin),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rport),
                    "--worker-urls",
                    *up_urls,
                    "--policy",
                    "round_robin",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(mport),
                ],
                "front",
            )
            fronts["vllm-router"] = f"http://127.0.0.1:{rport}"
            pids["vllm-router"] = router.popen.pid

        wait_ready(fronts["gateway"] + "/health", gw)
        if router is not None:
            wait_ready(fronts["vllm-router"] + "/health", router, timeout=60)
        yield fleet, fronts, pids
    finally:
        fleet.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: 1 round, few requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lat-requests", type=int, default=1000)
    parser.add_argument("--tput-requests", type=int, default=5000)
    parser.add_argument("--placement", choices=("split", "none"), default="split")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting rounds after")
    parser.add_argument("--no-router", action="store_true", help="skip vllm-router")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.lat_requests, args.tput_requests = 1, 200, 600
        args.budget_s = 20.0
    lat_warm = max(20 if args.quick else 50, args.lat_requests // 10)
    tput_warm = max(64 if args.quick else 200, args.tput_requests // 10)
    per_run_max = 8.0 if args.quick else 40.0

    t0 = time.monotonic()
    info = machine_info(args.placement)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"overhead-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict[str, dict[str, object]]]] = []
    with fleet_up(args, log_dir) as (fleet, fronts, pids):
        names = list(fronts)
        # Warm-up: connections, JIT-free but caches/pools/allocators settle.
        for name in names:
            run_loadgen(fleet, fronts[name], "throughput", tput_warm, 0, per_run_max)
            run_loadgen(fleet, fronts[name], "latency", lat_warm, 0, per_run_max)
        for r in range(args.rounds):
            if r > 0 and time.monotonic() - t0 > args.budget_s:
                print(f"budget reached; stopping after {r} rounds", file=sys.stderr)
                break
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate per round
            this: dict[str, dict[str, dict[str, object]]] = {}
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
                this[name] = {"latency": lat, "throughput": tput}
                print(
                    f"round {r + 1} {name:>12}: 1-in-flight p50 {lat['p50_ms']:.3f} ms "
                    f"p99 {lat['p99_ms']:.3f} ms | 64-in-flight {tput['rps']:>8.0f} req/s "
                    f"p50 {tput['p50_ms']:.2f} ms p99 {tput['p99_ms']:.2f} ms "
                    f"cpu {tput.get('front_cpu_us_per_req')} us/req "
                    f"errors {int(lat['errors']) + int(tput['errors'])}",  # type: ignore[call-overload]
                    file=sys.stderr,
                )
            rounds.append(this)
    elapsed = time.monotonic() - t0

    summary = summarize(rounds, names)
    report: dict[str, object] = {
        "machine": info,
        "config": {
            "rounds": len(rounds),
            "lat_requests": args.lat_requests,
            "tput_requests": args.tput_requests,
            "concurrency": 64,
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
        "rounds": rounds,
        "summary": summary,
    }
    table = render(report)
    print(table)
    if not args.no_write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "overhead.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out_dir / "overhead.md").write_text(table)
    errors = sum(
        int(m[k]["errors"])  # type: ignore[call-overload]
        for rnd in rounds
        for m in rnd.values()
        for k in ("latency", "throughput")
    )
    return 0 if errors == 0 else 1


def summarize(
    rounds: list[dict[str, dict[str, dict[str, object]]]], names: list[str]
) -> dict[str, dict[str, float]]:
    def col(name: str, kind: str, key: str) -> list[float]:
        return [num(rnd[name][kind][key]) for rnd in rounds if name in rnd]

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
            "errors": sum(col(name, "latency", "errors") + col(name, "throughput", "errors")),
        }
        for kind, prefix in (("latency", "lat"), ("throughput", "tput")):
            for q in ("p50", "p99"):
                added = [
                    num(rnd[name][kind][f"{q}_ms"]) - num(rnd["direct"][kind][f"{q}_ms"])
                    for rnd in rounds
                ]
                s[f"{prefix}_added_{q}_ms"] = med(added)
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


def render(report: dict[str, object]) -> str:
    summary: dict[str, dict[str, float]] = report["summary"]  # type: ignore[assignment]
    cfg: dict[str, object] = report["config"]  # type: ignore[assignment]
    machine: dict[str, object] = report["machine"]  # type: ignore[assignment]
    lines = [
        f"Overhead: medians over {cfg['rounds']} interleaved rounds; "
        f"{cfg['lat_requests']} requests at 1 in flight, {cfg['tput_requests']} at 64 in flight. "
        f"nproc={machine['nproc']}, placement: {cfg['placement_detail']}.",
        "",
        "| front | p50 @1 | p99 @1 | added p50 @1 | added p99 @1 | req/s @64 | p50 @64 | p99 @64 "
        "| added p50 @64 | added p99 @64 | req/s vs vllm-router | front CPU µs/req @64 "
        "| CPU efficiency vs vllm-router | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ratio = s.get("rps_vs_vllm_router")
        eff = s.get("cpu_efficiency_vs_vllm_router")
        lines.append(
            f"| {name} | {s['lat_p50_ms']:.3f} ms | {s['lat_p99_ms']:.3f} ms "
            f"| {s['lat_added_p50_ms']:+.3f} ms | {s['lat_added_p99_ms']:+.3f} ms "
            f"| {s['tput_rps']:,.0f} | {s['tput_p50_ms']:.2f} ms | {s['tput_p99_ms']:.2f} ms "
            f"| {s['tput_added_p50_ms']:+.2f} ms | {s['tput_added_p99_ms']:+.2f} ms "
            f"| {'' if ratio is None else f'{ratio:.2f}x'} | {s['cpu_us_per_req_64']:.0f} "
            f"| {'' if eff is None else f'{eff:.2f}x'} | {int(s['errors'])} |"
        )
    gw = summary.get("gateway", {})
    dirty = " + uncommitted gateway/ changes" if machine["gateway_tree_dirty"] else ""
    lines.append("")
    if "rps_vs_vllm_router" in gw:
        ok_ratio = gw["rps_vs_vllm_router"] >= 0.35
        ok_p50 = gw["tput_added_p50_ms"] <= 1.0
        ok_p99 = gw["tput_added_p99_ms"] <= 5.0
        lines.append(
            f"Targets (issue 2): gateway/vllm-router req/s ratio {gw['rps_vs_vllm_router']:.2f} "
            f"(≥ 0.35: {'met' if ok_ratio else 'NOT met'}); added p50 @64 "
            f"{gw['tput_added_p50_ms']:+.2f} ms (≤ 1 ms: {'met' if ok_p50 else 'NOT met'}); "
            f"added p99 @64 {gw['tput_added_p99_ms']:+.2f} ms "
            f"(≤ 5 ms: {'met' if ok_p99 else 'NOT met'})."
        )
    lines.append(
        f"Gateway: git {machine['git_head']}{dirty}, "
        f"flags {cfg['gateway_flags']}; httpx default-transport variant: "
        f"{cfg['httpx_default_transport_variant']}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
