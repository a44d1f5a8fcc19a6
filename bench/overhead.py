"""Gateway overhead vs direct access and vs vllm-router, side by side in one run.

Starts two instant fake upstreams (``bench.lib.upstream``), the gateway (current
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
import os
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.lib

from bench.lib import load
from bench.lib.fronts import CLIENT_CPU, FRONT_CPU, PY, Fleet, Front, split_cores
from bench.lib.report import fmt_load, loadavg, machine_info, write
from bench.lib.rounds import Budget, med, paired_rounds, ratio_per_round

HERE = Path(__file__).resolve().parent
CONCURRENCY = 64
PACED_KINDS = ("paced", "paced_cap")
PACKAGES = ("rollout-gateway", "uvicorn", "uvloop", "httptools", "aiohttp", "orjson",
            "vllm-router")  # fmt: skip


def run(
    fleet: Fleet,
    front: Front,
    requests: int,
    *,
    concurrency: int = CONCURRENCY,
    warmup: int = 0,
    max_seconds: float,
    rate: float = 0.0,
    measure_cpu: bool = True,
) -> dict[str, object]:
    """One load run against ``front`` from the client CPU; with ``measure_cpu``, the
    front's CPU per request over the measured requests only."""
    return load.run_client(front.url, fleet.cpus("client"), concurrency=concurrency,
                           requests=requests, warmup=warmup, max_seconds=max_seconds,
                           rate=rate, cpu_pid=front.pid if measure_cpu else 0)  # fmt: skip


def num(value: object) -> float:
    return float(value)  # type: ignore[arg-type]


@contextlib.contextmanager
def fleet_up(args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[Fleet, dict[str, Front]]]:
    """Two instant upstreams and every front over them, all answering ``/health``."""
    with Fleet(log_dir, split_cores(args.placement)) as fleet:
        replicas = [up.url for up in fleet.upstreams(2)]
        fronts = {"direct": Front("direct", replicas[0], fleet.procs[0])}
        fronts["gateway"] = fleet.gateway(replicas)
        if args.baseline is not None:  # the same flags, another tree's code
            src = args.baseline.resolve()  # cwd first on sys.path: that tree's package
            env = {**os.environ, "PYTHONPATH": str(src)}
            fronts["gateway-before"] = fleet.gateway(replicas, name="gateway-before", env=env,
                                                     cwd=src)  # fmt: skip
        for k in args.workers_variant:  # the same flags, ``--workers K``, same placement
            name = f"gateway-w{k}"
            fronts[name] = fleet.gateway(replicas, name=name, flags=["--workers", str(k)])
        if args.floor:  # Python's floor on this core: bench/ceiling.py's ``_floor`` front
            argv = [PY, str(HERE / "ceiling.py"), "_floor"]
            fronts["floor"] = fleet.serve("floor", argv + [f"--replica={u}" for u in replicas])
        router = None if args.no_router else fleet.vllm_router(replicas)
        if router is not None:
            fronts["vllm-router"] = router
        for front in fronts.values():
            front.wait(timeout=60)
        yield fleet, fronts


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

    budget = Budget(args.budget_s)
    info = machine_info(PACKAGES, placement=args.placement)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"overhead-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict[str, dict[str, object]]]] = []
    round_info: list[dict[str, object]] = []
    with fleet_up(args, log_dir) as (fleet, fronts):
        names = list(fronts)
        # Warm-up: connections, JIT-free but caches/pools/allocators settle.
        for name in names:
            run(fleet, fronts[name], tput_warm, max_seconds=per_run_max, measure_cpu=False)
            run(fleet, fronts[name], lat_warm, concurrency=1, max_seconds=per_run_max,
                measure_cpu=False)  # fmt: skip
        for r, order, note in paired_rounds(names, args.rounds, budget, round_info):
            this: dict[str, dict[str, dict[str, object]]] = {name: {} for name in order}
            for name in order:
                lat = run(fleet, fronts[name], args.lat_requests, concurrency=1,
                          warmup=lat_warm // 2, max_seconds=per_run_max)  # fmt: skip
                tput = run(fleet, fronts[name], args.tput_requests, warmup=tput_warm // 2,
                           max_seconds=per_run_max)  # fmt: skip
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
                    res = run(fleet, fronts[name], n, max_seconds=paced_max, rate=rate)
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
            note.update(paced_rate=args.paced_rate, capacity_rate=cap_rate)
    elapsed = budget.elapsed()

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
            "elapsed_s": round(elapsed, 1),
            "loadavg_at_end": loadavg(),
        },
        "round_info": round_info,
        "rounds": rounds,
        "summary": summary,
    }
    table = render(report)
    print(table)
    if not args.no_write:
        write(args.out_dir, "overhead", report, table)
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
            s["rps_vs_vllm_router"] = ratio_per_round(
                rounds, name, "vllm-router", lambda f: num(f["throughput"]["rps"])
            )
            s["cpu_efficiency_vs_vllm_router"] = ratio_per_round(
                rounds, "vllm-router", name, lambda f: num(f["throughput"]["front_cpu_us_per_req"])
            )
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
    lines.append(f"Gateway: git {machine['git_head']}{dirty}, flags {cfg['gateway_flags']}.")
    return "\n".join(lines) + "\n"


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
