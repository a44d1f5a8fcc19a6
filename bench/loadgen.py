"""A raw keep-alive HTTP/1.1 load client on asyncio + uvloop (no httpx/aiohttp in the client).

C connections, each with exactly one request in flight, POST a ~1 KB TRL-shaped completion
body (``{"model", "prompt": [~200 token ids], "max_tokens": 16, "n": 1, "return_token_ids":
true, "logprobs": 0, "seed"}``) to ``/v1/completions`` until N responses have arrived (or a
time limit passes). Responses are parsed properly (status line, ``Content-Length`` and
``Transfer-Encoding: chunked``); any non-200 counts as an error.

    python bench/loadgen.py --url http://127.0.0.1:8000 --mode latency --requests 1000
    python bench/loadgen.py --url http://127.0.0.1:8000 --mode throughput --requests 5000

Modes: ``latency`` = 1 in flight; ``throughput`` = ``--concurrency`` (default 64) in flight.
Prints one JSON object: requests, errors, status counts, elapsed, req/s, latency percentiles
(ms). ``run_load`` is importable for in-process use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import uvloop

__all__ = ["LoadResult", "make_bodies", "run_load", "summarize"]


def make_bodies(count: int = 64, prompt_tokens: int = 200, seed: int = 0) -> list[bytes]:
    """Distinct TRL-shaped completion bodies (~1 KB each): 8-request groups share a prompt."""
    rng = random.Random(seed)
    bodies = []
    prompt: list[int] = []
    for i in range(count):
        if i % 8 == 0:
            prompt = [rng.randrange(100, 32000) for _ in range(prompt_tokens)]
        body = {
            "model": "tiny-base",
            "prompt": prompt,
            "max_tokens": 16,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": rng.randrange(1 << 30),
        }
        bodies.append(json.dumps(body, separators=(",", ":")).encode())
    return bodies


def _requests(host: str, port: int, path: str, bodies: list[bytes]) -> list[bytes]:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Accept: application/json\r\nUser-Agent: loadgen\r\nContent-Length: "
    ).encode()
    return [head + str(len(b)).encode() + b"\r\n\r\n" + b for b in bodies]


class _ParseError(Exception):
    pass


def _parse_response(buf: bytearray) -> tuple[int, int] | None:
    """(status, total bytes consumed) when ``buf`` holds one complete response, else None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    try:
        status = int(head[9:12])
    except ValueError as exc:
        raise _ParseError(f"bad status line: {head[:40]!r}") from exc
    body_start = end + 4
    if b"transfer-encoding:" in head and b"chunked" in head:
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
                return status, line_end + 4
            pos = line_end + 2 + size + 2
            if len(buf) < pos:
                return None
    marker = head.find(b"content-length:")
    length = 0
    if marker >= 0:
        line_end = head.find(b"\r\n", marker)
        length = int(head[marker + 15 : line_end if line_end > 0 else None])
    elif status not in (204, 304) and not (100 <= status < 200):
        raise _ParseError("response without Content-Length or chunked framing")
    total = body_start + length
    if len(buf) < total:
        return None
    return status, total


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    elapsed_s: float = 0.0
    timed_out: bool = False


class _Shared:
    def __init__(self, requests: int, deadline: float, payloads: list[bytes]) -> None:
        self.remaining = requests  # requests not yet started
        self.outstanding = 0
        self.deadline = deadline
        self.payloads = payloads
        self.next_payload = 0
        self.result = LoadResult()
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


class _Conn(asyncio.Protocol):
    """One keep-alive connection; sends the next request from the response callback."""

    def __init__(self, shared: _Shared, record: bool) -> None:
        self.shared = shared
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

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            return
        try:
            parsed = _parse_response(self.buf)
        except (_ParseError, ValueError):
            self._fail()
            return
        if parsed is None:
            return
        now = time.perf_counter()
        status, consumed = parsed
        del self.buf[:consumed]
        self.busy = False
        result = self.shared.result
        result.statuses[status] += 1
        if self.record:
            result.latencies_s.append(now - self.sent_at)
        self.shared.finished_one()
        self.fire()

    def _fail(self) -> None:
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


async def run_load(
    url: str,
    *,
    concurrency: int,
    requests: int,
    max_seconds: float = 60.0,
    path: str = "/v1/completions",
    bodies: list[bytes] | None = None,
) -> LoadResult:
    """Drive ``requests`` requests over ``concurrency`` keep-alive connections."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payloads = _requests(host, port, path, bodies or make_bodies())
    loop = asyncio.get_running_loop()
    shared = _Shared(requests, time.perf_counter() + max_seconds, payloads)
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
    return {
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


async def _main_async(args: argparse.Namespace) -> dict[str, object]:
    concurrency = 1 if args.mode == "latency" else args.concurrency
    bodies = make_bodies(seed=args.seed)
    if args.warmup:
        await run_load(
            args.url,
            concurrency=concurrency,
            requests=args.warmup,
            max_seconds=args.max_seconds,
            path=args.path,
            bodies=bodies,
        )
    result = await run_load(
        args.url,
        concurrency=concurrency,
        requests=args.requests,
        max_seconds=args.max_seconds,
        path=args.path,
        bodies=bodies,
    )
    out = summarize(result)
    out.update(mode=args.mode, concurrency=concurrency, url=args.url)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--mode", choices=("latency", "throughput"), default="throughput")
    parser.add_argument("--concurrency", type=int, default=64, help="in flight (throughput)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=0, help="untimed requests first")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="time limit per run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = uvloop.run(_main_async(args))
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
