"""Many cores, side by side: the gateway with ``--workers N`` against vllm-router
(round_robin and cache_aware), each front pinned to N dedicated cores (issue 19).

One run starts, on 127.0.0.1:

* ``--fakes`` (4) instant fake replicas (``bench.lib.upstream``), one core each;
* one front per (front, core count) in ``--fronts`` x ``--cores``, all up for the whole run
  and idle between their measurements: ``python -m gateway serve --workers N`` (N = the
  front's cores; no ``--workers`` flag when N is 1) and ``vllm-router`` ``--policy
  round_robin`` (``rr``) / ``cache_aware`` (``bench.lib.fronts``). Each front is pinned with
  ``os.sched_setaffinity`` to the first N of the front CPUs before it starts; its
  processes and threads inherit the mask. The gateway on 1 core with 1 worker
  (``gateway@1``) is the base of the scaling efficiency, rps(N) / (N x rps(1));
* ``--loadgens`` (4) load generators (``bench.lib.load``'s closed-loop client in a child
  process each, its own core), ``--connections`` (64) keep-alive connections each, TRL-shaped
  token-id completion bodies (``load.make_bodies``, one seed per load generator).

A measurement: the load generators start together, warm up for ``--warmup-s`` (closed loop,
untimed), then run ``--duration-s`` at full concurrency, all from the same wall-clock start.
req/s is the sum over load generators; p50/p99 come from all their latencies merged. Over
the same window this script reads the CPU time of the front's whole process tree (``front
busy`` = cores' worth in use), of each fake, and each load generator reports its own, so a
harness limit shows. ``direct`` (each load generator straight to its own fake, no front) is
measured in every round as the harness's own ceiling. Every round measures every
configuration once, in a rotated order; the tables show medians over rounds. Ratios (vs
``rr`` at the same core count, efficiency) are taken per round, then the median.

CPU layout (from ``os.sched_getaffinity(0)``, sorted): load generators on the first
``--loadgens`` CPUs, fakes on the next ``--fakes``, the front CPUs after them (up to
max(``--cores``)). Too few CPUs is an error, except with ``--smoke`` (a tiny functional
check on a 2-core machine: everything but the front shares the first CPU).

vllm-router's cache_aware matches prompt *text*; with token-id prompts on real vLLM it sent
everything to one worker (``shared/reference/perf-calibration.md``). It is measured all the
same; the fakes' busy figures (max/min) show how it spread this run's requests.

Saturating mode (issue 28): ``--fake-service-ms S --fake-concurrency C`` gives every fake a
capacity of C/S req/s (``bench.lib.upstream``'s ``Capacity``: C slots held S ms each, one
FIFO queue per fake), so the replicas, not the front, are the bottleneck once the front
is fast enough, and the results go to ``cores-saturated.*`` (``--name``). ``--fronts``
may add ``gateway_rr`` (the gateway with ``--router round_robin``: routing vs plumbing)
and, with ``--base-tree DIR`` (a tree holding another commit's ``gateway/``), ``base`` and
``base_rr``: that code measured side by side with this one. For every gateway the
measurement also records each process's CPU and client connections (how SO_REUSEPORT
spread them) and its upstream connections per fake.

Where affinity is not enforced (gVisor, say) the layout is nominal: a check at the start
(two busy loops pinned to one CPU) records which, in the JSON and the notes.

Targets (issue 19), at 8 front cores: gateway req/s >= rr's, gateway p99 <= 1.5 x rr's,
efficiency >= 0.7.

    .venv/bin/python bench/cores.py --out-dir bench/results     # the full run (16 CPUs)
    .venv/bin/python bench/cores.py --smoke                     # functional check, ~1 min

Writes ``cores.json``, ``cores.md`` and (if matplotlib imports) ``cores.png`` in
``--out-dir`` (default ``bench/results``; with ``--smoke``, a temporary folder), after every
round. Only processes started here are stopped, by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run by path: bench.lib

from rollout_testbed.procs import Proc, stop_all  # noqa: E402

from bench.lib import cpu, load  # noqa: E402
from bench.lib.fronts import PY, Fleet, pin  # noqa: E402
from bench.lib.report import fmt_load, loadavg, machine_info, pyplot, write  # noqa: E402
from bench.lib.rounds import Budget, med, paired_rounds  # noqa: E402

FRONT_KINDS = ("gateway", "rr", "cache_aware")
# Measured only when named in --fronts: the gateway with --router round_robin (routing vs
# plumbing, issue 28), and both again from --base-tree's code (before/after, side by side).
EXTRA_KINDS = ("gateway_rr", "base", "base_rr")
GATEWAY_KINDS = ("gateway", "gateway_rr", "base", "base_rr")
POLICY = {"rr": "round_robin", "cache_aware": "cache_aware"}
DEFAULT_CORES = (2, 4, 8)
TARGET_CORES = 8
TARGET_P99_RATIO = 1.5
TARGET_EFFICIENCY = 0.7
# Seconds, for the estimate: fakes + all fronts up (in parallel) + the first health answers,
# then stopping everything (SIGTERM, the gateway drains idle connections at once).
STARTUP_S = 25.0
TEARDOWN_S = 15.0
COLLECT_S = 1.0  # per measurement: children exit, latency files read, merged, summarised
SPAWN_S = 1.0  # children's start (python, uvloop) before the warm-up clock runs
BUSY_FLAG = 0.9  # a load generator or fake this busy (of its core) may bound the result
DEFAULTS = {"duration_s": 8.0, "warmup_s": 2.0, "rounds": 3, "loadgens": 4, "fakes": 4}
SMOKE = {"duration_s": 3.0, "warmup_s": 0.5, "rounds": 1, "loadgens": 2, "fakes": 2}


def estimate_s(
    measurements: int, rounds: int, duration_s: float, warmup_s: float, spawn_s: float = SPAWN_S
) -> float:
    """Wall seconds for a run: start-up, every measurement of every round, teardown."""
    per = spawn_s + warmup_s + duration_s + COLLECT_S
    return STARTUP_S + rounds * measurements * per + TEARDOWN_S


def _default_estimate() -> str:
    n = len(DEFAULT_CORES) * len(FRONT_KINDS) + 2  # + gateway@1 base + direct
    s = estimate_s(n, DEFAULTS["rounds"], DEFAULTS["duration_s"], DEFAULTS["warmup_s"])  # type: ignore[arg-type]
    return (
        f"Default full run: {n} measurements per round ({len(DEFAULT_CORES)} core counts x "
        f"{len(FRONT_KINDS)} fronts + gateway@1 + direct) x {DEFAULTS['rounds']} rounds x "
        f"({SPAWN_S:g} s spawn + {DEFAULTS['warmup_s']:g} s warm-up + "
        f"{DEFAULTS['duration_s']:g} s + {COLLECT_S:g} s) + ~{STARTUP_S + TEARDOWN_S:.0f} s "
        f"start/stop = ~{s:.0f} s (~{s / 60:.1f} min) on a quiet 16-CPU host; --budget-s "
        "stops starting rounds before that budget would be passed."
    )


# ---------------------------------------------------------------------------------------------
# CPU layout, processes and their CPU time.


@dataclass
class Layout:
    available: list[int]
    loadgen: list[int]  # one CPU per load generator
    fake: list[int]  # one CPU per fake
    front: list[int]  # a front on N cores gets front[:N]
    dedicated: bool  # no CPU shared between roles

    def describe(self) -> str:
        def span(cpus: list[int]) -> str:
            return ",".join(str(c) for c in cpus)

        shared = "" if self.dedicated else " (SMOKE: roles share CPUs)"
        return (
            f"load generators on CPU {span(self.loadgen)}, fakes on CPU {span(self.fake)}, "
            f"front on CPU {span(self.front)} (N cores: the first N){shared}"
        )


def compute_layout(
    available: list[int], max_front: int, fakes: int, loadgens: int, *, smoke: bool
) -> Layout:
    cpus = sorted(available)
    need = loadgens + fakes + max_front
    if len(cpus) >= need:
        return Layout(
            available=cpus,
            loadgen=cpus[:loadgens],
            fake=cpus[loadgens : loadgens + fakes],
            front=cpus[loadgens + fakes : need],
            dedicated=True,
        )
    if not smoke:
        raise SystemExit(
            f"cores.py: {loadgens} load generators + {fakes} fakes + {max_front} front cores "
            f"need {need} CPUs with a core each; this process may use {len(cpus)} "
            f"({cpus}). Give fewer --cores (or --loadgens/--fakes), or --smoke for an "
            "overlapping functional check."
        )
    if max_front > len(cpus):
        raise SystemExit(f"cores.py --smoke: {max_front} front cores > {len(cpus)} CPUs")
    front = cpus[len(cpus) - max_front :]
    rest = cpus[: len(cpus) - max_front] or cpus
    return Layout(
        available=cpus,
        loadgen=[rest[i % len(rest)] for i in range(loadgens)],
        fake=[rest[(loadgens + i) % len(rest)] for i in range(fakes)],
        front=front,
        dedicated=False,
    )


def ident(pid: int) -> str | None:
    """PID + start time (``/proc/PID/stat`` field 22): the same process, not a reused PID."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rpartition(')')[2].split()[19]}"
    except (OSError, IndexError):
        return None


def affinity_of(pids: list[int]) -> list[int]:
    cpus: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            cpus |= os.sched_getaffinity(pid)
    return sorted(cpus)


def _socket_table() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of every ESTABLISHED TCP socket (``/proc/net``)."""
    out: dict[int, tuple[int, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "01":
                    local = int(parts[1].rsplit(":", 1)[1], 16)
                    remote = int(parts[2].rsplit(":", 1)[1], 16)
                    out[int(parts[9])] = (local, remote)
    return out


def connections(pids: list[int], port: int, upstream_ports: list[int]) -> dict[str, Any]:
    """Per process of a front: its accepted client connections (local port ``port``) and
    its connections to each upstream (remote port in ``upstream_ports``)."""
    table = _socket_table()
    clients: dict[int, int] = {}
    upstream: dict[int, list[int]] = {}
    for pid in pids:
        mine: list[tuple[int, int]] = []
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        ends = table.get(int(link[8:-1]))
                        if ends is not None:
                            mine.append(ends)
        clients[pid] = sum(1 for local, _ in mine if local == port)
        upstream[pid] = [sum(1 for _, r in mine if r == u) for u in upstream_ports]
    serving = {p: n for p, n in clients.items() if n}
    return {
        "client_conns": sorted(serving.values(), reverse=True),
        "upstream_conns": [upstream[p] for p in sorted(serving, key=lambda p: -serving[p])],
    }


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


@dataclass
class Front:
    key: str  # e.g. gateway@4
    kind: str  # gateway | rr | cache_aware | direct
    cores: int
    cpus: list[int]
    urls: list[str]  # one per load generator (all the same, except direct)
    workers: int | str | None = None  # None: not a gateway
    env: dict[str, str] | None = None  # a --variant's environment (on top of ours)
    proc: Proc | None = None
    fleet: Fleet | None = None
    error: str = ""  # why it was not measured (did not start)


def key_of(front: Front) -> str:
    return front.key


def start_front(
    front: Front, fake_urls: list[str], log_dir: Path, args: argparse.Namespace, loadgens: int
) -> None:
    fleet = Fleet(log_dir / front.key, {"front": set(front.cpus)})
    front.fleet = fleet
    if front.workers is not None:
        flags = ["--workers", str(front.workers)] if front.workers != 1 else []
        if front.kind.endswith("_rr"):
            flags += ["--router", "round_robin"]
        if front.kind.startswith("base"):
            # ``python -m`` puts its cwd first on sys.path: the base tree's gateway wins.
            started = fleet.gateway(fake_urls, flags=flags, cwd=args.base_tree)
        else:
            env = {**os.environ, **front.env} if front.env else None
            started = fleet.gateway(fake_urls, flags=flags, env=env)
    else:
        router = fleet.vllm_router(fake_urls, POLICY[front.kind])
        if router is None:
            raise SystemExit("cores.py: vllm-router is not installed (pip install vllm-router)")
        started = router
    front.proc = started.proc
    front.urls = [started.url] * loadgens


# ---------------------------------------------------------------------------------------------
# One measurement.


def measure(
    front: Front,
    layout: Layout,
    args: argparse.Namespace,
    fake_pids: list[int],
    work: Path,
    fake_ports: list[int] = [],  # noqa: B006 (read only)
) -> dict[str, Any]:
    if front.proc is not None and not front.proc.alive:
        raise RuntimeError(
            f"{front.key} exited ({front.proc.returncode}):\n{front.proc.log_tail()}"
        )
    start_at = time.time() + SPAWN_S + args.warmup_s
    children: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i, url in enumerate(front.urls):
            lat = work / f"lat-{i}.f64"
            child = load.spawn_client(
                url,
                {layout.loadgen[i]},
                concurrency=args.connections,
                start_at=start_at,
                max_seconds=args.duration_s,
                seed=i,
                lat_out=lat,
            )
            children.append((child, lat))
        root = front.proc.pid if front.proc is not None else None
        # The front's and the fakes' CPU over the measured window (this process's clock).
        time.sleep(max(0.0, min(start_at - time.time(), SPAWN_S + args.warmup_s + 5)))
        fakes0 = [cpu.cpu_s(p) for p in fake_pids]
        front0 = cpu.tree_ns(root) if root else {}
        t0 = time.monotonic()
        time.sleep(args.duration_s / 2)
        conns = (  # mid-window: every load generator's connections are up
            connections(cpu.tree(root), port_of(front.urls[0]), fake_ports)
            if root and front.workers is not None
            else {}
        )
        time.sleep(max(0.0, args.duration_s - (time.monotonic() - t0)))
        front1 = cpu.tree_ns(root) if root else {}
        fakes1 = [cpu.cpu_s(p) for p in fake_pids]
        window = time.monotonic() - t0
        deadline = time.monotonic() + 30.0 + args.duration_s
        try:
            outs = [load.collect(c, max(1.0, deadline - time.monotonic())) for c, _ in children]
        except RuntimeError as exc:
            raise RuntimeError(f"{front.key}: {exc}") from None
        merged = load.LoadResult()
        for (_, lat), out in zip(children, outs, strict=True):
            values = array.array("d")
            values.frombytes(lat.read_bytes())
            lat.unlink()
            merged.latencies_s.extend(values)
            merged.statuses.update(Counter({int(k): v for k, v in out["statuses"].items()}))
            merged.transport_errors += int(out["transport_errors"])
            merged.elapsed_s = max(merged.elapsed_s, float(out["elapsed_s"]))
        summary = load.summarize(merged)
    finally:
        for child, lat in children:
            if child.poll() is None:
                child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
            lat.unlink(missing_ok=True)
    both = set(front0) & set(front1)
    starts = [float(o["started_at"]) for o in outs]
    result: dict[str, Any] = {
        "rps": round(sum(float(o["rps"]) for o in outs), 1),
        "p50_ms": summary["p50_ms"],
        "p90_ms": summary["p90_ms"],
        "p99_ms": summary["p99_ms"],
        "max_ms": summary["max_ms"],
        "mean_ms": summary["mean_ms"],
        "requests": summary["requests"],
        "errors": summary["errors"],
        "statuses": summary["statuses"],
        "loadgen_rps": [o["rps"] for o in outs],
        "loadgen_busy": [o["client_busy"] for o in outs],
        "warmup_requests": [o["warmup_requests"] for o in outs],
        "start_skew_ms": round((max(starts) - min(starts)) * 1000, 1),
        "late_start_ms": round(max(0.0, max(starts) - start_at) * 1000, 1),
        "fake_busy": [round((b - a) / window, 3) for a, b in zip(fakes0, fakes1, strict=True)],
        "window_s": round(window, 3),
    }
    if root:
        used = sum(front1[p] - front0[p] for p in both) / 1e9
        result["front_busy_cores"] = round(used / window, 3)
        result["front_processes"] = len(front1)
        result["front_affinity"] = affinity_of(sorted(front1))
        # Each process's share (busiest first): a worker at 1.0 while others idle is a
        # worker that bounds its own connections' latency.
        result["front_busy_each"] = sorted(
            (round((front1[p] - front0[p]) / 1e9 / window, 3) for p in both), reverse=True
        )
        result.update(conns)
    return result


# ---------------------------------------------------------------------------------------------
# Summary and report.


def _rounds_of(rounds: list[dict[str, dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    return [r[key] for r in rounds if key in r and "error" not in r[key]]


def summarize(rounds: list[dict[str, dict[str, Any]]], fronts: list[Front]) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = {}
    for f in fronts:
        ok = _rounds_of(rounds, f.key)
        failed = [r[f.key]["error"] for r in rounds if f.key in r and "error" in r[f.key]]
        if f.error:
            failed.append(f.error)
        s: dict[str, Any] = {
            "kind": f.kind,
            "cores": f.cores,
            "workers": f.workers,
            "rounds": len(ok),
            "failed_rounds": len(failed),
        }
        if failed:
            s["last_error"] = failed[-1][-500:]
        if ok:
            for k in ("rps", "p50_ms", "p90_ms", "p99_ms", "front_busy_cores"):
                if k in ok[0]:
                    s[k] = med([float(m[k]) for m in ok])
            s["errors"] = sum(int(m["errors"]) for m in ok)
            s["loadgen_busy_max"] = max(max(m["loadgen_busy"]) for m in ok)
            s["fake_busy_max"] = med([max(m["fake_busy"]) for m in ok])
            s["fake_busy_min"] = med([min(m["fake_busy"]) for m in ok])
            s["start_skew_ms_max"] = max(float(m["start_skew_ms"]) for m in ok)
            if "client_conns" in ok[-1]:  # the last round's spread, for the table
                s["client_conns"] = ok[-1]["client_conns"]
                s["front_busy_each"] = ok[-1].get("front_busy_each", [])
        per[f.key] = s

    def ratio(a: str, b: str, k: str, scale: float = 1.0) -> float | None:
        vals = [
            float(r[a][k]) / (scale * float(r[b][k]))
            for r in rounds
            if a in r
            and b in r
            and "error" not in r[a]
            and "error" not in r[b]
            and float(r[b][k]) > 0
        ]
        return med(vals) if vals else None

    for f in fronts:
        rr = f"rr@{f.cores}"
        if f.kind not in ("rr", "direct") and rr in per:
            per[f.key]["rps_vs_rr"] = ratio(f.key, rr, "rps")
            per[f.key]["p99_vs_rr"] = ratio(f.key, rr, "p99_ms")
        if f.kind == "gateway" and "gateway@1" in per:
            per[f.key]["efficiency"] = ratio(f.key, "gateway@1", "rps", float(f.cores))
        if f.kind == "gateway" and "gateway@2" in per and f.cores != 2:
            per[f.key]["efficiency_vs_2"] = ratio(f.key, "gateway@2", "rps", f.cores / 2)
    return per


def saturated_targets(summary: dict[str, Any], cores: list[int]) -> list[dict[str, Any]]:
    """Issue 28, replicas saturating: at every core count the gateway's p99 ≤ rr's and its
    req/s ≥ rr's (ratios per round, medians)."""
    out = []
    for n in cores:
        gw, rr = summary.get(f"gateway@{n}", {}), summary.get(f"rr@{n}", {})
        if gw.get("p99_vs_rr") is None:
            continue
        out.append(
            {
                "target": f"gateway p99 ≤ rr p99, {n} front cores",
                "value": f"{gw['p99_vs_rr']:.2f}x ({gw['p99_ms']:.2f} vs {rr['p99_ms']:.2f} ms)",
                "met": gw["p99_vs_rr"] <= 1.0,
            }
        )
        out.append(
            {
                "target": f"gateway req/s ≥ rr req/s, {n} front cores",
                "value": f"{gw['rps_vs_rr']:.2f}x ({gw['rps']:,.0f} vs {rr['rps']:,.0f})",
                "met": gw["rps_vs_rr"] >= 1.0,
            }
        )
    return out


def targets(summary: dict[str, Any], cores: list[int]) -> list[dict[str, Any]]:
    n = TARGET_CORES if TARGET_CORES in cores else max(cores)
    gw: dict[str, Any] = summary.get(f"gateway@{n}") or next(
        (s for s in summary.values() if s["kind"] == "gateway" and s["cores"] == n), {}
    )
    rr = summary.get(f"rr@{n}", {})
    where = f"{n} front cores" + ("" if n == TARGET_CORES else f" (target is at {TARGET_CORES})")
    out = []
    if gw.get("rps_vs_rr") is not None:
        out.append(
            {
                "target": f"gateway req/s ≥ rr req/s, {where}",
                "value": f"{gw['rps_vs_rr']:.2f}x ({gw['rps']:,.0f} vs {rr['rps']:,.0f})",
                "met": gw["rps_vs_rr"] >= 1.0,
            }
        )
    if gw.get("p99_vs_rr") is not None:
        out.append(
            {
                "target": f"gateway p99 ≤ {TARGET_P99_RATIO:g} x rr p99, {where}",
                "value": f"{gw['p99_vs_rr']:.2f}x ({gw['p99_ms']:.2f} vs {rr['p99_ms']:.2f} ms)",
                "met": gw["p99_vs_rr"] <= TARGET_P99_RATIO,
            }
        )
    if gw.get("efficiency") is not None:
        out.append(
            {
                "target": f"gateway efficiency rps(N)/(N x rps(1)) ≥ "
                f"{TARGET_EFFICIENCY:g}, N = {n}",
                "value": f"{gw['efficiency']:.2f}",
                "met": gw["efficiency"] >= TARGET_EFFICIENCY,
            }
        )
    return out


def _f(value: Any, fmt: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{fmt}}{suffix}"


def fake_kind(cfg: dict[str, Any]) -> str:
    if not cfg.get("fake_service_ms"):
        return "instant fake replicas"
    cap = cfg["fake_concurrency"] / (cfg["fake_service_ms"] / 1000.0)
    return (
        f"saturating fake replicas ({cfg['fake_concurrency']} slots x "
        f"{cfg['fake_service_ms']:g} ms: {cap:,.0f} req/s each, {cfg['fakes'] * cap:,.0f} "
        "in all)"
    )


def render(report: dict[str, Any]) -> str:
    cfg, machine, summary = report["config"], report["machine"], report["summary"]
    lines = [
        "# Many cores: gateway --workers N vs vllm-router, fronts on N dedicated cores",
        "",
        f"Command: `{cfg['command']}`" + (f" ({cfg['note']})" if cfg["note"] else ""),
        "",
        f"Machine: {machine['nproc']} CPUs ({len(cfg['layout']['available'])} usable), "
        f"{machine.get('cpu_model') or 'cpu model n/a'}, {machine['platform']}, Python "
        f"{machine['python']}; load average (1/5/15 min) at start "
        f"{fmt_load(machine['loadavg_at_start'])}, at end "
        f"{fmt_load(cfg['loadavg_at_end'])}. Layout: {cfg['layout']['detail']}."
        + (f" {machine['note']}" if machine.get("note") else ""),
        "",
        f"Load: {cfg['loadgens']} load generators x {cfg['connections']} keep-alive "
        f"connections = {cfg['loadgens'] * cfg['connections']} in flight (closed loop), "
        f"TRL-shaped token-id completions; {cfg['fakes']} {fake_kind(cfg)}. Per "
        f"measurement {cfg['warmup_s']:g} s warm-up + {cfg['duration_s']:g} s measured; "
        f"medians over {cfg['rounds_done']} interleaved rounds ({cfg['elapsed_s']:.0f} s "
        f"in all). Gateway: git {machine.get('git_head') or 'n/a'}, flags "
        f"`{cfg['gateway_flags']}`, workers {cfg['gateway_workers']}.",
        "",
        "| front | cores | workers | req/s | p50 | p90 | p99 | req/s vs rr | p99 vs rr "
        "| front busy (cores) | fake busy max/min | loadgen busy max | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    flags = []
    for key, s in summary.items():
        if not s["rounds"]:
            lines.append(
                f"| {key} | {s['cores'] or ''} | | failed: "
                f"{s.get('last_error', '')[:120]!r} | | | | | | | | | |"
            )
            continue
        workers = "" if s["kind"] in ("rr", "cache_aware", "direct") else s["workers"]
        lines.append(
            f"| {s['kind']} | {s['cores'] or ''} | {workers} | {s['rps']:,.0f} "
            f"| {s['p50_ms']:.2f} ms | {_f(s.get('p90_ms'), '.2f', ' ms')} | {s['p99_ms']:.2f} ms "
            f"| {_f(s.get('rps_vs_rr'), '.2f', 'x')} "
            f"| {_f(s.get('p99_vs_rr'), '.2f', 'x')} | {_f(s.get('front_busy_cores'), '.2f')} "
            f"| {s['fake_busy_max']:.2f}/{s['fake_busy_min']:.2f} | {s['loadgen_busy_max']:.2f} "
            f"| {s['errors']} |"
        )
        if s["loadgen_busy_max"] >= BUSY_FLAG or s["fake_busy_max"] >= BUSY_FLAG:
            flags.append(key)
    spread = [(k, s) for k, s in summary.items() if s.get("client_conns")]
    if spread:
        lines += [
            "",
            "**Per gateway process** (last round): client connections each process "
            "accepted (SO_REUSEPORT's spread) and each process's CPU in cores, busiest "
            "first:",
            "",
            "| front | client connections | CPU (cores) |",
            "|---|---|---|",
        ]
        for key, s in spread:
            busy = " ".join(f"{b:.2f}" for b in s.get("front_busy_each", []))
            lines.append(f"| {key} | {' '.join(map(str, s['client_conns']))} | {busy} |")
    gw = [(k, s) for k, s in summary.items() if s["kind"] == "gateway" and s["rounds"]]
    if gw:
        lines += [
            "",
            "**Gateway scaling** (efficiency = rps(N) / (N x rps(gateway@1)); vs 2 = rps(N) / "
            "(N/2 x rps(gateway@2)); per round, median):",
            "",
            "| cores | workers | req/s | efficiency | efficiency vs 2 cores |",
            "|---|---|---|---|---|",
        ]
        for _, s in sorted(gw, key=lambda kv: kv[1]["cores"]):
            lines.append(
                f"| {s['cores']} | {s['workers']} | {s['rps']:,.0f} "
                f"| {_f(s.get('efficiency'), '.2f')} | {_f(s.get('efficiency_vs_2'), '.2f')} |"
            )
    if report["targets"]:
        issue = "28" if cfg.get("fake_service_ms") else "19"
        lines += [
            "",
            f"**Targets (issue {issue}):**",
            "",
            "| target | value | result |",
            "|---|---|---|",
        ]
        for t in report["targets"]:
            verdict = "**met**" if t["met"] else "**NOT met**"
            lines.append(f"| {t['target']} | {t['value']} | {verdict} |")
    lines += ["", "Notes:", ""]
    lines.append(
        "- front busy = CPU time of the front's whole process tree over the window, in cores; "
        "fake/loadgen busy = fraction of their one core. req/s is the sum over load generators."
    )
    if flags:
        lines.append(
            f"- Harness near its limit (a load generator or a fake ≥ {BUSY_FLAG:g} of its core) "
            f"in: {', '.join(flags)}; those req/s may be the harness's, not the front's "
            "(compare with direct)."
        )
    if any(s["kind"] == "cache_aware" for s in summary.values()):
        lines.append(
            "- vllm-router cache_aware matches prompt text: with token-id prompts on real "
            "vLLM it sent everything to one worker (perf-calibration.md). Fake busy max/min "
            "shows how it spread these requests (at equal max and min, evenly)."
        )
    if not cfg["layout"]["dedicated"]:
        lines.append("- SMOKE layout: roles share CPUs; a functional check, not a measurement.")
    return "\n".join(lines) + "\n"


def safe_plot(report: dict[str, Any], path: Path) -> bool:
    """``plot``, but a plot must not cost the run its numbers."""
    try:
        return plot(report, path)
    except Exception as exc:
        print(f"cores.py: no plot: {exc!r}", file=sys.stderr)
        return False


def plot(report: dict[str, Any], path: Path) -> bool:
    if (plt := pyplot()) is None:
        return False
    summary = report["summary"]
    colors = {
        "gateway": "tab:blue",
        "rr": "tab:orange",
        "cache_aware": "tab:green",
        "gateway_rr": "tab:purple",
        "base": "tab:gray",
        "base_rr": "tab:brown",
    }
    fig, (ax_rps, ax_p99) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for key, s in summary.items():
        if (s["workers"] is not None or s["kind"] in colors) and s[
            "rounds"
        ]:  # matched: gateway@N with N workers, routers
            matched = key == f"{s['kind']}@{s['cores']}"
            series.setdefault((s["kind"], matched), []).append(s)
    for (kind, matched), pts in series.items():
        pts.sort(key=lambda s: int(s["cores"]))
        label = kind if matched else f"{kind}, workers {pts[0]['workers']}"
        style = "o-" if matched else "s--"
        xs = [s["cores"] for s in pts]
        color = colors.get(kind)
        ax_rps.plot(xs, [s["rps"] for s in pts], style, color=color, label=label)
        ax_p99.plot(xs, [s["p99_ms"] for s in pts], style, color=color, label=label)
    base = summary.get("gateway@1", {})
    if base.get("rounds"):
        xs = sorted({s["cores"] for s in summary.values() if s["kind"] == "gateway"})
        ax_rps.plot(
            xs,
            [x * base["rps"] for x in xs],
            ":",
            color="tab:blue",
            label="gateway ideal (N x 1 core)",
        )
    direct = summary.get("direct", {})
    if direct.get("rounds"):
        ax_rps.axhline(direct["rps"], color="tab:gray", ls="--", lw=1, label="direct (harness)")
    ax_rps.set(title="req/s vs front cores", xlabel="front cores", ylabel="req/s")
    ax_p99.set(title="p99 latency vs front cores", xlabel="front cores", ylabel="p99 ms")
    ticks = sorted({s["cores"] for s in summary.values() if s["cores"]})
    for ax in (ax_rps, ax_p99):
        ax.set_xticks(ticks)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['loadgens']} x {cfg['connections']} connections, {fake_kind(cfg)}, "
        f"medians of {cfg['rounds_done']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_BUSY = (
    "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"
    "print(time.process_time())"
)


def affinity_check(cpu: int, seconds: float = 0.6) -> dict[str, Any]:
    """Two busy loops pinned to one CPU for ``seconds``: together they get ~``seconds`` of CPU
    where affinity is enforced, ~2x that where it is not (gVisor, say)."""
    kids = [
        subprocess.Popen(
            [PY, "-c", _BUSY.format(s=seconds)], stdout=subprocess.PIPE, preexec_fn=pin({cpu})
        )
        for _ in range(2)
    ]
    used = []
    for kid in kids:
        try:
            out, _ = kid.communicate(timeout=30)
            used.append(float(out.decode().strip() or "nan"))
        except (subprocess.TimeoutExpired, ValueError):
            kid.kill()
            kid.wait(timeout=10)
            used.append(float("nan"))
    total = sum(used)
    return {"cpu": cpu, "seconds": seconds, "cpu_s": [round(u, 3) for u in used],
            "enforced": bool(total < 1.5 * seconds)}  # fmt: skip


def machine_extra(layout: Layout) -> dict[str, Any]:
    info = machine_info(("rollout-gateway", "uvloop", "vllm-router"), placement="cores")
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    siblings: dict[str, str] = {}
    for c in layout.available:
        p = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        with contextlib.suppress(OSError):
            siblings[str(c)] = p.read_text().strip()
    info.update(
        cpu_model=model,
        kernel=platform.release(),
        thread_siblings=siblings,
        pythonpath=os.environ.get("PYTHONPATH", ""),
    )
    smt = any("," in v or "-" in v for v in siblings.values())
    notes = []
    check = affinity_check(layout.front[-1])
    info["affinity_check"] = check
    if not check["enforced"]:
        notes.append(
            f"CPU affinity NOT enforced: two busy loops pinned to CPU {check['cpu']} got "
            f"{sum(check['cpu_s']):.2f} s of CPU in {check['seconds']:g} s, so the layout is "
            "nominal here."
        )
    if smt:
        notes.append("SMT: some CPUs are hyperthread siblings (thread_siblings in the JSON).")
    if platform.release().startswith("4.4.0"):
        notes.append("Kernel 4.4.0: likely gVisor, where CPU affinity may not be enforced.")
    info["note"] = " ".join(notes)
    return info


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=_default_estimate(),
    )
    parser.add_argument("--cores", help="front core counts, e.g. 2,4,8 (default; smoke: 1)")
    parser.add_argument("--fronts", default=",".join(FRONT_KINDS), help="gateway,rr,cache_aware")
    parser.add_argument(
        "--duration-s",
        type=float,
        help=f"measured seconds per point "
        f"(default {DEFAULTS['duration_s']:g}; smoke {SMOKE['duration_s']:g})",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        help=f"untimed closed-loop warm-up per point "
        f"(default {DEFAULTS['warmup_s']:g}; smoke {SMOKE['warmup_s']:g})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help=f"interleaved rounds, medians reported "
        f"(default {DEFAULTS['rounds']}; smoke {SMOKE['rounds']})",
    )
    parser.add_argument("--loadgens", type=int, help="load generator processes (default 4)")
    parser.add_argument("--fakes", type=int, help="instant fake replicas (default 4)")
    parser.add_argument("--connections", type=int, help="per load generator (default 64)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="start no round expected to end after this (s since start)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny functional check (2 CPUs enough, roles overlap): cores 1, "
        "2 loadgens x 16 connections, 2 fakes, 3 s, 1 round",
    )
    parser.add_argument("--out-dir", type=Path, help="default bench/results (smoke: a tmp dir)")
    parser.add_argument(
        "--fake-service-ms",
        type=float,
        default=0.0,
        help="saturating fakes: each completion holds one of --fake-concurrency slots this "
        "long (default 0: instant fakes)",
    )
    parser.add_argument(
        "--fake-concurrency",
        type=int,
        default=56,
        help="saturating fakes: slots per fake (capacity = slots / service time; default 56)",
    )
    parser.add_argument(
        "--base-tree",
        type=Path,
        help="a directory holding another commit's gateway/ (fronts base, base_rr)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE[,VAR=VALUE]",
        help="also measure this tree's gateway with these environment variables, as NAME "
        "(e.g. 'tight:GATEWAY_ROUTING={\"load_epsilon\":0.05}'); repeatable",
    )
    parser.add_argument(
        "--name",
        help="output basename (default cores; cores-saturated with --fake-service-ms)",
    )
    args = parser.parse_args(argv)
    scale = SMOKE if args.smoke else DEFAULTS
    for k, v in scale.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.connections is None:
        args.connections = 16 if args.smoke else 64
    if args.cores is None:
        args.cores = "1" if args.smoke else ",".join(map(str, DEFAULT_CORES))
    try:
        args.core_counts = sorted({int(c) for c in args.cores.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--cores: comma-separated integers, got {args.cores!r}")
    if not args.core_counts or min(args.core_counts) < 1:
        parser.error("--cores: at least one core count, each >= 1")
    args.front_kinds = [f.strip() for f in args.fronts.split(",") if f.strip()]
    if unknown := set(args.front_kinds) - set(FRONT_KINDS) - set(EXTRA_KINDS):
        parser.error(
            f"--fronts: unknown {sorted(unknown)} (choose from {FRONT_KINDS + EXTRA_KINDS})"
        )
    if any(k.startswith("base") for k in args.front_kinds) and not (
        args.base_tree and (args.base_tree / "gateway").is_dir()
    ):
        parser.error("--fronts base/base_rr need --base-tree DIR holding a gateway/ package")
    args.variant_env = {}
    for spec in args.variant:
        name, _, assigns = spec.partition(":")
        pairs = [a.partition("=") for a in assigns.split(",")] if assigns else []
        if (
            not name
            or name in FRONT_KINDS + EXTRA_KINDS
            or any(not k or not e for k, e, _ in pairs)
        ):
            parser.error(f"--variant: NAME:VAR=VALUE[,VAR=VALUE], a new NAME; got {spec!r}")
        args.variant_env[name] = {k: v for k, _, v in pairs}
    if args.fake_service_ms < 0 or args.fake_concurrency < 1:
        parser.error("--fake-service-ms must be >= 0 and --fake-concurrency >= 1")
    if args.name is None:
        args.name = "cores-saturated" if args.fake_service_ms else "cores"
    if min(args.duration_s, args.rounds, args.loadgens, args.fakes, args.connections) <= 0:
        parser.error("durations, rounds, loadgens, fakes and connections must be > 0")
    return args


def plan(args: argparse.Namespace, layout: Layout) -> list[Front]:
    """Every front to start and measure; gateway@1 (1 worker, 1 core) is the base."""
    fronts: list[Front] = []
    counts = list(args.core_counts)
    # The 1-core base of the scaling efficiency; not with saturating fakes (no efficiency).
    if "gateway" in args.front_kinds and 1 not in counts and not args.fake_service_ms:
        fronts.append(Front("gateway@1", "gateway", 1, layout.front[:1], [], workers=1))
    for n in counts:
        for kind in args.front_kinds:
            workers = n if kind in GATEWAY_KINDS else None
            fronts.append(Front(f"{kind}@{n}", kind, n, layout.front[:n], [], workers=workers))
        for name, env in args.variant_env.items():
            fronts.append(Front(f"{name}@{n}", name, n, layout.front[:n], [], n, env))
    return fronts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM (a time limit, say) unwinds like Ctrl-C: every process started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budget = Budget(args.budget_s, reserve=TEARDOWN_S)
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not available:
        available = list(range(os.cpu_count() or 1))
    layout = compute_layout(
        available, max(args.core_counts), args.fakes, args.loadgens, smoke=args.smoke
    )
    fronts = plan(args, layout)
    if hasattr(os, "sched_setaffinity"):  # this process's own scans and waits: harness CPUs
        os.sched_setaffinity(0, set(layout.loadgen) | set(layout.fake))
    direct = Front("direct", "direct", 0, [], [])
    measured = [*fronts, direct]
    every = list(measured)  # the report's rows, those that failed to start included
    est = estimate_s(len(measured), args.rounds, args.duration_s, args.warmup_s)
    print(
        f"cores.py: {len(measured)} measurements x {args.rounds} rounds, estimated "
        f"{est:.0f} s; layout: {layout.describe()}",
        file=sys.stderr,
    )
    info = machine_extra(layout)
    log_dir = Path(tempfile.mkdtemp(prefix=f"cores-{os.getpid()}-"))
    out_dir: Path = args.out_dir or (log_dir if args.smoke else HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    gw_flags = "--host 127.0.0.1 --log-level WARNING"
    config: dict[str, Any] = {
        "command": shlex.join(getattr(sys, "orig_argv", [PY, *sys.argv])),
        "note": "",
        "cores": args.core_counts,
        "fronts": args.front_kinds,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "rounds": args.rounds,
        "loadgens": args.loadgens,
        "fakes": args.fakes,
        "connections": args.connections,
        "gateway_workers": "match",
        "gateway_flags": gw_flags,
        "router_flags": "--policy round_robin | cache_aware (vllm-router defaults otherwise)",
        "smoke": args.smoke,
        "fake_service_ms": args.fake_service_ms,
        "fake_concurrency": args.fake_concurrency if args.fake_service_ms else None,
        "base_tree": str(args.base_tree) if args.base_tree else None,
        "variants": args.variant_env,
        "estimate_s": round(est),
        "layout": {**layout.__dict__, "detail": layout.describe()},
        "log_dir": str(log_dir),
    }
    rounds: list[dict[str, dict[str, Any]]] = []
    round_info: list[dict[str, Any]] = []

    def write_all() -> dict[str, Any]:
        config.update(
            rounds_done=len(rounds), elapsed_s=round(budget.elapsed(), 1), loadavg_at_end=loadavg()
        )
        summary = summarize(rounds, every)
        report = {
            "machine": info,
            "config": config,
            "summary": summary,
            "targets": (saturated_targets if args.fake_service_ms else targets)(
                summary, args.core_counts
            ),
            "round_info": round_info,
            "rounds": rounds,
        }
        paths = write(out_dir, args.name, report, render(report), safe_plot)
        config["plot"] = any(p.suffix == ".png" for p in paths)
        return report

    harness = Fleet(log_dir, {f"fake{i}": {c} for i, c in enumerate(layout.fake)})
    fake_urls: list[str] = []
    fake_pids: list[int] = []
    try:
        fake_flags = (
            [
                "--service-ms",
                f"{args.fake_service_ms:g}",
                "--concurrency",
                str(args.fake_concurrency),
            ]
            if args.fake_service_ms
            else []
        )
        fakes = harness.upstreams(
            args.fakes, roles=[f"fake{i}" for i in range(args.fakes)], flags=fake_flags
        )
        fake_urls, fake_pids = [f.url for f in fakes], [f.pid for f in fakes]
        fake_ports = [port_of(u) for u in fake_urls]
        direct.urls = [fake_urls[i % len(fake_urls)] for i in range(args.loadgens)]
        for f in fronts:
            start_front(f, fake_urls, log_dir, args, args.loadgens)
        for f in fronts:
            assert f.proc is not None
            try:
                f.proc.wait_http("/health", timeout=90)
            except (RuntimeError, TimeoutError) as exc:  # reported; the others still run
                f.error = f"did not start: {exc}"
                print(f"cores.py: {f.key} {f.error}", file=sys.stderr)
                if f.proc.alive:
                    f.proc.stop(grace=5)
        measured = [f for f in measured if not f.error]
        print(
            f"cores.py: {len(fronts)} fronts started, {len(measured)} to measure, after "
            f"{budget.elapsed():.1f} s",
            file=sys.stderr,
        )
        rounds_to_run = args.rounds if measured else 0
        for r, order, _ in paired_rounds(measured, rounds_to_run, budget, round_info, key_of):
            this: dict[str, dict[str, Any]] = {}
            for f in order:
                try:
                    m = measure(f, layout, args, fake_pids, log_dir, fake_ports)
                except RuntimeError as exc:
                    this[f.key] = {"error": str(exc)}
                    print(f"round {r + 1} {f.key:>15}: FAILED {exc}", file=sys.stderr)
                    continue
                this[f.key] = m
                print(
                    f"round {r + 1} {f.key:>15}: {m['rps']:>9,.0f} req/s p50 {m['p50_ms']:.2f} "
                    f"p99 {m['p99_ms']:.2f} ms front busy {m.get('front_busy_cores', 0):.2f} "
                    f"fakes {m['fake_busy']} loadgens {m['loadgen_busy']} "
                    f"skew {m['start_skew_ms']} ms errors {m['errors']}",
                    file=sys.stderr,
                )
            rounds.append(this)
            write_all()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the cleanup finish
        # Every process of every front (a gateway's workers too), to check after the stop.
        started = {pid: ident(pid) for f in fronts if f.proc for pid in cpu.tree(f.proc.pid)}
        stop_all([p for f in fronts if f.fleet for p in f.fleet.procs], grace=15, kill_wait=5)
        harness.stop_all()
        left = [pid for pid, who in started.items() if who is not None and ident(pid) == who]
        for pid in left:  # outlived its parent: ours (same PID and start time), by PID
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if left:
            print(f"cores.py: killed {len(left)} leftover front processes {left}", file=sys.stderr)
    report = write_all()
    print(render(report))
    kinds = "json,md,png" if config.get("plot") else "json,md (no matplotlib: no png)"
    print(f"cores.py: wrote {out_dir}/{args.name}.{{{kinds}}}; logs in {log_dir}", file=sys.stderr)
    bad = any("error" in m or int(m["errors"]) for rnd in rounds for m in rnd.values())
    return 1 if bad or not rounds else 0


if __name__ == "__main__":
    sys.exit(main())
