"""The one load client of the benchmarks: raw keep-alive HTTP/1.1 on asyncio + uvloop.

Why its own: an httpx or aiohttp client costs more CPU per request than the fronts it
measures; this one costs ~20-40 µs, so one client core drives every front here.

C connections, each with exactly one request in flight, POST a ~1 KB TRL-shaped completion
body (``{"model", "prompt": [~200 token ids], "max_tokens": 16, "n": 1, "return_token_ids":
true, "logprobs": 0, "seed"}``; ``"stream": true`` too with ``--stream``) to
``/v1/completions`` until N responses have arrived (or a time limit passes). Responses are
parsed properly (status line, ``Content-Length`` and ``Transfer-Encoding: chunked``); any
non-200 counts as an error, and with ``--stream`` so does a 200 that is not the instant
upstream's complete SSE stream (``check_stream``).

Closed loop (``run_load``, no ``--rate``): each connection sends its next request from the
previous response's callback.

Paced open loop (``run_paced``, ``--rate R``): the C connections together offer R req/s.
Request j (0..N-1) is scheduled at ``start + j / R`` on connection ``j % C``, so each
connection has its own schedule (interval C/R, start staggered by 1/R) and never more than
one request in flight. Latency is measured from the *scheduled* send time (no coordinated
omission). If a connection is still busy at its next slot, that send is *late*: it goes
out as soon as the response arrives and its latency still counts from the slot. Late sends,
the achieved rate, in-flight counts and the client's own timer lag are reported, so a front
that cannot keep up shows as such. Before the schedule starts, every connection sends one
untimed priming request (first-request-on-connection costs are not measured).

As a process (``python -m bench.lib.load``; ``run_client`` / ``spawn_client`` start it
pinned to the client CPUs): prints one JSON object, ``summarize``'s fields plus its own CPU
per request and, with ``--cpu-pid``, the on-CPU time per request of that process's tree
(``bench.lib.cpu``) over exactly the measured requests (the warm-up runs first, in the same
process).

    python -m bench.lib.load --url http://127.0.0.1:8000 --concurrency 1 --requests 1000
    python -m bench.lib.load --url http://127.0.0.1:8000 --rate 300 --requests 2400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvloop

from bench.lib import cpu
from bench.lib.fronts import PY, ROOT, pin
from bench.lib.upstream import STREAM_TOKENS

__all__ = ["LoadResult", "make_bodies", "run_client", "run_load", "run_paced", "summarize"]


def trl_body(
    prompt: list[int],
    *,
    model: str = "tiny-base",
    max_tokens: int = 16,
    seed: int = 0,
    stream: bool = False,
) -> bytes:
    """One completion body shaped as TRL's vLLM client sends it (token-id prompt)."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def make_bodies(
    count: int = 64, prompt_tokens: int = 200, seed: int = 0, *, stream: bool = False
) -> list[bytes]:
    """Distinct TRL-shaped completion bodies (~1 KB each): 8-request groups share a prompt."""
    rng = random.Random(seed)
    bodies = []
    prompt: list[int] = []
    for i in range(count):
        if i % 8 == 0:
            prompt = [rng.randrange(100, 32000) for _ in range(prompt_tokens)]
        bodies.append(trl_body(prompt, seed=rng.randrange(1 << 30), stream=stream))
    return bodies


def take_response(buf: bytearray, check: Check | None) -> int | None:
    """The status of the whole response at the start of ``buf``, consumed from it (``check``
    may replace the status), or None while it is incomplete."""
    parsed = parse_response(buf)
    if parsed is None:
        return None
    status, head, consumed = parsed
    if check is not None:
        status = check(status, head, bytes(buf[:consumed]))
    del buf[:consumed]
    return status


def _requests(host: str, port: int, path: str, bodies: list[bytes]) -> list[bytes]:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Accept: application/json\r\nUser-Agent: loadgen\r\nContent-Length: "
    ).encode()
    return [head + str(len(b)).encode() + b"\r\n\r\n" + b for b in bodies]


class ProtocolError(Exception):
    pass


def parse_response(buf: bytearray) -> tuple[int, bytes, int] | None:
    """(status, lower-cased head, bytes consumed) once ``buf`` starts with one whole
    response, else None. The one response parser of the benchmarks: every client here has
    one request in flight per connection, so a chunked response is complete only when the
    buffer ends with the last chunk, and the walk over its chunks runs only then."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    try:
        status = int(head[9:12])
    except ValueError as exc:
        raise ProtocolError(f"bad status line: {head[:40]!r}") from exc
    body_start = end + 4
    if b"transfer-encoding:" in head and b"chunked" in head:
        if not buf.endswith(b"0\r\n\r\n"):
            return None
        pos = body_start
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size = int(bytes(buf[pos:line_end]).split(b";", 1)[0], 16)
            if size == 0:
                # No trailers expected; the last-chunk line is followed by CRLF.
                if len(buf) < line_end + 4:
                    return None
                return status, head, line_end + 4
            pos = line_end + 2 + size + 2
            if len(buf) < pos:
                return None
    marker = head.find(b"content-length:")
    length = 0
    if marker >= 0:
        line_end = head.find(b"\r\n", marker)
        length = int(head[marker + 15 : line_end if line_end > 0 else None])
    elif status not in (204, 304) and not (100 <= status < 200):
        raise ProtocolError("response without Content-Length or chunked framing")
    total = body_start + length
    if len(buf) < total:
        return None
    return status, head, total


def body_of(message: bytes, head: bytes) -> bytes:
    """The body of one whole response ``message`` (as ``parse_response`` delimited it and
    lower-cased its ``head``), de-chunked."""
    raw = message[len(head) + 4 :]
    if not (b"transfer-encoding:" in head and b"chunked" in head):
        return raw
    out: list[bytes] = []
    pos = 0
    while (line_end := raw.find(b"\r\n", pos)) >= 0:
        size = int(raw[pos:line_end].split(b";", 1)[0], 16)
        if size == 0:
            break
        out.append(raw[line_end + 2 : line_end + 2 + size])
        pos = line_end + 2 + size + 2
    return b"".join(out)


# Synthetic client-side statuses of a 200 that is not what a stream request needs (they
# count as errors in ``summarize``).
STATUS_NOT_A_STREAM = 597  # 200, but not text/event-stream
STATUS_BROKEN_STREAM = 598  # stream without all token events or without [DONE]

Check = Callable[[int, bytes, bytes], int]
"""(status, lower-cased head, whole response) -> the status to record."""


def check_stream(status: int, head: bytes, message: bytes) -> int:
    """A 200 to a stream request must be the upstream's complete SSE stream: all
    ``STREAM_TOKENS`` events and ``data: [DONE]``."""
    if status != 200:
        return status
    if b"text/event-stream" not in head:
        return STATUS_NOT_A_STREAM
    body = body_of(message, head)
    if not body.endswith(b"data: [DONE]\n\n") or body.count(b"data: {") != STREAM_TOKENS:
        return STATUS_BROKEN_STREAM
    return status


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    elapsed_s: float = 0.0
    timed_out: bool = False
    # Paced (open-loop) mode only:
    paced: bool = False
    offered_rps: float = 0.0
    service_s: list[float] = field(default_factory=list)  # response - actual write
    send_lag_s: list[float] = field(default_factory=list)  # actual write - slot (on-time sends)
    late_sends: int = 0  # connection still busy at its slot
    max_late_s: float = 0.0  # worst write - slot among late sends
    unsent: int = 0  # slots never sent (deadline or dead connection)
    primed: int = 0  # untimed priming requests (one per connection)
    max_in_flight: int = 0


class _Shared:
    def __init__(self, requests: int, deadline: float, payloads: list[bytes]) -> None:
        self.remaining = requests  # requests not yet started
        self.outstanding = 0
        self.deadline = deadline
        self.payloads = payloads
        self.next_payload = 0
        self.result = LoadResult()
        self.check: Check | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self) -> bytes | None:
        if self.remaining <= 0:
            return None
        if time.perf_counter() > self.deadline:
            self.result.timed_out = True
            return None
        self.remaining -= 1
        self.outstanding += 1
        payload = self.payloads[self.next_payload]
        self.next_payload = (self.next_payload + 1) % len(self.payloads)
        return payload

    def finished_one(self) -> None:
        self.outstanding -= 1
        idle = self.outstanding == 0 and (self.remaining <= 0 or self.result.timed_out)
        if idle and not self.done.done():
            self.done.set_result(None)


class _OneInFlight(asyncio.Protocol):
    """A keep-alive connection with at most one request in flight (``busy``): each whole
    response goes to ``_answered``, an unparsable one to ``_broken``."""

    buf: bytearray
    busy: bool
    check: Check | None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            return
        try:
            status = take_response(self.buf, self.check)
        except (ProtocolError, ValueError):
            self._broken()
            return
        if status is not None:
            self.busy = False
            self._answered(status, time.perf_counter())

    def _answered(self, status: int, now: float) -> None:
        raise NotImplementedError

    def _broken(self) -> None:
        raise NotImplementedError


class _Conn(_OneInFlight):
    """One keep-alive connection; sends the next request from the response callback."""

    def __init__(self, shared: _Shared, record: bool) -> None:
        self.shared = shared
        self.check = shared.check
        self.record = record
        self.buf = bytearray()
        self.sent_at = 0.0
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def fire(self) -> None:
        payload = self.shared.take()
        if payload is None:
            return
        self.busy = True
        self.sent_at = time.perf_counter()
        assert self.transport is not None
        self.transport.write(payload)

    def _answered(self, status: int, now: float) -> None:
        result = self.shared.result
        result.statuses[status] += 1
        if self.record:
            result.latencies_s.append(now - self.sent_at)
        self.shared.finished_one()
        self.fire()

    def _broken(self) -> None:
        if self.busy:
            self.busy = False
            self.shared.result.transport_errors += 1
            self.shared.finished_one()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.busy = False
            self.shared.result.transport_errors += 1
            self.shared.finished_one()
        if not self.closed.done():
            self.closed.set_result(None)


class _PacedShared:
    def __init__(self, rate: float, conns: int, deadline: float, payloads: list[bytes]) -> None:
        self.conns = conns
        self.interval = conns / rate
        self.rate = rate
        self.deadline = deadline
        self.payloads = payloads
        self.start = 0.0
        self.in_flight = 0
        self.live = 0  # connections with slots left
        self.priming = 0
        self.result = LoadResult(paced=True, offered_rps=rate)
        self.check: Check | None = None
        loop = asyncio.get_running_loop()
        self.primed: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()

    def conn_finished(self) -> None:
        self.live -= 1
        if self.live <= 0 and not self.done.done():
            self.done.set_result(None)

    def primed_one(self) -> None:
        self.priming -= 1
        if self.priming <= 0 and not self.primed.done():
            self.primed.set_result(None)


class _PacedConn(_OneInFlight):
    """One keep-alive connection with its own open-loop schedule (one request in flight)."""

    def __init__(self, shared: _PacedShared, index: int, count: int) -> None:
        self.shared = shared
        self.check = shared.check
        self.index = index  # global slot j = index + k * C
        self.count = count  # this connection's slots
        self.k = 0  # next slot number on this connection
        self.buf = bytearray()
        self.busy = False
        self.priming = False
        self.finished = False
        self.slot_at = 0.0
        self.sent_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _payload(self) -> bytes:
        payloads = self.shared.payloads
        return payloads[(self.index + self.k * self.shared.conns) % len(payloads)]

    def prime(self) -> None:
        assert self.transport is not None
        self.priming = self.busy = True
        self.transport.write(self.shared.payloads[self.index % len(self.shared.payloads)])

    def slot_time(self, k: int) -> float:
        return self.shared.start + (self.index / self.shared.rate) + k * self.shared.interval

    def schedule_next(self) -> None:
        """Arm the timer for slot ``k``, or send now (late) if it has already passed."""
        if self.k >= self.count:
            self._finish()
            return
        slot = self.slot_time(self.k)
        now = time.perf_counter()
        if now > self.shared.deadline:
            self.shared.result.timed_out = True
            self._finish()
            return
        if slot <= now:
            self._send(slot, late=True)
        else:
            self.timer = self.loop.call_at(self.loop.time() + (slot - now), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if not self.finished and not self.busy:
            self._send(self.slot_time(self.k), late=False)

    def _send(self, slot: float, *, late: bool) -> None:
        assert self.transport is not None
        payload = self._payload()
        self.k += 1
        self.busy = True
        self.slot_at = slot
        self.sent_at = now = time.perf_counter()
        shared = self.shared
        result = shared.result
        if late:
            result.late_sends += 1
            result.max_late_s = max(result.max_late_s, now - slot)
        else:
            result.send_lag_s.append(now - slot)
        shared.in_flight += 1
        result.max_in_flight = max(result.max_in_flight, shared.in_flight)
        self.transport.write(payload)

    def _broken(self) -> None:
        self._lost()
        if self.transport is not None:
            self.transport.close()

    def _answered(self, status: int, now: float) -> None:
        result = self.shared.result
        if self.priming:
            self.priming = False
            result.primed += 1
            if status != 200:
                result.statuses[status] += 1  # a failing priming request is an error too
            self.shared.primed_one()
            return
        self.shared.in_flight -= 1
        result.statuses[status] += 1
        result.latencies_s.append(now - self.slot_at)
        result.service_s.append(now - self.sent_at)
        self.schedule_next()

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.shared.result.unsent += self.count - self.k
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.shared.conn_finished()

    def _lost(self) -> None:
        if self.busy:
            self.busy = False
            self.shared.result.transport_errors += 1
            if self.priming:
                self.priming = False
                self.shared.primed_one()
            else:
                self.shared.in_flight -= 1
        self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()


class Conn(asyncio.Protocol):
    """One keep-alive connection with one request in flight at a time, awaited: for a
    client that decides each request as it goes (the soak's mixed workload)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    async def request(self, payload: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        """(status, lower-cased head, body); raises ConnectionError or TimeoutError."""
        if self.closed or self.transport is None:
            raise ConnectionError("connection closed")
        waiter: asyncio.Future[tuple[int, bytes, bytes]] = self.loop.create_future()
        self.waiter = waiter
        timer = self.loop.call_later(timeout, self._timeout)
        self.transport.write(payload)
        try:
            return await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _timeout(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(TimeoutError())
        self.close()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        try:
            parsed = parse_response(self.buf)
        except (ProtocolError, ValueError) as exc:
            self.waiter.set_exception(ConnectionError(f"protocol error: {exc}"))
            self.close()
            return
        if parsed is not None:
            status, head, consumed = parsed
            body = body_of(bytes(self.buf[:consumed]), head)
            del self.buf[:consumed]
            self.waiter.set_result((status, head, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def connect(host: str, port: int) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(Conn, host, port)
    return conn


def _target(url: str, path: str, bodies: list[bytes] | None) -> tuple[str, int, list[bytes]]:
    """The host, port and ready request bytes both load shapes send."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    return host, port, _requests(host, port, path, bodies or make_bodies())


async def run_paced(
    url: str,
    *,
    rate: float,
    concurrency: int,
    requests: int,
    max_seconds: float = 60.0,
    path: str = "/v1/completions",
    bodies: list[bytes] | None = None,
    check: Check | None = None,
) -> LoadResult:
    """Offer ``rate`` req/s in total over ``concurrency`` connections, ``requests`` in all."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    host, port, payloads = _target(url, path, bodies)
    loop = asyncio.get_running_loop()
    shared = _PacedShared(rate, concurrency, time.perf_counter() + max_seconds, payloads)
    shared.check = check
    conns: list[_PacedConn] = []
    for i in range(concurrency):
        count = len(range(i, requests, concurrency))
        factory = functools.partial(_PacedConn, shared, i, count)
        _, proto = await loop.create_connection(factory, host, port)
        conns.append(proto)
    # Priming: one untimed request per connection, then a short pause before the schedule.
    shared.priming = len(conns)
    for conn in conns:
        conn.prime()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(shared.primed), timeout=min(10.0, max_seconds))
    await asyncio.sleep(0.05)
    shared.live = sum(1 for c in conns if not c.finished)
    shared.start = time.perf_counter() + 0.005
    for conn in conns:
        if not conn.finished and not conn.busy:
            conn.schedule_next()
        elif not conn.finished:  # priming never answered: give up on this connection
            conn._finish()
    if shared.live <= 0 and not shared.done.done():
        shared.done.set_result(None)
    try:
        await asyncio.wait_for(asyncio.shield(shared.done), timeout=max_seconds + 10.0)
    except TimeoutError:
        shared.result.timed_out = True
    shared.result.elapsed_s = time.perf_counter() - shared.start
    for conn in conns:
        if conn.timer is not None:
            conn.timer.cancel()
        if conn.transport is not None:
            conn.transport.close()
    return shared.result


async def run_load(
    url: str,
    *,
    concurrency: int,
    requests: int,
    max_seconds: float = 60.0,
    path: str = "/v1/completions",
    bodies: list[bytes] | None = None,
    check: Check | None = None,
) -> LoadResult:
    """Drive ``requests`` requests over ``concurrency`` keep-alive connections."""
    host, port, payloads = _target(url, path, bodies)
    loop = asyncio.get_running_loop()
    shared = _Shared(requests, time.perf_counter() + max_seconds, payloads)
    shared.check = check
    conns: list[_Conn] = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(lambda: _Conn(shared, True), host, port)
        conns.append(proto)
    start = time.perf_counter()
    for conn in conns:
        conn.fire()
    if shared.outstanding == 0 and not shared.done.done():
        shared.done.set_result(None)
    try:
        await asyncio.wait_for(asyncio.shield(shared.done), timeout=max_seconds + 10.0)
    except TimeoutError:
        shared.result.timed_out = True
    shared.result.elapsed_s = time.perf_counter() - start
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    return shared.result


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def summarize(result: LoadResult) -> dict[str, object]:
    lat = sorted(result.latencies_s)
    ok = result.statuses.get(200, 0)
    done = sum(result.statuses.values())
    errors = done - ok + result.transport_errors
    ms = 1000.0
    out: dict[str, object] = {
        "requests": done + result.transport_errors,
        "ok": ok,
        "errors": errors,
        "statuses": {str(k): v for k, v in sorted(result.statuses.items())},
        "transport_errors": result.transport_errors,
        "timed_out": result.timed_out,
        "elapsed_s": round(result.elapsed_s, 4),
        "rps": round(done / result.elapsed_s, 1) if result.elapsed_s > 0 else 0.0,
        "p50_ms": round(_pct(lat, 50) * ms, 4),
        "p90_ms": round(_pct(lat, 90) * ms, 4),
        "p99_ms": round(_pct(lat, 99) * ms, 4),
        "max_ms": round(lat[-1] * ms, 4) if lat else float("nan"),
        "mean_ms": round(sum(lat) / len(lat) * ms, 4) if lat else float("nan"),
    }
    if result.paced:
        svc = sorted(result.service_s)
        lag = sorted(result.send_lag_s)
        sent = len(lat)
        out.update(
            paced=True,
            offered_rps=round(result.offered_rps, 1),
            achieved_ratio=round(done / result.elapsed_s / result.offered_rps, 3)
            if result.elapsed_s > 0 and result.offered_rps > 0
            else 0.0,
            late_sends=result.late_sends,
            late_fraction=round(result.late_sends / sent, 4) if sent else 0.0,
            max_late_ms=round(result.max_late_s * ms, 3),
            unsent=result.unsent,
            primed=result.primed,
            max_in_flight=result.max_in_flight,
            # Little's law: time-averaged number of requests in flight.
            mean_in_flight=round(sum(svc) / result.elapsed_s, 3) if result.elapsed_s > 0 else 0,
            service_p50_ms=round(_pct(svc, 50) * ms, 4),
            service_p99_ms=round(_pct(svc, 99) * ms, 4),
            send_lag_p50_ms=round(_pct(lag, 50) * ms, 4),
            send_lag_p99_ms=round(_pct(lag, 99) * ms, 4),
        )
    return out


async def _measure(args: argparse.Namespace) -> dict[str, object]:
    bodies = make_bodies(seed=args.seed, stream=args.stream)
    check = check_stream if args.stream else None
    load = functools.partial(
        run_load, args.url, concurrency=args.concurrency, path=args.path, bodies=bodies, check=check
    )
    warmed = 0
    if args.start_at:  # closed loop, untimed, until just before the common start
        if (warm := args.start_at - time.time()) > 0.1:
            res = await load(requests=1 << 40, max_seconds=warm - 0.05)
            warmed = len(res.latencies_s)
            if res.transport_errors or sum(res.statuses.values()) != res.statuses.get(200, 0):
                warmed = -1  # reported; the measured run counts its own errors
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
    elif args.warmup:
        await load(requests=args.warmup, max_seconds=args.max_seconds)
    started, t0, own0 = time.time(), time.perf_counter(), time.process_time()
    front0 = cpu.tree_ns(args.cpu_pid) if args.cpu_pid else {}
    split0 = cpu.stat(args.cpu_pid) if args.cpu_pid else None
    if args.announce:
        print("started", file=sys.stderr, flush=True)
    if args.rate:
        result = await run_paced(
            args.url,
            rate=args.rate,
            concurrency=args.concurrency,
            requests=args.requests,
            max_seconds=args.max_seconds,
            path=args.path,
            bodies=bodies,
            check=check,
        )
    else:
        result = await load(requests=args.requests, max_seconds=args.max_seconds)
    wall, own = time.perf_counter() - t0, time.process_time() - own0
    out = summarize(result)
    done = len(result.latencies_s) + result.transport_errors
    # The client's own cost: it shares its CPU with the upstreams (the harness's headroom).
    out["client_cpu_us_per_req"] = round(own * 1e6 / max(1, done), 1)
    out["client_busy"] = round(own / result.elapsed_s, 3) if result.elapsed_s > 0 else 0.0
    out.update(
        started_at=started,
        warmup_requests=warmed,
        url=args.url,
        rate=args.rate,
        stream=args.stream,
        concurrency=args.concurrency,
    )
    if args.lat_out:
        import array

        with args.lat_out.open("wb") as f:
            array.array("d", result.latencies_s).tofile(f)
    if args.cpu_pid:
        front1 = cpu.tree_ns(args.cpu_pid)
        used = sum(front1[p] - front0[p] for p in front1.keys() & front0.keys())
        served = max(1, done + result.primed)
        # Window = the whole run incl. connect + priming (~0.1 s): util reads slightly low.
        out["front_cpu_util"] = round(used / 1e9 / wall, 3)
        out["front_cpu_us_per_req"] = round(used / 1000 / served, 1)
        # Where it went: user space (the front's own code) or the kernel (syscalls,
        # loopback TCP). Clock ticks (10 ms): meaningful over whole runs only.
        split1 = cpu.stat(args.cpu_pid)
        if split0 and split1:
            out["front_user_us_per_req"] = round((split1[1] - split0[1]) * 1e6 / served, 1)
            out["front_sys_us_per_req"] = round((split1[2] - split0[2]) * 1e6 / served, 1)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--concurrency", type=int, default=64, help="connections")
    parser.add_argument("--requests", type=int, default=1 << 40, help="measured requests")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="measured run's limit")
    parser.add_argument("--rate", type=float, default=0.0, help="paced: total req/s; 0: closed")
    parser.add_argument("--stream", action="store_true", help='"stream": true, checked SSE')
    parser.add_argument("--warmup", type=int, default=0, help="closed-loop requests first")
    parser.add_argument(
        "--start-at",
        type=float,
        default=0.0,
        help="time.time() to start measuring at; closed-loop warm-up until then",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-pid", type=int, default=0, help="report this tree's CPU use")
    parser.add_argument("--lat-out", type=Path, help="write the latencies here (float64 s)")
    parser.add_argument("--announce", action="store_true", help="print 'started' to stderr")
    return parser


def client_argv(url: str, **opts: object) -> list[str]:
    """``python -m bench.lib.load --url URL`` with ``opts`` as flags (``cpu_pid=7`` ->
    ``--cpu-pid 7``; True -> a bare flag; False/None/0 -> left out)."""
    argv = [PY, "-m", "bench.lib.load", "--url", url]
    for key, value in opts.items():
        if value is None or value is False or (value == 0 and key != "seed"):
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def spawn_client(url: str, cpus: set[int] | None, **opts: object) -> subprocess.Popen[bytes]:
    """The client in a child process pinned to ``cpus`` (``collect`` reads its result)."""
    return subprocess.Popen(
        client_argv(url, **opts),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=pin(cpus),
    )


def collect(child: subprocess.Popen[bytes], timeout: float) -> dict[str, object]:
    """The JSON result of a ``spawn_client`` child; kills it and raises if it fails."""
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate(timeout=10)
        raise RuntimeError(f"load client {child.pid} timed out after {timeout:g} s") from None
    try:
        result: dict[str, object] = json.loads(stdout.decode().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"load client failed: {stderr.decode()[-2000:]}") from exc
    return result


def run_client(url: str, cpus: set[int] | None, **opts: object) -> dict[str, Any]:
    """``spawn_client`` + ``collect``, bounded by twice the run's ``max_seconds`` + 30 s."""
    limit = 2 * float(opts.get("max_seconds", 60.0)) + 30  # type: ignore[arg-type]
    return collect(spawn_client(url, cpus, **opts), limit)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = uvloop.run(_measure(args))
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
