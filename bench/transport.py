"""Upstream client cost per request, side by side in one run: which HTTP client should the
gateway's data path use? (Issue: "choose the transport by measurement".)

Drives 64 concurrent keep-alive POSTs of a ~1 KB completion body at an instant upstream
(``bench/instant_upstream.py``) through each client and reports the client process's CPU
time per request (``time.process_time``: robust on a noisy 2-core machine, unlike wall
time) and requests/s. Rounds are interleaved; medians are reported.

    python bench/transport.py [--requests 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import uvloop
from httpx_aiohttp import AiohttpTransport

HERE = Path(__file__).parent
BODY = json.dumps({"model": "tiny-base", "prompt": list(range(200)), "max_tokens": 16}).encode()
HEADERS = {"content-type": "application/json"}

Sender = Callable[[], Awaitable[int]]


async def _run(send: Sender, requests: int, concurrency: int) -> tuple[float, float]:
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            assert await send() == 200

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / requests * 1e6, requests / wall


async def measure(url: str, requests: int, rounds: int) -> dict[str, dict[str, float]]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    default = httpx.AsyncClient(limits=limits)
    over_aiohttp = httpx.AsyncClient(transport=AiohttpTransport(limits=limits))
    transport = AiohttpTransport(limits=limits)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
    target = httpx.URL(url)

    async def httpx_default() -> int:
        r = await default.post(url, content=BODY, headers=HEADERS)
        return r.status_code

    async def httpx_over_aiohttp() -> int:
        r = await over_aiohttp.post(url, content=BODY, headers=HEADERS)
        return r.status_code

    async def httpx_transport_direct() -> int:
        r = await transport.handle_async_request(
            httpx.Request("POST", target, content=BODY, headers=HEADERS)
        )
        await r.aread()
        await r.aclose()
        return r.status_code

    async def aiohttp_direct() -> int:
        async with session.post(url, data=BODY, headers=HEADERS) as r:
            await r.read()
            return r.status

    clients: dict[str, Sender] = {
        "httpx (default transport)": httpx_default,
        "httpx.AsyncClient + httpx-aiohttp": httpx_over_aiohttp,
        "httpx-aiohttp transport, no AsyncClient": httpx_transport_direct,
        "aiohttp ClientSession": aiohttp_direct,
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    for send in clients.values():  # warm-up: connections, code paths
        await _run(send, 500, 64)
    for _ in range(rounds):
        for name, send in clients.items():
            samples[name].append(await _run(send, requests, 64))
    await default.aclose()
    await over_aiohttp.aclose()
    await transport.aclose()
    await session.close()
    return {
        name: {
            "cpu_us_per_request": statistics.median(s[0] for s in runs),
            "requests_per_s": statistics.median(s[1] for s in runs),
        }
        for name, runs in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=9181)
    args = parser.parse_args()
    upstream = subprocess.Popen(
        [sys.executable, str(HERE / "instant_upstream.py"), "--port", str(args.port)]
    )
    try:
        time.sleep(1.5)
        url = f"http://127.0.0.1:{args.port}/v1/completions"
        results = uvloop.run(measure(url, args.requests, args.rounds))
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    base = results["aiohttp ClientSession"]["cpu_us_per_request"]
    lines = [
        "| client | CPU µs/request | req/s (64 in flight) | CPU vs aiohttp |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['cpu_us_per_request']:.0f} | {r['requests_per_s']:.0f} | "
            f"{r['cpu_us_per_request'] / base:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "transport.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "transport.md").write_text(
        "# Upstream client cost (bench/transport.py)\n\n" + table + "\n"
    )


if __name__ == "__main__":
    main()
