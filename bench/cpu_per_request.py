"""Gateway CPU per proxied request, variant against variant, robust on a noisy machine.

Wall-clock req/s on a shared 2-core box swings by +-15 % or more; the CPU the gateway
process itself burns per request barely moves. This script starts one instant upstream
(``bench/instant_upstream.py``) and one gateway per *variant* (a source tree holding a
``gateway`` package: ``python -m gateway serve`` with ``PYTHONPATH`` set to that tree), the
gateways pinned to CPU 1 and upstream + load client to CPU 0. Then, for ``--rounds``
alternations with the variant order rotated, it reads utime+stime of the gateway from
``/proc/PID/stat`` before and after ``bench/loadgen.py`` runs:

* throughput: ``--tput-requests`` requests at ``--concurrency`` (64) in flight;
* latency: ``--lat-requests`` requests at 1 in flight;
* paced (with ``--rate R``): ``--tput-requests`` requests offered open-loop at R req/s over
  ``--concurrency`` connections. Closed-loop CPU per request depends on how many requests
  each loop wake-up batches, which moves with the load client's speed on a busy host; a
  fixed arrival rate gives every variant the same pattern;
* streams (with ``--stream``): the upstream and client are ``bench/ceiling.py``'s (16 SSE
  token events and ``[DONE]`` per request, one upstream write each; 64 connections); no
  latency run.

us/request = delta CPU / requests; the table shows medians over rounds, plus req/s and p50.

    .venv/bin/python bench/cpu_per_request.py --variant main=/tmp/base --variant perf=.

Each gateway gets one replica (the upstream) and ``--log-level warning``. Only processes
started here are stopped, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_testbed.procs import Proc, free_port, stop_all

HERE = Path(__file__).resolve().parent
PY = sys.executable
CLIENT_CPU, FRONT_CPU = 0, 1
_TICK = os.sysconf("SC_CLK_TCK")


def _pin(cpu: int) -> Callable[[], None] | None:
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all threads), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15 of stat(5)


def _start(name: str, argv: list[str], cpu: int, **kw: Any) -> Proc:
    """A child pinned to ``cpu``, its output on ours, signalled by PID (no session)."""
    proc = Proc(name, argv, preexec_fn=_pin(cpu), new_session=False, inherit_output=True, **kw)
    return proc.start()


def loadgen(
    url: str, mode: str, requests: int, concurrency: int, rate: float | None = None,
    stream: bool = False,
) -> dict[str, object]:  # fmt: skip
    if stream:
        argv = [PY, str(HERE / "ceiling.py"), "_client", "--url", url, "--stream"]
        argv += ["--requests", str(requests)]
    else:
        argv = [PY, str(HERE / "loadgen.py"), "--url", url, "--mode", mode]
        argv += ["--requests", str(requests), "--concurrency", str(concurrency)]
    if rate:
        argv += ["--rate", str(rate)]
    argv += ["--max-seconds", "120"]
    out = subprocess.run(argv, capture_output=True, timeout=200, preexec_fn=_pin(CLIENT_CPU))
    try:
        result: dict[str, object] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"loadgen failed: {out.stderr.decode()[-2000:]}") from exc
    return result


def measure(
    url: str, pid: int, mode: str, requests: int, concurrency: int, rate: float | None = None,
    stream: bool = False,
) -> dict[str, float]:  # fmt: skip
    before = cpu_seconds(pid)
    res = loadgen(url, mode, requests, concurrency, rate, stream)
    used = cpu_seconds(pid) - before
    done = int(res["requests"])  # type: ignore[call-overload]
    if int(res["errors"]) or done < requests:  # type: ignore[call-overload]
        raise RuntimeError(f"{url} {mode}: {res}")
    return {
        "us_per_req": used * 1e6 / done,
        "rps": float(res["rps"]),  # type: ignore[arg-type]
        "p50_ms": float(res["p50_ms"]),  # type: ignore[arg-type]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--variant", action="append", required=True, metavar="NAME=TREE",
        help="a source tree containing the gateway package (repeat; first = baseline)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tput-requests", type=int, default=20000)
    parser.add_argument("--lat-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, help="paced instead of closed loop (req/s)")
    parser.add_argument("--stream", action="store_true", help="SSE streams (no latency run)")
    parser.add_argument("--json", type=Path, help="also write the raw rounds here")
    args = parser.parse_args(argv)
    variants = dict(v.split("=", 1) for v in args.variant)

    up_port = free_port()
    procs: list[Proc] = []
    try:
        up_cmd = [PY, str(HERE / "instant_upstream.py"), "--port", str(up_port)]
        if args.stream:
            up_cmd = [PY, str(HERE / "ceiling.py"), "_upstream", "--port", str(up_port)]
        up = f"http://127.0.0.1:{up_port}"
        procs.append(_start("upstream", up_cmd, CLIENT_CPU, url=up))
        procs[-1].wait_http("/health", timeout=30)
        fronts: dict[str, tuple[str, int]] = {}
        for name, tree in variants.items():
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            cmd = [PY, "-m", "gateway", "serve", "--replica", up, "--port", str(port)]
            cmd += ["--log-level", "warning"]
            url = f"http://127.0.0.1:{port}"
            p = _start(name, cmd, FRONT_CPU, url=url, env=env, cwd=tree)
            procs.append(p)
            fronts[name] = (url, p.pid)
        for p in procs[1:]:
            p.wait_http("/health", timeout=30)
        for url, _ in fronts.values():  # warm-up: connections, caches, allocator
            loadgen(url, "throughput", 3000, args.concurrency, stream=args.stream)
            if not args.stream:
                loadgen(url, "latency", 300, 1)

        names = list(fronts)
        rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                url, pid = fronts[name]
                t = measure(url, pid, "throughput", args.tput_requests, args.concurrency,
                            args.rate, args.stream)  # fmt: skip
                row = {f"tput_{k}": v for k, v in t.items()}
                if not args.stream:
                    lat = measure(url, pid, "latency", args.lat_requests, 1)
                    row.update({f"lat_{k}": v for k, v in lat.items()})
                rows[name].append(row)
                print(f"round {r + 1} {name}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()),
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        stop_all(list(reversed(procs)), grace=10, kill_wait=5)

    base = names[0]
    med = {n: {k: statistics.median(x[k] for x in rows[n]) for k in rows[n][0]} for n in names}
    load = f"{args.rate:g}/s paced" if args.rate else f"@{args.concurrency}"
    if args.stream:
        load = f"streams {load}"
    print(f"| variant | us/req {load} | vs {base} | req/s {load} "
          "| us/req @1 | vs base | req/s @1 | p50 @1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")

    def paired(n: str, key: str) -> float:
        """Median over rounds of the ratio within each round: the variants of one round
        ran back to back, so this cancels most of the host's drift between rounds."""
        return statistics.median(r[key] / b[key] for r, b in zip(rows[n], rows[base], strict=True))

    for n in names:
        m = med[n]
        cells = (
            f"{m['lat_us_per_req']:.0f} | {paired(n, 'lat_us_per_req'):.2f}x"
            f" | {m['lat_rps']:,.0f} | {m['lat_p50_ms']:.3f} ms"
            if not args.stream
            else "- | - | - | -"
        )
        print(
            f"| {n} | {m['tput_us_per_req']:.0f} | {paired(n, 'tput_us_per_req'):.2f}x"
            f" | {m['tput_rps']:,.0f} | {cells} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "median": med}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
