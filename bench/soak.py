"""Load and soak: a sustained TRL-shaped mix through the gateway, then replica kills.

Starts ``--replicas`` (3) ``rollout-testbed sim-replica`` processes with a realistic latency
model and one ``rollout-gateway serve`` in front of them (health probe every second), loads
one LoRA adapter through the gateway, then drives a closed loop of ``--concurrency`` (200)
keep-alive connections for ``--minutes`` (steady phase, the first ``--warmup-minutes`` of it
warm-up) followed by ``--kill-minutes`` in which one replica is SIGKILLed every
``--kill-every`` seconds (mid-slot, rotating) and restarted on the same port
``--restart-after`` seconds later while the load continues.

The mix: TRL-shaped completion bodies (token-id prompts of 200 tokens, ``max_tokens``
16..64, ``n=1``, ``return_token_ids``, ``logprobs=0``), groups of 8 sharing a fresh prompt
(so the gateway's routing state sees new keys the whole time; ``--prompt-pool N`` cycles N
prompts instead), ``--stream-fraction`` (30 %) of requests with ``"stream": true`` read to
``data: [DONE]``, ``--lora-fraction`` (20 %) of groups on the adapter.

Added latency (the gateway's own contribution) comes from paired samples. The sims are
deterministic apart from load, so a request's service time is fixed by its shape and the
replica's state at that moment. For ``--twin-fraction`` (5 %) of gateway requests, an identical
twin goes *directly* to every live replica at the same instant; the twin on the replica that
the gateway picked (``X-Gateway-Replica``) is the pair. Added p50/p99 = p50/p99 of the paired
gateway latencies minus p50/p99 of their twins' (same shapes, same replica, same moments, so
only the gateway's part differs). The twins add ~15 % load straight to the replicas.

Latency model: ``decode=2e-2`` (20 ms per token, a loaded replica's inter-token time) rather
than a few ms: at 200 requests in flight, 2 ms per token would offer ~2,500 req/s, several
times what 2 cores shared by the gateway, 3 sims and the client can serve, and the closed loop
would then measure nothing but CPU queueing.

Every ``--window`` (10) seconds: gateway RSS (``VmRSS``) and open FDs, its CPU share, window
p50/p99 latency, errors by kind, req/s. In the kill phase ``/gateway/status`` is polled every
0.2 s to time ejection, re-admission and adapter replay (reconciliation) of the restarted
replica.

    .venv/bin/python bench/soak.py        # full run: 30 min steady + 15 min kills (~46 min)
    .venv/bin/python bench/soak.py --minutes 2 --kill-minutes 1 --kill-every 30 \\
        --concurrency 50 --out /tmp/soak-short     # a short smoke run

Writes ``OUT.json`` (every window, every kill event, verdicts), ``OUT.md`` (tables and a
verdict per target) and ``OUT.png``; ``--out`` defaults to ``bench/results/soak`` (the result
the docs cite, ``make bench-soak``). Only processes started here are stopped, by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from rollout_testbed.procs import Proc, sim_fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.lib

from bench.lib import cpu, load
from bench.lib.report import machine_info, pyplot

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable

ADAPTER = "soak-v1"
BASE_MODEL = "tiny-base"
PROMPT_TOKENS = 200
GROUP = 8
MIN_TOKENS, MAX_TOKENS = 16, 64
# 16..64 tokens at 20 ms each (+ a little per concurrent request): 0.3-1.4 s per completion,
# so 200 in flight offer ~250 req/s, which 2 shared cores sustain (see the module docstring).
DEFAULT_LATENCY = "prefill=2e-5,decode=2e-2,concurrency=2e-5"
RSS_LIMIT = 0.05  # the target: RSS growth after warm-up < 5 %


# --------------------------------------------------------------------------- processes


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fd_breakdown(pid: int, own_port: int, upstream_ports: list[int]) -> dict[str, Any]:
    """What ``pid``'s open FDs are: established client and upstream (per replica port) TCP
    connections, CLOSE_WAIT sockets (the peer closed, we never did: a leak if they stay),
    and everything else. Matches ``/proc/PID/fd`` socket inodes against ``/proc/net/tcp*``."""
    inodes: set[str] = set()
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        total += 1
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    client = close_wait = 0
    upstream = dict.fromkeys(upstream_ports, 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) < 10 or cols[9] not in inodes:
                    continue
                state = cols[3]
                if state == "08":  # CLOSE_WAIT
                    close_wait += 1
                elif state == "01":  # ESTABLISHED
                    local = int(cols[1].rsplit(":", 1)[1], 16)
                    remote = int(cols[2].rsplit(":", 1)[1], 16)
                    if local == own_port:
                        client += 1
                    elif remote in upstream:
                        upstream[remote] += 1
    up = list(upstream.values())
    return {
        "fds": total,
        "client_conns": client,
        "upstream_conns": up,
        "close_wait": close_wait,
        "fds_not_connections": total - client - sum(up),
    }


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Req:
    payload: bytes  # complete HTTP/1.1 request (valid for the gateway and a replica alike)
    stream: bool
    lora: bool
    max_tokens: int
    group: int


class Workload:
    """Endless TRL-shaped requests: groups of 8 share a prompt and a model.

    ``prompt_pool`` 0: every group has a fresh prompt (the gateway's routing index sees new
    keys for the whole run); N > 0: prompts cycle through a fixed data set of N, as epochs
    over a GRPO data set do."""

    def __init__(
        self,
        host: str,
        port: int,
        stream_fraction: float,
        lora_fraction: float,
        seed: int,
        prompt_pool: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.prompt_pool = prompt_pool
        self.stream_fraction = stream_fraction
        self.lora_fraction = lora_fraction
        self.head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nUser-Agent: soak\r\nContent-Length: "
        ).encode()
        self._group: list[Req] = []
        self.groups = 0

    def prompt(self) -> list[int]:
        if self.prompt_pool <= 0:
            return [self.rng.randrange(100, 32000) for _ in range(PROMPT_TOKENS)]
        item = random.Random(f"prompt-{self.groups % self.prompt_pool}")
        return [item.randrange(100, 32000) for _ in range(PROMPT_TOKENS)]

    def group(self) -> list[Req]:
        rng = self.rng
        self.groups += 1
        prompt = self.prompt()
        lora = rng.random() < self.lora_fraction
        out = []
        for _ in range(GROUP):
            stream = rng.random() < self.stream_fraction
            max_tokens = rng.randint(MIN_TOKENS, MAX_TOKENS)
            raw = load.trl_body(
                prompt,
                model=ADAPTER if lora else BASE_MODEL,
                max_tokens=max_tokens,
                seed=rng.randrange(1 << 30),
                stream=stream,
            )
            out.append(
                Req(
                    self.head + str(len(raw)).encode() + b"\r\n\r\n" + raw,
                    stream,
                    lora,
                    max_tokens,
                    self.groups,
                )
            )
        return out

    def next(self) -> Req:
        if not self._group:
            self._group = self.group()[::-1]
        return self._group.pop()


# --------------------------------------------------------------------------- raw HTTP client


def classify(req: Req, status: int, body: bytes) -> str:
    """``ok`` or the failure kind of one answered request."""
    if status != 200:
        return f"status_{status}"
    if req.stream:
        if b'data: {"error"' in body:
            return "sse_error"
        if b"data: [DONE]" not in body:
            return "sse_truncated"
        return "ok"
    return "ok" if body.startswith(b"{") and b'"choices"' in body else "bad_body"


def replica_header(head: bytes) -> int | None:
    marker = head.find(b"x-gateway-replica:")
    if marker < 0:
        return None
    line_end = head.find(b"\r\n", marker)
    with contextlib.suppress(ValueError):
        return int(head[marker + 18 : line_end if line_end > 0 else None])
    return None


# --------------------------------------------------------------------------- recording


@dataclass
class Window:
    """What completed during one sampling window."""

    gw_latency: array[float] = field(default_factory=lambda: array("d"))
    # Paired samples: a gateway request and its twin sent directly to the same replica.
    pair_gw: array[float] = field(default_factory=lambda: array("d"))
    pair_direct: array[float] = field(default_factory=lambda: array("d"))
    outcomes: Counter[str] = field(default_factory=Counter)  # "<stream|plain>.<kind>"
    stream_n: int = 0
    lora_n: int = 0
    direct_errors: int = 0


@dataclass
class Failure:
    t: float
    stream: bool
    lora: bool
    kind: str
    replica: int | None


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, math.ceil(q / 100.0 * len(values)) - 1))
    return values[index]


def ms(x: float) -> float | None:
    return None if x != x else round(x * 1000.0, 3)


@dataclass
class KillEvent:
    replica: int
    kill_at: float  # seconds since load start
    restart_at: float | None = None
    ejected_at: float | None = None  # gateway status first shows healthy=false
    sim_ready_at: float | None = None  # the restarted replica answers /health itself
    healthy_at: float | None = None  # gateway shows healthy=true again
    reconciled_at: float | None = None  # ...and the replica's adapter state is "up" with ADAPTER
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def since(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(a - b, 3)

        return {
            "replica": self.replica,
            "kill_at_s": round(self.kill_at, 3),
            "restart_at_s": None if self.restart_at is None else round(self.restart_at, 3),
            "eject_after_kill_s": since(self.ejected_at, self.kill_at),
            "replica_ready_after_restart_s": since(self.sim_ready_at, self.restart_at),
            "healthy_after_restart_s": since(self.healthy_at, self.restart_at),
            "reconcile_after_restart_s": since(self.reconciled_at, self.restart_at),
            "reconcile_after_replica_ready_s": since(self.reconciled_at, self.sim_ready_at),
            "notes": self.notes,
        }


# --------------------------------------------------------------------------- the run


class Soak:
    def __init__(
        self,
        args: argparse.Namespace,
        sims: list[Proc],
        sim_ports: list[int],
        gateway: Proc,
        gw_port: int,
        admin_key: str,
    ) -> None:
        self.args = args
        self.sims = sims
        self.sim_ports = sim_ports
        self.gateway = gateway
        self.gw_port = gw_port
        self.admin_key = admin_key
        self.window = Window()
        self.windows: list[dict[str, Any]] = []
        self.raw: list[tuple[str, Window]] = []  # (phase, window) for phase totals
        self.failures: list[Failure] = []
        self.kills: list[KillEvent] = []
        self.excluded: set[int] = set()  # killed, not yet reconciled: no twins there
        self.twin_pool: dict[int, list[load.Conn]] = {i: [] for i in range(len(sims))}
        self.twins_in_flight = 0
        self.twin_rng = random.Random(args.seed + 1)
        self.stop = False
        self.t0 = 0.0
        self.steady_s = args.minutes * 60.0
        self.warmup_s = args.warmup_minutes * 60.0
        self.kill_s = args.kill_minutes * 60.0
        self.workload = Workload(
            "127.0.0.1",
            gw_port,
            args.stream_fraction,
            args.lora_fraction,
            args.seed,
            args.prompt_pool,
        )
        self.in_flight = 0
        self.final_status: Any = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def phase(self, t: float) -> str:
        if t < self.warmup_s:
            return "warmup"
        return "steady" if t < self.steady_s else "kill"

    # ----- load

    def record(self, req: Req, latency: float, kind: str, replica: int | None) -> None:
        w = self.window
        w.outcomes[("stream." if req.stream else "plain.") + kind] += 1
        w.stream_n += req.stream
        w.lora_n += req.lora
        if kind == "ok":
            w.gw_latency.append(latency)
        elif len(self.failures) < 100_000:
            self.failures.append(Failure(self.now(), req.stream, req.lora, kind, replica))

    async def worker(self, index: int, end: float) -> None:
        conn: load.Conn | None = None
        timeout = self.args.request_timeout
        # Stagger the first sends over ~1 s so 200 connects do not arrive as one burst.
        await asyncio.sleep(index / max(1, self.args.concurrency))
        # The sampler sets ``stop`` after its last sample, so that sample sees the full load;
        # ``end`` only bounds the loop should it never do so.
        while not self.stop and time.perf_counter() < end:
            req = self.workload.next()
            twins = self.maybe_twins(req)
            t = time.perf_counter()
            replica = None
            try:
                if conn is None or conn.closed:
                    conn = await load.connect("127.0.0.1", self.gw_port)
                self.in_flight += 1
                try:
                    status, head, body = await conn.request(req.payload, timeout)
                finally:
                    self.in_flight -= 1
                kind = classify(req, status, body)
                replica = replica_header(head)
            except TimeoutError:
                kind = "timeout"
                conn = None
            except (ConnectionError, OSError):
                kind = "transport"
                conn = None
            latency = time.perf_counter() - t
            self.record(req, latency, kind, replica)
            if twins:
                # Pair with the twin on the replica that served the gateway's copy.
                directs = await asyncio.gather(*(task for _, task in twins))
                for (r, _), direct in zip(twins, directs, strict=True):
                    if direct is not None and kind == "ok" and r == replica:
                        self.window.pair_gw.append(latency)
                        self.window.pair_direct.append(direct)
            if kind == "transport":
                await asyncio.sleep(0.05)  # do not spin on a refused connect
        if conn is not None:
            conn.close()

    def maybe_twins(self, req: Req) -> list[tuple[int, asyncio.Task[float | None]]]:
        """With probability ``--twin-fraction``, send ``req``'s identical twin straight to
        every live replica at the same moment (the tasks write once the worker yields). Which
        replica the gateway picks is known only from the response, so one twin of the set is
        the pair and the others are discarded."""
        live = [r for r in range(len(self.sims)) if r not in self.excluded]
        if (
            not live
            or self.twins_in_flight + len(live) > self.args.max_twins
            or self.twin_rng.random() >= self.args.twin_fraction
        ):
            return []
        self.twins_in_flight += len(live)
        return [(r, asyncio.create_task(self.twin(r, req))) for r in live]

    async def twin(self, replica: int, req: Req) -> float | None:
        """Latency of ``req`` sent directly to ``replica`` (None if it failed)."""
        pool = self.twin_pool[replica]
        try:
            while pool and pool[-1].closed:  # the replica closed idle keep-alive connections
                pool.pop()
            reused = bool(pool)
            conn = pool.pop() if pool else await load.connect("127.0.0.1", self.sim_ports[replica])
            t = time.perf_counter()
            try:
                status, _, body = await conn.request(req.payload, self.args.request_timeout)
            except ConnectionError:
                if not reused:
                    raise
                # Lost the race with the replica's idle timeout: one fresh connection.
                conn = await load.connect("127.0.0.1", self.sim_ports[replica])
                t = time.perf_counter()
                status, _, body = await conn.request(req.payload, self.args.request_timeout)
            latency = time.perf_counter() - t
            if classify(req, status, body) != "ok":
                if replica not in self.excluded:
                    self.window.direct_errors += 1
                return None
            if not conn.closed:
                pool.append(conn)
            return latency
        except (TimeoutError, ConnectionError, OSError):
            if replica not in self.excluded:
                self.window.direct_errors += 1
            return None
        finally:
            self.twins_in_flight -= 1

    def drop_twins(self, replica: int) -> None:
        """A killed replica's pooled twin connections are dead: forget them."""
        self.excluded.add(replica)
        for conn in self.twin_pool[replica]:
            conn.close()
        self.twin_pool[replica].clear()

    # ----- sampling

    async def sampler(self, session: aiohttp.ClientSession, end: float) -> None:
        pid = self.gateway.pid
        me = os.getpid()
        last_cpu, last_me = cpu.cpu_s(pid), time.process_time()
        last_sims = self.sim_cpu()
        last_t = time.perf_counter()
        k = 0
        while True:
            k += 1
            target = self.t0 + k * self.args.window
            await asyncio.sleep(max(0.0, target - time.perf_counter()))
            w, self.window = self.window, Window()
            now = time.perf_counter()
            t = now - self.t0
            gw_cpu, mine = cpu.cpu_s(pid), time.process_time()
            sims = self.sim_cpu()
            rss, fds = rss_kb(pid), fd_breakdown(pid, self.gw_port, self.sim_ports)
            span = now - last_t
            status = await self.get_json(session, "/gateway/status")
            metrics = await self.get_text(session, "/metrics")
            sample = self.summarize_window(w, span)
            sample.update(
                t_s=round(t, 2),
                phase=self.phase(t - self.args.window / 2),
                rss_mb=round(rss / 1024.0, 2),
                **fds,
                gateway_cpu_pct=round(100.0 * (gw_cpu - last_cpu) / span, 1),
                gateway_cpu_s=round(gw_cpu - last_cpu, 3),
                client_cpu_pct=round(100.0 * (mine - last_me) / span, 1),
                sims_cpu_pct=[
                    round(100.0 * (b[1] - a[1]) / span, 1) if a and b and a[0] == b[0] else None
                    for a, b in zip(last_sims, sims, strict=True)
                ],
                client_rss_mb=round(rss_kb(me) / 1024.0, 1),
                loadavg1=round(os.getloadavg()[0], 2),
                client_in_flight=self.in_flight,
            )
            if status is not None:
                reps = status.get("replicas", [])
                sample["healthy_replicas"] = sum(1 for r in reps if r.get("healthy"))
                sample["gateway_in_flight"] = sum(int(r.get("in_flight", 0)) for r in reps)
            if metrics is not None:
                sample["retries_total"] = metric_sum(metrics, "gateway_upstream_retries_total")
                sample["ejections_total"] = metric_sum(metrics, "gateway_replica_ejections_total")
                # The prefix router's index is bounded (LRU) but fills over a long run of
                # new prompts: its size explains part of any RSS growth.
                sample["index_bytes"] = metric_sum(metrics, "gateway_routing_index_bytes")
                for kind in INDEX_KINDS[:3]:
                    sample[f"index_{kind}"] = metric_sum(
                        metrics, "gateway_routing_index_entries", f'kind="{kind}"'
                    )
            self.windows.append(sample)
            self.raw.append((sample["phase"], w))
            last_cpu, last_me, last_sims, last_t = gw_cpu, mine, sims, now
            print(progress_line(sample), file=sys.stderr, flush=True)
            if now >= end:
                return

    def sim_cpu(self) -> list[tuple[int, float] | None]:
        """(pid, CPU seconds) per replica; None while one is dead (restarts change the PID)."""
        out: list[tuple[int, float] | None] = []
        for proc in self.sims:
            try:
                out.append((proc.pid, cpu.cpu_s(proc.pid)) if proc.alive else None)
            except OSError:
                out.append(None)
        return out

    def summarize_window(self, w: Window, span: float) -> dict[str, Any]:
        lat = sorted(w.gw_latency)
        done = sum(w.outcomes.values())
        errors = done - w.outcomes["plain.ok"] - w.outcomes["stream.ok"]
        return {
            "requests": done,
            "rps": round(done / span, 1) if span > 0 else 0.0,
            "errors": errors,
            "outcomes": {k: v for k, v in sorted(w.outcomes.items()) if not k.endswith(".ok")},
            "stream_share": round(w.stream_n / done, 3) if done else None,
            "lora_share": round(w.lora_n / done, 3) if done else None,
            "p50_ms": ms(pct(lat, 50)),
            "p99_ms": ms(pct(lat, 99)),
            "direct_errors": w.direct_errors,
            **added_latency(w),
        }

    async def get_json(self, session: aiohttp.ClientSession, path: str) -> Any:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(f"http://127.0.0.1:{self.gw_port}{path}") as r:
                if r.status == 200:
                    return await r.json()
        return None

    async def get_text(self, session: aiohttp.ClientSession, path: str) -> str | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(f"http://127.0.0.1:{self.gw_port}{path}") as r:
                if r.status == 200:
                    return await r.text()
        return None

    # ----- kills

    async def killer(self, session: aiohttp.ClientSession) -> None:
        every = self.args.kill_every
        count = int(self.kill_s // every)
        for i in range(count):
            kill_at = self.steady_s + (i + 0.5) * every
            await asyncio.sleep(max(0.0, self.t0 + kill_at - time.perf_counter()))
            if self.stop:
                return
            replica = i % len(self.sims)
            event = KillEvent(replica, self.now())
            self.kills.append(event)
            self.drop_twins(replica)
            self.sims[replica].kill()
            print(f"[{event.kill_at:7.1f}s] SIGKILL replica {replica}", file=sys.stderr)
            deadline = self.t0 + kill_at + every * 0.5 + self.args.restart_after
            poll = asyncio.create_task(self.track(session, event, deadline))
            await asyncio.sleep(self.args.restart_after)
            event.restart_at = self.now()
            self.sims[replica].start()
            print(f"[{event.restart_at:7.1f}s] restarted replica {replica}", file=sys.stderr)
            await poll
            self.excluded.discard(replica)

    async def track(
        self, session: aiohttp.ClientSession, event: KillEvent, deadline: float
    ) -> None:
        """Poll the gateway (and the replica itself) every 0.2 s until reconciled. Times are
        taken when an answer arrives, so they err late by at most one poll."""
        port = self.sim_ports[event.replica]
        while time.perf_counter() < deadline:
            if event.restart_at is not None and event.sim_ready_at is None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            event.sim_ready_at = self.now()
            status = await self.get_json(session, "/gateway/status")
            t = self.now()
            if status is not None:
                rep = next(r for r in status["replicas"] if r["index"] == event.replica)
                ad = next(
                    (r for r in status["adapters"]["replicas"] if r["index"] == event.replica),
                    None,
                )
                if not rep["healthy"] and event.ejected_at is None:
                    event.ejected_at = t
                if event.restart_at is not None and event.ejected_at is not None:
                    if rep["healthy"] and event.healthy_at is None:
                        event.healthy_at = t
                    synced = ad is not None and ad["state"] == "up" and ADAPTER in ad["adapters"]
                    if rep["healthy"] and synced:
                        event.reconciled_at = t
                        print(
                            f"[{t:7.1f}s] replica {event.replica} reconciled "
                            f"{t - event.restart_at:.2f}s after restart",
                            file=sys.stderr,
                        )
                        return
            await asyncio.sleep(0.2)
        event.notes.append("not reconciled before the deadline")

    # ----- orchestration

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await self.load_adapter(session)
            self.t0 = time.perf_counter()
            end = self.t0 + self.steady_s + self.kill_s
            bound = end + 2 * self.args.window
            tasks = [
                asyncio.create_task(self.worker(i, bound)) for i in range(self.args.concurrency)
            ]
            killer = asyncio.create_task(self.killer(session)) if self.kill_s > 0 else None
            try:
                await self.sampler(session, end)
                self.stop = True
                if killer is not None:
                    await asyncio.wait_for(killer, timeout=self.args.kill_every + 60)
                # In-flight requests finish normally (bounded by the request timeout).
                await asyncio.wait_for(
                    asyncio.gather(*tasks), timeout=self.args.request_timeout + 10
                )
            finally:
                self.stop = True
                for task in [*tasks, *([killer] if killer else [])]:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            # Requests that completed after the last window closed belong to the last phase.
            tail = self.window
            if sum(tail.outcomes.values()):
                self.raw.append((self.phase(self.now() - 1e-3), tail))
            self.final_status = await self.get_json(session, "/gateway/status")

    async def load_adapter(self, session: aiohttp.ClientSession) -> None:
        body = {"lora_name": ADAPTER, "lora_path": f"/adapters/{ADAPTER}"}
        async with session.post(
            f"http://127.0.0.1:{self.gw_port}/v1/load_lora_adapter",
            json=body,
            headers={"Authorization": f"Bearer {self.admin_key}"},
        ) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"adapter load failed: {r.status} {text[:300]}")


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """Sum of the Prometheus samples of ``name`` whose label set contains ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        series, value = line.rsplit(" ", 1)
        if labels in series:
            total += float(value)
    return total


def progress_line(s: dict[str, Any]) -> str:
    return (
        f"[{s['t_s']:7.1f}s {s['phase']:>6}] {s['rps']:7.1f} req/s  p50 {s['p50_ms']} ms  "
        f"p99 {s['p99_ms']} ms  added {s['added_p50_ms']}/{s['added_p99_ms']} ms  "
        f"err {s['errors']}  rss {s['rss_mb']} MB  fds {s['fds']}  "
        f"cpu % gw {s['gateway_cpu_pct']} client {s['client_cpu_pct']} "
        f"sims {'/'.join(str(c) for c in s['sims_cpu_pct'])}  "
        f"load {s['loadavg1']}"
    )


# --------------------------------------------------------------------------- analysis


def merge(windows: list[Window]) -> Window:
    out = Window()
    for w in windows:
        out.gw_latency.extend(w.gw_latency)
        out.pair_gw.extend(w.pair_gw)
        out.pair_direct.extend(w.pair_direct)
        out.outcomes.update(w.outcomes)
        out.stream_n += w.stream_n
        out.lora_n += w.lora_n
        out.direct_errors += w.direct_errors
    return out


def phase_summary(w: Window, seconds: float) -> dict[str, Any]:
    lat = sorted(w.gw_latency)
    done = sum(w.outcomes.values())
    plain = sum(v for k, v in w.outcomes.items() if k.startswith("plain."))
    stream = done - plain
    plain_lost = plain - w.outcomes["plain.ok"]
    stream_failed = stream - w.outcomes["stream.ok"]
    return {
        "seconds": round(seconds, 1),
        "requests": done,
        "rps": round(done / seconds, 1) if seconds > 0 else 0.0,
        "streaming": stream,
        "lora": w.lora_n,
        "errors": plain_lost + stream_failed,
        "plain_lost": plain_lost,
        "stream_failed": stream_failed,
        "stream_sse_error": w.outcomes["stream.sse_error"],
        "outcomes": {k: v for k, v in sorted(w.outcomes.items()) if not k.endswith(".ok")},
        "p50_ms": ms(pct(lat, 50)),
        "p99_ms": ms(pct(lat, 99)),
        "max_ms": ms(lat[-1]) if lat else None,
        "direct_errors": w.direct_errors,
        **added_latency(w, detail=True),
    }


def added_latency(w: Window, detail: bool = False) -> dict[str, Any]:
    """The gateway's added latency from paired samples (see the module docstring)."""
    gw, direct = sorted(w.pair_gw), sorted(w.pair_direct)
    out = {
        "pairs": len(gw),
        "added_p50_ms": ms(pct(gw, 50) - pct(direct, 50)),
        "added_p99_ms": ms(pct(gw, 99) - pct(direct, 99)),
    }
    if detail:
        diff = sorted(a - b for a, b in zip(w.pair_gw, w.pair_direct, strict=True))
        out.update(
            pair_gateway_p50_ms=ms(pct(gw, 50)),
            pair_gateway_p99_ms=ms(pct(gw, 99)),
            pair_direct_p50_ms=ms(pct(direct, 50)),
            pair_direct_p99_ms=ms(pct(direct, 99)),
            pair_diff_p50_ms=ms(pct(diff, 50)),
            pair_diff_p99_ms=ms(pct(diff, 99)),
        )
    return out


def growth(a: float, b: float) -> float:
    return round((b - a) / a, 4) if a else float("nan")


def analyze(soak: Soak) -> dict[str, Any]:
    args = soak.args
    ws = soak.windows
    by_phase: dict[str, list[Window]] = {}
    for phase, w in soak.raw:
        by_phase.setdefault(phase, []).append(w)
    phases = {
        p: phase_summary(merge(by_phase.get(p, [])), secs)
        for p, secs in (
            ("warmup", soak.warmup_s),
            ("steady", soak.steady_s - soak.warmup_s),
            ("kill", soak.kill_s),
        )
        if by_phase.get(p)
    }
    for name, summary in phases.items():
        mine = [s for s in ws if s["phase"] == name]
        if not mine:
            continue
        served = sum(s["requests"] for s in mine)
        cpu = sum(s["gateway_cpu_s"] for s in mine)
        span = args.window * len(mine)
        summary["gateway_cpu_ms_per_req"] = round(1000.0 * cpu / served, 3) if served else None
        summary["gateway_cpu_pct"] = round(100.0 * cpu / span, 1)
        # Rate over the sampled windows (requests finishing after the last sample still
        # count in the phase's totals and errors, not in its rate).
        summary["rps"] = round(served / span, 1)
    # Memory and FDs: steady post-warm-up samples (the targets), and the whole run after.
    warmup = [s for s in ws if s["phase"] == "warmup"]
    warm_end = warmup[-1] if warmup else None
    steady = [s for s in ws if s["phase"] == "steady"]
    after = [s for s in ws if s["phase"] != "warmup"]
    mem: dict[str, Any] = {}
    if warm_end is not None and steady:
        base = warm_end["rss_mb"]
        rss = [s["rss_mb"] for s in steady]
        fds = [s["fds"] for s in steady]
        mem = {
            "rss_end_of_warmup_mb": base,
            "rss_max_steady_mb": max(rss),
            "rss_first_steady_mb": rss[0],
            "rss_last_steady_mb": rss[-1],
            "rss_growth_max_vs_warmup": growth(base, max(rss)),
            "rss_growth_last_vs_first": growth(rss[0], rss[-1]),
            "rss_max_whole_run_mb": max(s["rss_mb"] for s in after),
            "rss_last_whole_run_mb": after[-1]["rss_mb"],
            "rss_growth_whole_run_max_vs_warmup": growth(base, max(s["rss_mb"] for s in after)),
            "fds_end_of_warmup": warm_end["fds"],
            "fds_first_steady": fds[0],
            "fds_last_steady": fds[-1],
            "fds_min_steady": min(fds),
            "fds_max_steady": max(fds),
            "fds_last_whole_run": after[-1]["fds"],
            "fds_max_whole_run": max(s["fds"] for s in after),
            "fds_not_connections_last_steady": steady[-1]["fds_not_connections"],
            "fds_not_connections_last_whole_run": after[-1]["fds_not_connections"],
            "fds_not_connections_max_whole_run": max(s["fds_not_connections"] for s in after),
            "close_wait_max_whole_run": max(s["close_wait"] for s in after),
            "close_wait_last_whole_run": after[-1]["close_wait"],
            "upstream_conns_last_steady": steady[-1]["upstream_conns"],
            "upstream_conns_last_whole_run": after[-1]["upstream_conns"],
        }
        if "index_bytes" in warm_end and "index_bytes" in steady[-1]:
            index_growth = (steady[-1]["index_bytes"] - warm_end["index_bytes"]) / MIB
            mem.update(
                index_end_of_warmup={k: warm_end.get(f"index_{k}") for k in INDEX_KINDS},
                index_last_steady={k: steady[-1].get(f"index_{k}") for k in INDEX_KINDS},
                index_last_whole_run={k: after[-1].get(f"index_{k}") for k in INDEX_KINDS},
                index_estimate_growth_steady_mb=round(index_growth, 2),
                # The index's own estimate (rough CPython sizes), so this is indicative only.
                rss_growth_last_vs_warmup_net_of_index=growth(
                    base, steady[-1]["rss_mb"] - index_growth
                ),
            )
    kills = [k.summary() for k in soak.kills]
    # Attribute each kill-phase failure to the latest kill before it.
    for summary in kills:
        summary.update(plain_lost=0, stream_failed=0, stream_failed_on_killed_replica=0)
    for f in soak.failures:
        if f.t < soak.steady_s:
            continue
        owner = None
        for summary in kills:
            if summary["kill_at_s"] <= f.t:
                owner = summary
        if owner is None:
            continue
        if f.stream:
            owner["stream_failed"] += 1
            owner["stream_failed_on_killed_replica"] += f.replica == owner["replica"]
        else:
            owner["plain_lost"] += 1
    failure_kinds = Counter(
        f"{soak.phase(f.t)}.{'stream' if f.stream else 'plain'}.{f.kind}" for f in soak.failures
    )
    return {
        "phases": phases,
        "memory": mem,
        "kills": kills,
        "failure_kinds": dict(sorted(failure_kinds.items())),
        "verdicts": verdicts(phases, mem, kills, args),
    }


MIB = 1024.0 * 1024.0
INDEX_KINDS = ("served", "nodes", "templates", "bytes")
FD_SLACK = 10  # connection pools open and close a few sockets; a leak grows without bound


def verdicts(
    phases: dict[str, Any],
    mem: dict[str, Any],
    kills: list[dict[str, Any]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(target: str, ok: bool | None, measured: str) -> None:
        out.append({"target": target, "pass": ok, "measured": measured})

    steady_err = sum(phases[p]["errors"] for p in ("warmup", "steady") if p in phases)
    add("errors = 0 (steady phase, warm-up included)", steady_err == 0, f"{steady_err} errors")
    if mem:
        g1, g2 = mem["rss_growth_max_vs_warmup"], mem["rss_growth_last_vs_first"]
        add(
            "RSS growth after warm-up < 5 % (max vs end of warm-up, and last vs first)",
            g1 < RSS_LIMIT and g2 < RSS_LIMIT,
            f"{100 * g1:+.2f} % max vs warm-up ({mem['rss_end_of_warmup_mb']} -> "
            f"{mem['rss_max_steady_mb']} MB); {100 * g2:+.2f} % last vs first",
        )
        if "rss_growth_last_vs_warmup_net_of_index" in mem:
            net = mem["rss_growth_last_vs_warmup_net_of_index"]
            add(
                "(diagnostic) steady RSS growth net of the bounded prefix index's own size "
                "estimate < 5 %",
                net < RSS_LIMIT,
                f"{100 * net:+.2f} % (index estimate grew "
                f"{mem['index_estimate_growth_steady_mb']:+.1f} MB)",
            )
        first, last = mem["fds_first_steady"], mem["fds_last_steady"]
        flat = abs(last - first) <= FD_SLACK and mem["fds_max_steady"] - first <= FD_SLACK
        add(
            f"open FDs flat after warm-up (last and max within {FD_SLACK} of the first sample)",
            flat,
            f"{first} -> {last} (min {mem['fds_min_steady']}, max {mem['fds_max_steady']})",
        )
    if "kill" in phases:
        k = phases["kill"]
        add(
            f"lost non-streaming requests = 0 with a replica killed every {args.kill_every:g} s",
            k["plain_lost"] == 0,
            f"{k['plain_lost']} of {k['requests'] - k['streaming']}",
        )
        on_killed = sum(e["stream_failed_on_killed_replica"] for e in kills)
        add(
            "streaming failures only on the killed replica (reported; SSE error events)",
            on_killed == k["stream_failed"],
            f"{k['stream_failed']} failed streams of {k['streaming']} "
            f"({k['stream_sse_error']} SSE error events; {on_killed} on the killed replica)",
        )
        times = [e["reconcile_after_restart_s"] for e in kills]
        done = [t for t in times if t is not None]
        add(
            "every restarted replica reconciled (healthy + adapter replayed) before the next kill",
            bool(kills) and len(done) == len(kills),
            "reconcile after restart: "
            + ", ".join("-" if t is None else f"{t:.2f} s" for t in times),
        )
        if mem:
            # The upstream pool keeps the connections it opened while a replica was out
            # (aiohttp reuses idle connections round-robin, so none idles out under load):
            # the number of *connections* may settle higher, bounded by the load. A leak
            # shows in what is not a live connection, or as CLOSE_WAIT sockets.
            before, last = (
                mem["fds_not_connections_last_steady"],
                mem["fds_not_connections_last_whole_run"],
            )
            add(
                "no leaked FDs after the kill phase: FDs that are not live connections back "
                f"to the steady level (within {FD_SLACK}), no CLOSE_WAIT sockets at the end",
                abs(last - before) <= FD_SLACK and mem["close_wait_last_whole_run"] == 0,
                f"non-connection FDs {before} -> {last} "
                f"(max {mem['fds_not_connections_max_whole_run']}); "
                f"CLOSE_WAIT {mem['close_wait_last_whole_run']} at end "
                f"(max {mem['close_wait_max_whole_run']}); upstream connections per replica "
                f"{mem['upstream_conns_last_steady']} -> {mem['upstream_conns_last_whole_run']}",
            )
    return out


# --------------------------------------------------------------------------- output


def to_json(result: dict[str, Any]) -> str:
    """Indented JSON with one line per sampling window (a 45-minute run has ~270)."""
    windows = ",\n".join("  " + json.dumps(w, separators=(",", ":")) for w in result["windows"])
    text = json.dumps({**result, "windows": "@WINDOWS@"}, indent=1)
    return text.replace('"@WINDOWS@"', "[\n" + windows + "\n ]") + "\n"


def fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def buckets(
    windows: list[dict[str, Any]], raw: list[tuple[str, Window]], size: float, window: float
) -> list[dict[str, Any]]:
    """Aggregate sampling windows into ``size``-second rows (percentiles from raw data)."""
    rows = []
    per = max(1, round(size / window))
    for i in range(0, len(windows), per):
        chunk = windows[i : i + per]
        w = merge([r for _, r in raw[i : i + per]])
        s = phase_summary(w, sum(window for _ in chunk))
        rows.append(
            {
                "from_s": round(chunk[0]["t_s"] - window),
                "to_s": round(chunk[-1]["t_s"]),
                "phase": "/".join(dict.fromkeys(c["phase"] for c in chunk)),
                **{
                    k: s[k]
                    for k in (
                        "requests",
                        "rps",
                        "errors",
                        "p50_ms",
                        "p99_ms",
                        "added_p50_ms",
                        "added_p99_ms",
                        "pairs",
                    )
                },
                "rss_mb": chunk[-1]["rss_mb"],
                "fds": chunk[-1]["fds"],
                "gateway_cpu_pct": round(sum(c["gateway_cpu_pct"] for c in chunk) / len(chunk), 1),
            }
        )
    return rows


def markdown(result: dict[str, Any], short: bool) -> str:
    cfg, an, machine = result["config"], result["analysis"], result["machine"]
    dirty = ", gateway tree dirty" if machine["gateway_tree_dirty"] else ""
    stem = Path(result["out"]).name
    pool = cfg["prompt_pool"]
    prompts = f"prompt cycled from a set of {pool}" if pool else "fresh prompt"
    capacity = cfg.get("index_capacity") or 65_536
    nodes = 4 * capacity if cfg.get("index_capacity") else 262_144
    lines = [
        "# Soak: sustained mix, then replica kill/restart"
        + (" (SHORT validation run)" if short else ""),
        "",
    ]
    if short:
        lines += [
            "> **Short run** for validating the harness, not the issue's 30 + 15 minute soak. "
            "Figures are indicative only.",
            "",
        ]
    lines += [
        f"`{result['command']}` on {machine['nproc']} cores "
        f"(git {machine['git_head']}{dirty}; "
        f"load average at start {machine['loadavg_at_start'][0]:.2f}; "
        "the machine is shared, so absolute latencies move with other work).",
        "",
        f"- {cfg['replicas']} sim replicas, latency model `{cfg['latency_model']}`; gateway "
        f"health probe every {cfg['health_interval_s']} s; all processes unpinned, sharing "
        "the same cores.",
        f"- Closed loop of {cfg['concurrency']} keep-alive connections; TRL-shaped bodies "
        f"({PROMPT_TOKENS}-token prompts, max_tokens {MIN_TOKENS}..{MAX_TOKENS}, groups of {GROUP} "
        f"sharing a {prompts}), {100 * cfg['stream_fraction']:.0f} % streaming (read to "
        f"`[DONE]`), {100 * cfg['lora_fraction']:.0f} % of groups on adapter `{ADAPTER}` "
        "(loaded through the gateway before the run).",
        f"- Steady {cfg['minutes']:g} min (first {cfg['warmup_minutes']:g} min warm-up), then "
        f"{cfg['kill_minutes']:g} min with one replica SIGKILLed every {cfg['kill_every_s']:g} s "
        f"(mid-slot, rotating) and restarted {cfg['restart_after_s']:g} s later.",
        "",
        "## Verdicts",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    for v in an["verdicts"]:
        verdict = "PASS" if v["pass"] else ("FAIL" if v["pass"] is False else "not judged")
        lines.append(f"| {v['target']} | {v['measured']} | **{verdict}** |")
    lines += [
        "",
        "## Phases",
        "",
        "| phase | s | requests | req/s | errors | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| pairs | gateway CPU % | gateway CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in an["phases"].items():
        lines.append(
            f"| {name} | {p['seconds']:.0f} | {p['requests']} | {fmt(p['rps'])} | {p['errors']} "
            f"| {fmt(p['p50_ms'])} | {fmt(p['p99_ms'])} | {fmt(p['added_p50_ms'], 2)} "
            f"| {fmt(p['added_p99_ms'], 2)} | {p['pairs']} | {fmt(p['gateway_cpu_pct'])} "
            f"| {fmt(p['gateway_cpu_ms_per_req'], 2)} |"
        )
    lines += [
        "",
        "p50/p99 = client-observed latency through the gateway (streams: until `[DONE]`). "
        "**Added latency** (paired samples): for "
        f"{100 * cfg['twin_fraction']:.0f} % of the gateway's requests, an identical twin is "
        "sent *directly* to every live replica at the same instant; the twin on the replica the "
        "gateway picked (its `X-Gateway-Replica`) forms the pair, the others are discarded. The "
        "sims' service time depends only on a request's shape and the replica's load at that "
        "moment, so a pair differs only by the gateway's part. Added p50 (p99) = p50 (p99) of "
        "the paired gateway latencies minus p50 (p99) of their twins', over the same interval "
        "(a pair counts only if both succeeded). The twins add about "
        f"{100 * cfg['twin_fraction'] * cfg['replicas']:.0f} % extra load straight to the "
        "replicas. When the machine is CPU-bound, the added latency includes the gateway "
        "waiting for its share of the CPU.",
        "",
        f"Latency model `{cfg['latency_model']}`: 20 ms per token (a loaded replica's "
        "inter-token time) rather than a few ms, because at 200 requests in flight 2 ms per "
        "token would offer ~2,500 req/s, several times what 2 cores shared by the gateway, the "
        "sims and the client can serve; the closed loop would then measure only CPU queueing.",
        "",
        "## Over time",
        "",
        "| from s | to s | phase | requests | req/s | errors | p50 ms | p99 ms | added p50 ms "
        "| added p99 ms | RSS MB | FDs | gateway CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["over_time"]:
        lines.append(
            f"| {r['from_s']} | {r['to_s']} | {r['phase']} | {r['requests']} | {fmt(r['rps'])} "
            f"| {r['errors']} | {fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} "
            f"| {fmt(r['added_p50_ms'], 2)} | {fmt(r['added_p99_ms'], 2)} | {r['rss_mb']} "
            f"| {r['fds']} | {r['gateway_cpu_pct']} |"
        )
    mem = an["memory"]
    if mem:
        lines += [
            "",
            "## Memory and file descriptors (gateway process)",
            "",
            f"- RSS: {mem['rss_end_of_warmup_mb']} MB at the end of warm-up, max "
            f"{mem['rss_max_steady_mb']} MB in the steady phase "
            f"({100 * mem['rss_growth_max_vs_warmup']:+.2f} %), first/last steady sample "
            f"{mem['rss_first_steady_mb']} / {mem['rss_last_steady_mb']} MB "
            f"({100 * mem['rss_growth_last_vs_first']:+.2f} %); whole run max "
            f"{mem['rss_max_whole_run_mb']} MB "
            f"({100 * mem['rss_growth_whole_run_max_vs_warmup']:+.2f} % vs warm-up).",
            f"- Open FDs: {mem['fds_end_of_warmup']} at the end of warm-up; steady "
            f"{mem['fds_min_steady']}..{mem['fds_max_steady']} (first {mem['fds_first_steady']}, "
            f"last {mem['fds_last_steady']}); after the kill phase {mem['fds_last_whole_run']} "
            f"(max {mem['fds_max_whole_run']}). Almost all are sockets: the client's "
            f"keep-alive connections plus the upstream pool (per replica "
            f"{mem['upstream_conns_last_steady']} at the end of the steady phase, "
            f"{mem['upstream_conns_last_whole_run']} at the end). FDs that are not a live "
            f"connection: {mem['fds_not_connections_last_steady']} -> "
            f"{mem['fds_not_connections_last_whole_run']}; CLOSE_WAIT sockets at most "
            f"{mem['close_wait_max_whole_run']}.",
        ]
        if "index_last_steady" in mem:
            a, b, c = (
                mem["index_end_of_warmup"],
                mem["index_last_steady"],
                mem["index_last_whole_run"],
            )
            lines += [
                f"- The prefix router's index (bounded: {capacity} served prompts, "
                f"{nodes} nodes in this run) grows while new prompts arrive: served "
                f"{a['served']:.0f} -> "
                f"{b['served']:.0f} -> {c['served']:.0f}, nodes {a['nodes']:.0f} -> "
                f"{b['nodes']:.0f} -> {c['nodes']:.0f} (end of warm-up -> end of steady -> "
                f"end), its own size estimate {a['bytes'] / MIB:.1f} -> {b['bytes'] / MIB:.1f} "
                f"-> {c['bytes'] / MIB:.1f} MB. Steady-phase RSS growth net of that estimate: "
                f"{100 * mem['rss_growth_last_vs_warmup_net_of_index']:+.2f} % (indicative: "
                "the estimate uses rough CPython sizes). `--prompt-pool N` (prompts cycled from "
                "a fixed set, as epochs over a data set) holds the index steady after warm-up, "
                "which separates its fill from a leak.",
            ]
    if an["kills"]:
        lines += [
            "",
            "## Kill and restart",
            "",
            "| # | replica | killed at s | ejected after s | replica ready after restart s "
            "| healthy after restart s | **reconciled after restart s** | gateway part s "
            "| lost non-streaming | failed streams (on killed replica) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, e in enumerate(an["kills"], 1):
            lines.append(
                f"| {i} | {e['replica']} | {e['kill_at_s']:.1f} "
                f"| {fmt(e['eject_after_kill_s'], 2)} "
                f"| {fmt(e['replica_ready_after_restart_s'], 2)} "
                f"| {fmt(e['healthy_after_restart_s'], 2)} "
                f"| **{fmt(e['reconcile_after_restart_s'], 2)}** "
                f"| {fmt(e['reconcile_after_replica_ready_s'], 2)} | {e['plain_lost']} "
                f"| {e['stream_failed']} ({e['stream_failed_on_killed_replica']}) |"
            )
        lines += [
            "",
            "Time to reconcile = from the restart (process spawned on the same port) until "
            "`/gateway/status` (polled every 0.2 s) shows the replica healthy *and* its adapter "
            f"state `up` holding `{ADAPTER}` (replayed by the gateway). It includes the "
            "replica's own start-up; *gateway part* counts from the moment the restarted replica "
            "first answered `/health` itself, so it is bounded by the health probe interval plus "
            "the adapter replay. Failures are attributed to the latest kill before them.",
        ]
    kinds = an["failure_kinds"]
    if kinds:
        lines += ["", "Failure kinds: " + ", ".join(f"`{k}` {v}" for k, v in kinds.items()) + "."]
    lines += [
        "",
        f"Raw windows ({cfg['window_s']:g} s) and every kill event: `{stem}.json`; "
        f"plot: `{stem}.png`.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    if (plt := pyplot()) is None:
        return

    ws = result["windows"]
    t = [w["t_s"] / 60.0 for w in ws]
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax = axes[0]
    ax.plot(t, [w["p50_ms"] for w in ws], label="p50 through gateway")
    ax.plot(t, [w["p99_ms"] for w in ws], label="p99 through gateway")
    ax.set_ylabel("latency ms")
    ax.set_title("Client latency (streams until [DONE])")
    ax = axes[1]
    ax.plot(t, [w["added_p50_ms"] for w in ws], label="added p50")
    ax.plot(t, [w["added_p99_ms"] for w in ws], label="added p99", alpha=0.7)
    ax.axhline(0, color="grey", lw=0.5)
    # A retry after a kill costs a whole request: symlog keeps those spikes and the
    # millisecond-level steady state readable on one axis.
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylabel("added ms")
    ax.set_title("Added latency: paired gateway requests minus their direct twins")
    ax = axes[2]
    ax.plot(t, [w["rss_mb"] for w in ws], color="tab:purple", label="gateway RSS MB")
    if all("index_bytes" in w for w in ws):
        ax.plot(
            t,
            [w["rss_mb"] - w["index_bytes"] / MIB for w in ws],
            color="tab:purple",
            ls=":",
            label="RSS minus the prefix index's size estimate",
        )
    ax.set_ylabel("RSS MB")
    ax2 = ax.twinx()
    ax2.plot(t, [w["fds"] for w in ws], color="tab:green", label="gateway open FDs")
    ax2.plot(
        t,
        [w["fds_not_connections"] for w in ws],
        color="tab:olive",
        ls="--",
        label="FDs that are not live connections",
    )
    ax2.set_ylabel("open FDs")
    ax.set_title("Gateway RSS and open file descriptors")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax = axes[3]
    ax.plot(t, [w["rps"] for w in ws], label="req/s")
    ax.set_ylabel("req/s")
    ax3 = ax.twinx()
    ax3.bar(t, [w["errors"] for w in ws], width=0.1, color="tab:red", label="errors / window")
    ax3.set_ylabel("errors per window")
    ax.set_xlabel("minutes since load start")
    ax.legend(loc="upper left")
    ax3.legend(loc="upper right")
    cfg = result["config"]
    for a in axes:
        a.axvspan(0, cfg["warmup_minutes"], color="grey", alpha=0.12)
        for k in result["analysis"]["kills"]:
            a.axvline(k["kill_at_s"] / 60.0, color="red", ls="-", lw=1)
            if k["restart_at_s"] is not None:
                a.axvline(k["restart_at_s"] / 60.0, color="red", ls=":", lw=1)
        if cfg["kill_minutes"] > 0:
            a.axvline(cfg["minutes"], color="black", ls="--", lw=0.8)
    axes[0].legend(loc="upper left")
    axes[1].legend(loc="upper left")
    fig.suptitle(
        "Soak: grey = warm-up, dashed = kill phase starts, red = SIGKILL, dotted = restart"
        + (" (SHORT run)" if cfg["minutes"] < 30 else "")
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="steady phase, warm-up included"
    )
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--kill-minutes", type=float, default=15.0, help="kill phase (0 = none)")
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills")
    parser.add_argument("--restart-after", type=float, default=5.0, help="seconds dead")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--stream-fraction", type=float, default=0.3)
    parser.add_argument("--lora-fraction", type=float, default=0.2, help="share of groups")
    parser.add_argument(
        "--prompt-pool",
        type=int,
        default=0,
        help="distinct prompts, cycled (0 = a fresh prompt for every group)",
    )
    parser.add_argument(
        "--index-capacity",
        type=int,
        default=2048,
        help="the gateway's prefix-index capacity in served prompts (nodes: 4x). Small "
        "enough to fill during warm-up, so RSS after it shows leaks, not the index's "
        "designed, bounded fill (0 = the gateway default, 65,536)",
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--latency-model", default=DEFAULT_LATENCY, help="sim-replica spec")
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=10.0, help="sampling period, s")
    parser.add_argument(
        "--twin-fraction",
        type=float,
        default=0.05,
        help="share of gateway requests with direct twins on every replica (added latency)",
    )
    parser.add_argument("--max-twins", type=int, default=64, help="twins in flight at most")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "soak")
    args = parser.parse_args(argv)
    if args.minutes * 60 <= args.warmup_minutes * 60 + args.window:
        parser.error("--minutes must exceed --warmup-minutes by at least one window")
    if args.kill_minutes > 0 and args.kill_minutes * 60 < args.kill_every:
        parser.error("--kill-minutes must cover at least one --kill-every period")

    machine = machine_info()
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    admin_key = secrets.token_hex(16)
    (log_dir / "admin-key").write_text(admin_key)
    gw_args = ["--host", "127.0.0.1", "--admin-key-file", str(log_dir / "admin-key"),
               "--log-level", "WARNING",
               "--health-interval-s", f"{args.health_interval:g}"]  # fmt: skip
    if args.index_capacity > 0:
        routing = {"index_capacity": args.index_capacity, "node_capacity": 4 * args.index_capacity}
        (log_dir / "gateway.yaml").write_text(json.dumps({"routing": routing}))  # JSON is YAML
        gw_args += ["--config", str(log_dir / "gateway.yaml")]
    sim_args = ["--latency-model", args.latency_model, "--log-level", "WARNING"]
    print(f"logs in {log_dir}", file=sys.stderr)
    soak: Soak | None = None
    # SIGTERM (a stopped run) unwinds through the finally of sim_fleet: the children run in
    # their own sessions, so nothing else would stop them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with sim_fleet(args.replicas, log_dir, sim_args=sim_args, gateway_args=gw_args, cwd=ROOT,
                   interval=0.1, grace=15) as fleet:  # fmt: skip
        sim_ports = [p.port for p in fleet.sims]
        soak = Soak(args, fleet.sims, sim_ports, fleet.gateway, fleet.gateway.port, admin_key)
        uvloop.run(soak.run())
    analysis = analyze(soak)
    result = {
        "command": " ".join(
            ["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "out": str(args.out),
        "machine": machine,
        "config": {
            "minutes": args.minutes,
            "warmup_minutes": args.warmup_minutes,
            "kill_minutes": args.kill_minutes,
            "kill_every_s": args.kill_every,
            "restart_after_s": args.restart_after,
            "concurrency": args.concurrency,
            "stream_fraction": args.stream_fraction,
            "lora_fraction": args.lora_fraction,
            "replicas": args.replicas,
            "prompt_pool": args.prompt_pool,
            "index_capacity": args.index_capacity,
            "latency_model": args.latency_model,
            "health_interval_s": args.health_interval,
            "window_s": args.window,
            "twin_fraction": args.twin_fraction,
            "max_twins": args.max_twins,
            "request_timeout_s": args.request_timeout,
            "log_dir": str(log_dir),
        },
        "analysis": analysis,
        "over_time": buckets(
            soak.windows, soak.raw, max(args.window, min(300.0, args.kill_every)), args.window
        ),
        "windows": soak.windows,
        "final_status": soak.final_status,
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    short = args.minutes < 30 or (0 < args.kill_minutes < 15)
    out.with_suffix(".json").write_text(to_json(result))
    md = markdown(result, short)
    out.with_suffix(".md").write_text(md)
    plot(result, out.with_suffix(".png"))
    print(md)
    return 0 if all(v["pass"] is not False for v in analysis["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
