"""Throughput ceiling: the highest request rate each front sustains, side by side in one run.

Fronts: ``direct`` (upstream 1 itself), ``gateway`` (the current tree, ``--log-level
WARNING``), ``vllm-router`` (Rust, ``round_robin``), ``floor`` (``_floor`` below: a bare
asyncio protocol on uvloop + httptools forwarding round robin through the gateway's own
upstream client, no ASGI server and no gateway feature: what a Python proxy can do on this
core). The ``passthrough`` front of earlier runs (uvicorn + aiohttp, where the gateway stood
before its own client and server protocol) is ``bench/ceiling.py`` at ``4a5220d``; the
committed result still has its row. All sit in front of the SAME two instant
upstreams, which this script runs itself (``_upstream`` below): a non-streaming request gets
``bench.lib.upstream``'s canned ~0.9 KB completion; a request with ``"stream": true``
gets 16 vLLM-shaped SSE token events and ``data: [DONE]``, each event its own HTTP chunk and
its own ``write()``. (The FastAPI sim replica was measured at ~800 req/s on this machine, far
below the fronts, so it cannot serve as the upstream here.)

Per mode (non-streaming, streaming):

* **closed loop**, 64 in flight for ``--closed-seconds``: reference req/s per front;
* **ladder**: open-loop paced load (``bench.lib.load.run_paced``, 64 connections, latency
  from the *scheduled* send, so no coordinated omission) at each offered rate of
  ``--rates`` (streaming: ``--stream-rates``, finer and lower); each rate is run ``--reps``
  times interleaved across fronts (ABC BCA CAB) and the medians decide. A front *sustains*
  a rate when it achieved >= 97 % of it, <= 1 % of sends were late, nothing was unsent,
  nothing failed and (not for direct) its p99 minus direct's p99 in the same repetition is
  <= 10 ms. A front's ladder stops after its second failed rate; the ladder stops for every
  front if direct fails (the harness's own limit). Max sustained rate = the highest rate
  sustained. A streaming request counts as complete
  at ``data: [DONE]``; a stream without all 16 events and ``[DONE]`` is an error.

Then the gateway is profiled with py-spy at its non-streaming ceiling: a flame graph
(``ceiling-profile.svg``) and, from a second recording of raw stacks at the same load, the
own-time samples grouped by layer (uvicorn/httptools server, Starlette/ASGI, gateway code,
aiohttp client, event loop/syscalls) in ``ceiling.md``. Front CPU time per request and the
share of its core in use (``/proc/PID/task/*/schedstat``) are recorded at every point.

Placement (``--placement split``, as ``bench/overhead.py``): the front under test alone on
CPU 1; the load client, both upstreams and py-spy on CPU 0.

    # the committed result (make bench-ceiling), <= 15 min: each product at its default
    .venv/bin/python bench/ceiling.py --router-policy cache_aware --out-dir bench/results/ceiling
    .venv/bin/python bench/ceiling.py --quick    # smoke, ~1-2 minutes, writes nothing
    # like for like: both fronts round robin (the gateway's default is prefix affinity)
    .venv/bin/python bench/ceiling.py --gateway-router round_robin --modes non-streaming \
        --out-dir /tmp/ceiling-round-robin

Writes ``ceiling.{json,md,png}``, ``ceiling-profile.svg`` and ``ceiling-profile.raw.txt`` in
``--out-dir`` (default ``bench/results/ceiling``, the result the docs cite).
Only processes started here are stopped, by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run by path: bench.lib

from bench.lib import cpu, load  # noqa: E402
from bench.lib.fronts import BIN, CLIENT_CPU, FRONT_CPU, PY, Fleet, Front, pin, split_cores  # noqa: E402
from bench.lib.report import fmt_load, loadavg, machine_info, pyplot, write  # noqa: E402
from bench.lib.rounds import Budget, med, rotated  # noqa: E402
from bench.lib.upstream import STREAM_TOKENS, serve_forever  # noqa: E402

CONNECTIONS = 64
PACKAGES = (
    "rollout-gateway",
    "uvicorn",
    "uvloop",
    "httptools",
    "aiohttp",
    "orjson",
    "vllm-router",
    "py-spy",
)
MODES = ("non-streaming", "streaming")
FRONTS = ("direct", "floor", "gateway", "vllm-router")
DEFAULT_RATES = (500, 1000, 1500, 2000, 2500, 3000, 4000, 5000, 6000, 8000)
# Streams cost every front more per request: a finer ladder lower down.
DEFAULT_STREAM_RATES = (250, 500, 750, 1000, 1500, 2000, 3000, 4000, 5000, 6000)
ADDED_P99_LIMIT_MS = 10.0
MIN_ACHIEVED = 0.97
MAX_LATE = 0.01
TARGET_RPS = 3000.0
# ---------------------------------------------------------------------------------------------
# Python's floor, run as `ceiling.py _floor --port P --replica U ...`: no ASGI server at all.
# A bare asyncio protocol parses requests with httptools and answers each in one write, and
# the gateway's own upstream client (gateway/http/h1client.py) forwards them round robin. There is
# no routing, hygiene, limit, metric or error mapping: what it sustains bounds what any
# Python proxy on uvloop + httptools can on one core.


class _FloorConn(asyncio.Protocol):
    pools: list[Any] = []
    turn: Iterator[int] = iter(())

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.WriteTransport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        if url == b"/health":
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        asyncio.get_running_loop().create_task(self.forward(url, body))

    async def forward(self, url: bytes, body: bytes) -> None:
        transport = self.transport
        assert transport is not None
        pool = self.pools[next(self.turn)]
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
            url,
            pool.host.encode(),
        )
        resp = await pool.request(head + b"content-length: %d\r\n\r\n" % len(body), body)
        ctype = resp.content_type.encode()
        if resp.content_length is None:  # SSE: relay as it comes, re-chunked
            transport.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
                % (resp.status, ctype)
            )
            async for chunk in resp.content.iter_any():
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            transport.write(b"0\r\n\r\n")
        else:
            data = await resp.read()
            transport.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (resp.status, ctype, len(data), data)
            )
        resp.release()


def floor_main(argv: list[str]) -> int:
    import itertools
    from urllib.parse import urlsplit

    import uvloop

    from gateway.http.h1client import H1Pool

    parser = argparse.ArgumentParser(prog="ceiling.py _floor")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True)
    args = parser.parse_args(argv)

    async def serve() -> None:
        parts = [urlsplit(u) for u in args.replica]
        _FloorConn.pools = [H1Pool(i, p.hostname or "", p.port or 80) for i, p in enumerate(parts)]
        _FloorConn.turn = itertools.cycle(range(len(parts)))
        await serve_forever(_FloorConn, args.port)

    uvloop.run(serve())
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestration.


def run_client(
    fleet: Fleet,
    front: Front,
    *,
    stream: bool,
    rate: float,
    requests: int,
    max_seconds: float,
    warmup: int = 0,
) -> dict[str, Any]:
    """One point: ``bench.lib.load`` on the client CPU against ``front``, with its CPU."""
    return load.run_client(
        front.url,
        fleet.cpus("client"),
        concurrency=CONNECTIONS,
        stream=stream,
        rate=rate,
        requests=requests,
        max_seconds=max_seconds,
        warmup=warmup,
        cpu_pid=front.pid,
    )


@contextlib.contextmanager
def fleet_up(
    placement: str,
    log_dir: Path,
    *,
    with_router: bool = True,
    gateway_router: str | None = None,
    router_policy: str = "round_robin",
) -> Iterator[tuple[Fleet, dict[str, Front]]]:
    """Two upstreams, the gateway and vllm-router (same flags as ``bench/overhead.py``)
    and the floor; every front on the front core, all ready."""
    with Fleet(log_dir, split_cores(placement)) as fleet:
        replicas = [up.url for up in fleet.upstreams(2)]
        fronts = {"direct": Front("direct", replicas[0], fleet.procs[0])}
        flags = ["--router", gateway_router] if gateway_router else []
        fronts["gateway"] = fleet.gateway(replicas, flags=flags)
        own = [PY, str(Path(__file__).resolve())]
        to = [f"--replica={u}" for u in replicas]
        fronts["floor"] = fleet.serve("floor", [*own, "_floor", *to])
        router = fleet.vllm_router(replicas, router_policy) if with_router else None
        if router is not None:
            fronts["vllm-router"] = router
        for front in fronts.values():
            front.wait(timeout=60)
        yield fleet, fronts


@dataclass
class Clock(Budget):
    """The run's budget, and how long runs take beyond their load, so that a ladder never
    starts what cannot finish."""

    run_s: list[float] = field(default_factory=list)

    def per_run_overhead(self) -> float:
        return sum(self.run_s) / len(self.run_s) if self.run_s else 1.0  # mean: cautious


def passes(point: dict[str, Any], front: str) -> bool:
    """The sustained-rate rule (see the module docstring), on a point's medians."""
    ok = (
        point["achieved_ratio"] >= MIN_ACHIEVED
        and point["late_fraction"] <= MAX_LATE
        and point["unsent"] == 0
        and point["errors"] == 0
    )
    if front != "direct":
        ok = ok and point["added_p99_ms"] <= ADDED_P99_LIMIT_MS
    return bool(ok)


def summarize_point(runs: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions; added latency is front - direct per repetition."""

    def col(key: str) -> list[float]:
        return [float(r[key]) for r in runs if key in r]

    added = [float(r["p99_ms"]) - float(d["p99_ms"]) for r, d in zip(runs, direct, strict=False)]
    added50 = [float(r["p50_ms"]) - float(d["p50_ms"]) for r, d in zip(runs, direct, strict=False)]
    requests = sum(col("requests"))
    return {
        "reps": len(runs),
        "achieved_rps": med([r["rps"] for r in runs]),
        "achieved_ratio": med(col("achieved_ratio")),
        "p50_ms": med(col("p50_ms")),
        "p99_ms": med(col("p99_ms")),
        "added_p50_ms": med(added50),
        "added_p99_ms": med(added),
        "service_p99_ms": med(col("service_p99_ms")),
        "late_fraction": med(col("late_fraction")),
        "late_sends": int(sum(col("late_sends"))),
        "unsent": int(sum(col("unsent"))),
        "errors": int(sum(col("errors"))),
        "requests": int(requests),
        "max_in_flight": int(max(col("max_in_flight"), default=0)),
        "front_cpu_util": med(col("front_cpu_util")),
        "front_cpu_us_per_req": med(col("front_cpu_us_per_req")),
        "client_cpu_us_per_req": med(col("client_cpu_us_per_req")),
    }


def ladder(
    fleet: Fleet,
    fronts: dict[str, Front],
    *,
    stream: bool,
    rates: list[float],
    reps: int,
    seconds: float,
    min_requests: int,
    clock: Clock,
    deadline_s: float,
) -> dict[str, Any]:
    """Step the offered rate; every rate ``reps`` times interleaved over the active fronts."""
    mode = MODES[1] if stream else MODES[0]
    order = [f for f in FRONTS if f in fronts]
    active = list(order)
    failures: Counter[str] = Counter()
    points: dict[str, dict[str, dict[str, Any]]] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    stop_reason = "ladder exhausted"
    for rate in rates:
        if not [f for f in active if f != "direct"]:
            stop_reason = "every front failed twice"
            break
        n = max(min_requests, int(rate * seconds))
        expected = len(active) * reps * (n / rate + clock.per_run_overhead())
        if clock.elapsed() + expected > deadline_s:
            stop_reason = f"time budget (next rate {rate:g} needs ~{expected:.0f} s)"
            break
        key = f"{rate:g}"
        runs[key] = {f: [] for f in active}
        for rep in range(reps):
            for front in rotated(active, rep):
                t = time.monotonic()
                res = run_client(
                    fleet,
                    fronts[front],
                    stream=stream,
                    rate=rate,
                    requests=n,
                    max_seconds=3 * n / rate + 5,
                )
                clock.run_s.append(time.monotonic() - t - n / rate)
                res["rep"] = rep + 1
                runs[key][front].append(res)
                print(
                    f"{mode} {rate:>6g}/s rep {rep + 1} {front:>12}: achieved "
                    f"{res['achieved_ratio']:.3f} p50 {res['p50_ms']:.2f} p99 "
                    f"{res['p99_ms']:.2f} ms late {res['late_sends']} err {res['errors']} "
                    f"cpu {res.get('front_cpu_util', 0):.2f} core "
                    f"{res.get('front_cpu_us_per_req', 0):.0f} us/req",
                    file=sys.stderr,
                )
        points[key] = {}
        direct_runs = runs[key].get("direct", [])
        for front in active:
            point = summarize_point(runs[key][front], direct_runs)
            point["sustained"] = passes(point, front)
            points[key][front] = point
        if "direct" in points[key] and not points[key]["direct"]["sustained"]:
            stop_reason = f"direct did not keep up at {rate:g} req/s (harness limit)"
            break
        for front in list(active):
            if not points[key][front]["sustained"]:
                failures[front] += 1
                if failures[front] >= 2 and front != "direct":
                    active.remove(front)
    ceilings = {}
    for front in order:
        ok = [float(r) for r, pts in points.items() if pts.get(front, {}).get("sustained")]
        tried = [float(r) for r, pts in points.items() if front in pts]
        ceilings[front] = {
            "max_sustained_rps": max(ok) if ok else 0.0,
            "highest_tried_rps": max(tried) if tried else 0.0,
            "lowest_tried_rps": min(tried) if tried else 0.0,
            "limit_reached": any(
                not pts[front]["sustained"] for pts in points.values() if front in pts
            ),
        }
    return {"points": points, "runs": runs, "ceilings": ceilings, "stop_reason": stop_reason}


def closed_loop(
    fleet: Fleet,
    fronts: dict[str, Front],
    *,
    stream: bool,
    reps: int,
    seconds: float,
) -> dict[str, Any]:
    """64 in flight for ``seconds`` per run (after a short warm-up in the same process)."""
    order = [f for f in FRONTS if f in fronts]
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in order}
    for rep in range(reps):
        for front in rotated(order, rep):
            res = run_client(
                fleet,
                fronts[front],
                stream=stream,
                rate=0,
                requests=1_000_000,
                max_seconds=seconds,
                warmup=500,
            )
            runs[front].append(res)
            print(
                f"{'streaming' if stream else 'non-streaming'} closed 64 rep {rep + 1} "
                f"{front:>12}: {res['rps']:,.0f} req/s p99 {res['p99_ms']:.1f} ms err "
                f"{res['errors']} cpu {res.get('front_cpu_util', 0):.2f} core "
                f"{res.get('front_cpu_us_per_req', 0):.0f} us/req",
                file=sys.stderr,
            )
    summary = {
        f: {
            "rps": med([r["rps"] for r in rs]),
            "p50_ms": med([r["p50_ms"] for r in rs]),
            "p99_ms": med([r["p99_ms"] for r in rs]),
            "errors": sum(int(r["errors"]) for r in rs),
            "front_cpu_util": med([r.get("front_cpu_util", float("nan")) for r in rs]),
            "front_cpu_us_per_req": med([r.get("front_cpu_us_per_req", float("nan")) for r in rs]),
            **{
                key: med([r.get(key, float("nan")) for r in rs])
                for key in ("front_user_us_per_req", "front_sys_us_per_req")
            },
        }
        for f, rs in runs.items()
    }
    if "vllm-router" in summary:
        for f, s in summary.items():
            ratios = [
                a["rps"] / b["rps"] for a, b in zip(runs[f], runs["vllm-router"], strict=False)
            ]
            s["rps_vs_vllm_router"] = med(ratios)
    return {"runs": runs, "summary": summary}


# ---------------------------------------------------------------------------------------------
# Profile.

LAYERS = (
    "uvicorn/httptools server",
    "Starlette/ASGI",
    "gateway code",
    "prometheus-client (gateway metrics)",
    "aiohttp client",
    "event loop/syscalls",
    "other",
)


_PACKAGE_LAYER = {
    "uvicorn": LAYERS[0],
    "httptools": LAYERS[0],
    "starlette": LAYERS[1],
    "gateway": LAYERS[2],
    "orjson": LAYERS[2],
    "xxhash": LAYERS[2],
    "prometheus_client": LAYERS[3],
    "aiohttp": LAYERS[4],
    "yarl": LAYERS[4],
    "multidict": LAYERS[4],
    "propcache": LAYERS[4],
    "aiosignal": LAYERS[4],
    "frozenlist": LAYERS[4],
    "asyncio": LAYERS[5],
    "uvloop": LAYERS[5],
    "selectors.py": LAYERS[5],
    "socket.py": LAYERS[5],
}
_FRAME_FILE = re.compile(r"\(([^()]*?)(?::\d+)?\)$")


def layer_of(frame: str) -> str:
    """Layer of a py-spy frame ``function (package/module.py:line)`` by its top package.

    Python-level stacks only: C work runs under the Python frame that called it (socket
    writes under uvicorn's ``send``, httptools parsing under ``data_received``), and
    uvloop's own loop (epoll, reads, callback dispatch) shows as ``Runner.run (asyncio)``.
    """
    match = _FRAME_FILE.search(frame)
    path = match.group(1).replace("\\", "/") if match else ""
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):  # innermost known package wins (site-packages)
        if parts[i] in _PACKAGE_LAYER and (i < len(parts) - 1 or parts[i].endswith(".py")):
            return _PACKAGE_LAYER[parts[i]]
    return LAYERS[6]


def summarize_raw(raw: str, top: int = 5) -> dict[str, Any]:
    """Own-time samples per layer and the top frames of each, from py-spy's ``--format raw``
    (one ``root;...;leaf COUNT`` line per distinct stack). A leaf in an unlisted module
    (contextlib, enum, a dataclass ``__init__``) is charged to its innermost listed caller:
    ``map_errors``' context-manager plumbing is gateway time, not "other"."""
    by_layer: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        chain = stack.split(";")
        leaf = chain[-1]
        layer = next((lay for fr in reversed(chain) if (lay := layer_of(fr)) != LAYERS[6]), "")
        by_layer[layer or LAYERS[6]] += n
        frames[layer or LAYERS[6]][re.sub(r":\d+\)$", ")", leaf)] += n
        total += n
    return {
        "samples": total,
        "layers": {
            layer: {
                "samples": by_layer[layer],
                "share": round(by_layer[layer] / total, 4) if total else 0.0,
                "top": [
                    {"frame": fr, "share": round(c / total, 4)}
                    for fr, c in frames[layer].most_common(top)
                ],
            }
            for layer in LAYERS
            if by_layer[layer]
        },
    }


def profile_gateway(
    fleet: Fleet,
    gateway: Front,
    rate: float,
    *,
    seconds: float,
    out_svg: Path,
) -> dict[str, Any]:
    """py-spy the gateway under paced load at ``rate``: a flame graph, then raw stacks."""
    spy = BIN / "py-spy"
    if not spy.exists() and shutil.which("py-spy"):
        spy = Path(shutil.which("py-spy") or "")
    if not spy.exists():
        return {"error": "py-spy not installed (uv pip install py-spy)"}
    total_s = 2 * seconds + 8
    n = int(rate * total_s)
    pid, on_client = gateway.pid, pin(fleet.cpus("client"))
    client = load.spawn_client(
        gateway.url,
        fleet.cpus("client"),
        concurrency=CONNECTIONS,
        rate=rate,
        requests=n,
        max_seconds=total_s + 10,
        cpu_pid=pid,
        announce=True,
    )
    raw_path = out_svg.with_suffix(".raw.txt")  # the stacks behind ceiling.md's summary
    info: dict[str, Any] = {"rate": rate, "seconds": seconds, "sample_rate_hz": 200}
    try:
        # Wait (bounded) for the client's "started" line: its load is about to run.
        assert client.stderr is not None
        deadline = time.monotonic() + 15.0
        started = False
        while not started and (left := deadline - time.monotonic()) > 0:
            if not select.select([client.stderr], [], [], left)[0]:
                break
            line = client.stderr.readline()
            if not line:  # EOF: the client died
                break
            started = line.strip() == b"started"
        if not started:
            info["error"] = "the load client did not start within 15 s"
            return info
        cpu0, t0 = cpu.tree_oncpu_ns(pid), time.monotonic()
        common = ["record", "--pid", str(pid), "--rate", "200", "--duration", f"{seconds:g}"]
        for fmt, path in (("flamegraph", out_svg), ("raw", raw_path)):
            spy_out = subprocess.run(
                [str(spy), *common, "--format", fmt, "-o", str(path)],
                capture_output=True,
                timeout=seconds + 30,
                preexec_fn=on_client,
                check=False,
            )
            if spy_out.returncode != 0:
                info["error"] = spy_out.stderr.decode()[-1000:]
                return info
        info["gateway_cpu_util_during_profile"] = round(
            (cpu.tree_oncpu_ns(pid) - cpu0) / 1e9 / (time.monotonic() - t0), 3
        )
    finally:
        if "error" in info:
            client.kill()  # this PID only
        with contextlib.suppress(RuntimeError):
            info["load"] = load.collect(client, total_s + 30)
    info.update(summarize_raw(raw_path.read_text()))
    info["raw_stacks"] = raw_path.name
    return info


# ---------------------------------------------------------------------------------------------
# Report.


def _fmt_rate(value: float, limit_reached: bool, lowest_tried: float) -> str:
    if value <= 0:
        return f"< {lowest_tried:,.0f}" if lowest_tried else "n/a"
    return f"{value:,.0f}" if limit_reached else f">= {value:,.0f} (no failure up to it)"


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    machine = report["machine"]
    lines = [
        "# Throughput ceiling",
        "",
        f"Max sustained rate = highest offered rate (open loop, {CONNECTIONS} connections, "
        f"latency from the scheduled send) at which a front achieved >= {MIN_ACHIEVED:.0%} of "
        f"it with <= {MAX_LATE:.0%} late sends, no errors, and p99 added latency (front p99 - "
        f"direct p99, same repetition) <= {ADDED_P99_LIMIT_MS:g} ms; medians over "
        f"{cfg['reps']} interleaved repetitions of {cfg['seconds']:g} s (>= "
        f"{cfg['min_requests']} requests). Same two instant upstreams for every front; "
        f"streaming = {STREAM_TOKENS} SSE token events + `[DONE]` (upstream writes: "
        f"{cfg['stream_writes']}), complete at `[DONE]`. "
        f"nproc={machine['nproc']}, placement: {cfg['placement_detail']}. Load average at "
        f"start {fmt_load(machine['loadavg_at_start'])}, at end "
        f"{fmt_load(cfg['loadavg_at_end'])}; {cfg['elapsed_s']:.0f} s in all.",
        "",
    ]
    if cfg.get("note"):
        lines += [f"**{cfg['note']}**", ""]
    lines += [
        "| mode | front | max sustained req/s | closed-loop req/s @64 | vs vllm-router "
        "(sustained / closed) | front CPU µs/req at its ceiling | core busy at its ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        res = report["modes"].get(mode)
        if not res:
            continue
        lad, closed = res["ladder"], res["closed_loop"]["summary"]
        rt = lad["ceilings"].get("vllm-router", {}).get("max_sustained_rps", 0.0)
        for front, c in lad["ceilings"].items():
            top = f"{c['max_sustained_rps']:g}"
            at = lad["points"].get(top, {}).get(front, {})
            cl = closed.get(front, {})
            ratio_s = f"{c['max_sustained_rps'] / rt:.2f}x" if rt else ""
            ratio_c = f"{cl['rps_vs_vllm_router']:.2f}x" if "rps_vs_vllm_router" in cl else ""
            lines.append(
                f"| {mode} | {front} | "
                f"{_fmt_rate(c['max_sustained_rps'], c['limit_reached'], c['lowest_tried_rps'])} "
                f"| {cl.get('rps', float('nan')):,.0f} | {ratio_s} / {ratio_c} "
                f"| {at.get('front_cpu_us_per_req', float('nan')):.0f} "
                f"| {at.get('front_cpu_util', float('nan')):.0%} |"
            )
    lines += ["", *render_targets(report), ""]
    for mode in MODES:
        res = report["modes"].get(mode)
        if not res:
            continue
        lad = res["ladder"]
        lines += [
            f"## {mode}: ladder (stopped: {lad['stop_reason']})",
            "",
            "| offered req/s | front | achieved | p50 | p99 | added p99 | late sends "
            "| errors | max in flight | front CPU (core) | µs/req | sustained |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for rate, pts in lad["points"].items():
            for front, p in pts.items():
                added = "" if front == "direct" else f"{p['added_p99_ms']:+.2f} ms"
                lines.append(
                    f"| {float(rate):,.0f} | {front} | {p['achieved_ratio']:.3f} "
                    f"| {p['p50_ms']:.2f} ms | {p['p99_ms']:.2f} ms | {added} "
                    f"| {p['late_sends']}/{p['requests']} | {p['errors']} | {p['max_in_flight']} "
                    f"| {p['front_cpu_util']:.2f} | {p['front_cpu_us_per_req']:.0f} "
                    f"| {'yes' if p['sustained'] else '**no**'} |"
                )
        lines += ["", *render_harness(lad), ""]
    lines += render_profile(report)
    lines += [
        "## Reproduce",
        "",
        "```",
        "make bench-ceiling   # = bench/ceiling.py --router-policy cache_aware, <= 15 min",
        ".venv/bin/python bench/ceiling.py --quick    # smoke, ~1-2 min, writes nothing",
        "```",
        "",
        f"Gateway: git {machine['git_head']}"
        + (" + uncommitted gateway/ changes" if machine["gateway_tree_dirty"] else "")
        + f", flags `--log-level WARNING`, router: {cfg.get('gateway_router', 'prefix')}; "
        f"vllm-router {machine['packages'].get('vllm-router')} "
        f"`--policy {cfg.get('router_policy', 'round_robin')}`. Raw data: `ceiling.json`; "
        "plot: `ceiling.png`; flame graph: `ceiling-profile.svg` (beside this file).",
    ]
    return "\n".join(lines) + "\n"


def render_harness(lad: dict[str, Any]) -> list[str]:
    """How much the client + upstream side (CPU 0) can drive: read off direct's top rate."""
    direct = [(float(r), pts["direct"]) for r, pts in lad["points"].items() if "direct" in pts]
    if not direct:
        return []
    rate, p = max(direct, key=lambda rp: rp[0])
    per_req = p["client_cpu_us_per_req"] + p["front_cpu_us_per_req"]  # client + upstream
    return [
        f"Harness headroom: at {rate:,.0f} req/s the load client used "
        f"{p['client_cpu_us_per_req']:.0f} µs and the upstream {p['front_cpu_us_per_req']:.0f} "
        f"µs of CPU per request, both on the client core: it can drive ≈ "
        f"{1e6 / per_req:,.0f} req/s at most (every front costs the client side the same)."
    ]


def render_targets(report: dict[str, Any]) -> list[str]:
    non = report["modes"].get(MODES[0])
    if not non:
        return []

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**NOT met**"

    lines = ["**Targets (issue), gateway:**", "", "| target | measured | result |", "|---|---|---|"]
    gw = non["ladder"]["ceilings"].get("gateway", {})
    g = gw.get("max_sustained_rps", 0.0)
    lines.append(
        f"| >= {TARGET_RPS:,.0f} non-streaming req/s sustained with p99 added <= "
        f"{ADDED_P99_LIMIT_MS:g} ms | {g:,.0f} req/s | {verdict(g >= TARGET_RPS)} |"
    )
    for mode in MODES:
        res = report["modes"].get(mode)
        if not res or "vllm-router" not in res["ladder"]["ceilings"]:
            continue
        c = res["ladder"]["ceilings"]
        gv, rv = c["gateway"]["max_sustained_rps"], c["vllm-router"]["max_sustained_rps"]
        lines.append(
            f"| >= vllm-router's sustained rate, {mode}, same run | gateway {gv:,.0f} vs "
            f"vllm-router {rv:,.0f} req/s | {verdict(gv >= rv > 0 or (gv > 0 and rv == 0))} |"
        )
    return lines


def render_profile(report: dict[str, Any]) -> list[str]:
    prof = report.get("profile")
    if not prof:
        return []
    lines = [f"## Where the gateway's time goes (py-spy at {prof.get('rate', 0):,.0f} req/s)", ""]
    if "error" in prof:
        return [*lines, f"Profile failed: {prof['error']}", ""]
    load = prof.get("load", {})
    us = load.get("front_cpu_us_per_req", float("nan"))
    lines += [
        f"Non-streaming, paced at the gateway's ceiling; {prof['samples']:,} own-time samples "
        f"at {prof['sample_rate_hz']} Hz over {prof['seconds']:g} s (idle excluded), gateway "
        f"core busy {prof.get('gateway_cpu_util_during_profile', float('nan')):.0%} while "
        f"sampled, {us:.0f} µs CPU/request over the whole load run (py-spy attached). "
        "µs/req per layer = share x that figure. Flame graph: `ceiling-profile.svg`.",
        "",
        "| layer | share of samples | ≈ µs/req | top frames (own time, share of all samples) |",
        "|---|---|---|---|",
    ]
    for layer, d in sorted(prof["layers"].items(), key=lambda kv: -kv[1]["share"]):
        top = "; ".join(f"`{t['frame']}` {t['share']:.1%}" for t in d["top"][:3])
        lines.append(f"| {layer} | {d['share']:.1%} | {d['share'] * us:.0f} | {top} |")
    lines.append("")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    colors = {
        "direct": "tab:gray",
        "floor": "tab:olive",
        "gateway": "tab:blue",
        "vllm-router": "tab:orange",
    }
    modes = [m for m in MODES if m in report["modes"]]
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.2 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        lad = report["modes"][mode]["ladder"]
        ax_rate, ax_p99 = axes[row]
        top = 0.0
        for front in FRONTS:
            xs = [float(r) for r, pts in lad["points"].items() if front in pts]
            if not xs:
                continue
            pts = [lad["points"][f"{x:g}"][front] for x in xs]
            ach = [p["achieved_rps"] for p in pts]
            p99 = [p["p99_ms"] for p in pts]
            top = max(top, *xs)
            ax_rate.plot(xs, ach, "-", color=colors[front], label=front)
            ax_p99.plot(xs, p99, "-", color=colors[front], label=front)
            for x, a, q, p in zip(xs, ach, p99, pts, strict=True):
                face = colors[front] if p["sustained"] else "white"
                ax_rate.plot(x, a, "o", color=colors[front], mfc=face)
                ax_p99.plot(x, q, "o", color=colors[front], mfc=face)
            ceiling = lad["ceilings"][front]["max_sustained_rps"]
            if ceiling and front != "direct":
                ax_rate.axvline(ceiling, color=colors[front], ls=":", lw=1)
        dxs = [float(r) for r, pts in lad["points"].items() if "direct" in pts]
        if dxs:
            lim = [lad["points"][f"{x:g}"]["direct"]["p99_ms"] + ADDED_P99_LIMIT_MS for x in dxs]
            ax_p99.plot(dxs, lim, "--", color="tab:red", lw=1, label="direct p99 + 10 ms")
        ax_rate.plot([0, top], [0, top], ":", color="black", lw=0.8, label="achieved = offered")
        ax_rate.set(
            title=f"{mode}: achieved vs offered (hollow = not sustained)",
            xlabel="offered req/s",
            ylabel="achieved req/s",
        )
        ax_p99.set(
            title=f"{mode}: p99 latency vs offered",
            xlabel="offered req/s",
            ylabel="p99 ms (from scheduled send)",
            yscale="log",
        )
        for ax in (ax_rate, ax_p99):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Throughput ceiling, instant upstreams, 64 connections (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_floor"]:
        return floor_main(argv[1:])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke: short points, no writes")
    parser.add_argument(
        "--rates",
        default=",".join(str(r) for r in DEFAULT_RATES),
        help="offered req/s ladder, non-streaming, comma-separated",
    )
    parser.add_argument(
        "--stream-rates",
        default=",".join(str(r) for r in DEFAULT_STREAM_RATES),
        help="offered req/s ladder, streaming, comma-separated",
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions per point")
    parser.add_argument("--seconds", type=float, default=2.5, help="per paced point")
    parser.add_argument("--min-requests", type=int, default=1000, help="per paced point")
    parser.add_argument("--closed-seconds", type=float, default=2.0, help="per closed run")
    parser.add_argument("--profile-seconds", type=float, default=15.0, help="0 = no profile")
    parser.add_argument("--modes", default=",".join(MODES), help="non-streaming,streaming")
    parser.add_argument("--placement", choices=("split", "none"), default="split")
    parser.add_argument("--budget-s", type=float, default=900.0, help="whole run, seconds")
    parser.add_argument("--no-router", action="store_true", help="skip vllm-router")
    parser.add_argument(
        "--gateway-router", help="the gateway's --router (default: its default, prefix)"
    )
    parser.add_argument(
        "--router-policy", default="round_robin", help="vllm-router --policy (like for like: "
        "--gateway-router round_robin)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "ceiling")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.reps, args.seconds, args.min_requests = "500,1000,2000", 1, 1.0, 500
        args.stream_rates = "250,500,1000"
        args.closed_seconds, args.profile_seconds, args.budget_s = 1.0, 3.0, 150.0
        args.no_write = True
    ladders = {
        MODES[0]: [float(r) for r in args.rates.split(",") if r.strip()],
        MODES[1]: [float(r) for r in args.stream_rates.split(",") if r.strip()],
    }
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")

    clock = Clock(args.budget_s)
    info = machine_info(PACKAGES, placement=args.placement)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ceiling-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    profile_reserve = 2 * args.profile_seconds + 25 if args.profile_seconds else 0.0
    out_svg = (args.out_dir if not args.no_write else log_dir) / "ceiling-profile.svg"
    out_svg.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    profile: dict[str, Any] | None = None
    fleet_kw = {
        "with_router": not args.no_router,
        "gateway_router": args.gateway_router,
        "router_policy": args.router_policy,
    }
    with fleet_up(args.placement, log_dir, **fleet_kw) as (fleet, all_fronts):
        for mode in modes:  # warm-up: connections, pools, allocators
            for front in all_fronts.values():
                run_client(
                    fleet,
                    front,
                    stream=mode == MODES[1],
                    rate=0,
                    requests=2000,
                    max_seconds=10,
                )
        closed = {
            mode: closed_loop(
                fleet,
                all_fronts,
                stream=mode == MODES[1],
                reps=args.reps,
                seconds=args.closed_seconds,
            )
            for mode in modes
        }
        for i, mode in enumerate(modes):
            # Time left, shared equally by the remaining modes.
            left = args.budget_s - clock.elapsed() - profile_reserve
            deadline = clock.elapsed() + left / (len(modes) - i)
            lad = ladder(
                fleet,
                all_fronts,
                stream=mode == MODES[1],
                rates=ladders[mode],
                reps=args.reps,
                seconds=args.seconds,
                min_requests=args.min_requests,
                clock=clock,
                deadline_s=deadline,
            )
            results[mode] = {"closed_loop": closed[mode], "ladder": lad}
        if args.profile_seconds and MODES[0] in results:
            ceiling = results[MODES[0]]["ladder"]["ceilings"]["gateway"]["max_sustained_rps"]
            profile = profile_gateway(
                fleet,
                all_fronts["gateway"],
                ceiling or ladders[MODES[0]][0],
                seconds=args.profile_seconds,
                out_svg=out_svg,
            )
    load_end = loadavg()
    report: dict[str, Any] = {
        "machine": info,
        "config": {
            "rates": {m: ladders[m] for m in modes},
            "mean_run_overhead_s": round(clock.per_run_overhead(), 2),
            "reps": args.reps,
            "seconds": args.seconds,
            "min_requests": args.min_requests,
            "closed_seconds": args.closed_seconds,
            "connections": CONNECTIONS,
            "stream_tokens": STREAM_TOKENS,
            "stream_writes": "event",
            "gateway_router": args.gateway_router or "prefix (default)",
            "router_policy": args.router_policy,
            "rule": {
                "min_achieved_ratio": MIN_ACHIEVED,
                "max_late_fraction": MAX_LATE,
                "max_added_p99_ms": ADDED_P99_LIMIT_MS,
                "stop_after_failures": 2,
            },
            "placement": args.placement,
            "placement_detail": (
                f"front alone on CPU {FRONT_CPU}; client, both upstreams and py-spy "
                f"on CPU {CLIENT_CPU}"
                if args.placement == "split"
                else "unpinned"
            ),
            "quick": args.quick,
            "elapsed_s": round(clock.elapsed(), 1),
            "loadavg_at_end": load_end,
            "note": "Development run on a shared, noisy machine: not the committed figures."
            if args.quick
            else "",
        },
        "modes": results,
        "profile": profile,
    }
    text = render(report)
    print(text)
    if not args.no_write:
        write(args.out_dir, "ceiling", report, text, plot)
    else:
        plot(report, log_dir / "ceiling.png")
        print(f"(--no-write: plot and profile in {log_dir})", file=sys.stderr)
    # A front failing under overload is a result; errors on direct or the gateway are not.
    errors = sum(
        p["errors"]
        for res in results.values()
        for pts in res["ladder"]["points"].values()
        for front, p in pts.items()
        if front in ("direct", "gateway")
    )
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
