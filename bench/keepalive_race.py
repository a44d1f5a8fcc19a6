"""Why the gateway keeps an idle client connection longer than the clients' pools do
(``CLIENT_IDLE_S``, ``docs/operations.md``, "Limits"): a request sent on a pooled connection
just as the server closes it for idleness is lost ("server disconnected", a reset) with no
answer, and only the side that closes first can avoid the race.

One gateway (the real app and its lean server, in-process) on one simulated replica, its
idle timeout scaled down to ``--idle-s``. An httpx client sends a rollout, waits until just
before the server's idle close (``--idle-s`` minus 0-8 ms), and sends another on the same
pooled connection, ``--rounds`` times, for two pool settings side by side:

- ``expiry = idle``: the pool keeps a connection as long as the server does (httpx's 5 s
  against uvicorn's default 5 s);
- ``expiry < idle``: the pool gives the connection up first (httpx's 5 s against the
  gateway's 75 s).

    .venv/bin/python bench/keepalive_race.py   # writes bench/results/keepalive-race.{json,md}

Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.testing import running_sim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.lib
from bench.lib import report
from gateway.app import create_app
from gateway.config import load_settings

BODY = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}


async def trial(url: str, idle_s: int, expiry: float, rounds: int) -> dict[str, Any]:
    """``rounds`` pairs of rollouts, the second sent right at the server's idle close."""
    lost: dict[str, int] = {}
    started = time.monotonic()
    limits = httpx.Limits(keepalive_expiry=expiry)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as client:
        for i in range(rounds):
            for wait in (0.0, idle_s - 0.008 + (i % 9) * 0.001):
                await asyncio.sleep(wait)
                try:
                    (await client.post("/v1/completions", json=BODY)).raise_for_status()
                except httpx.TransportError as exc:
                    lost[type(exc).__name__] = lost.get(type(exc).__name__, 0) + 1
    return {"expiry_s": expiry, "sent": 2 * rounds, "lost": sum(lost.values()),
            "lost_by_error": lost, "seconds": round(time.monotonic() - started, 1)}  # fmt: skip


async def measure(idle_s: int, rounds: int) -> list[dict[str, Any]]:
    async with running_sim() as sim:
        app = create_app(load_settings({"replicas": [sim]}, environ={}))
        async with serve_asgi(app, idle_s=idle_s) as url:
            return [await trial(url, idle_s, expiry, rounds) for expiry in (idle_s, idle_s / 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=int, default=1, help="the server's idle timeout")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--out", type=Path, default=report.RESULTS)
    args = ap.parse_args()
    rows = asyncio.run(measure(args.idle_s, args.rounds))
    data = {"machine": report.machine_info(("httpx", "uvicorn")), "idle_s": args.idle_s,
            "rounds": args.rounds, "trials": rows}  # fmt: skip
    lines = [
        f"Server idle timeout {args.idle_s} s; {args.rounds} rounds, each a rollout, then "
        "another on the same pooled connection just before the server's idle close "
        "(`bench/keepalive_race.py`).",
        "",
        "| client pool keeps an idle connection | requests | lost | how |",
        "|---|---|---|---|",
    ]
    for row, name in zip(rows, ("as long as the server (expiry = idle)",
                                "half as long (expiry < idle)"), strict=True):  # fmt: skip
        how = ", ".join(f"{k} {v}" for k, v in sorted(row["lost_by_error"].items())) or "-"
        lines.append(f"| {name} | {row['sent']} | {row['lost']} | {how} |")
    for path in report.write(args.out, "keepalive-race", data, "\n".join(lines)):
        print(path)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
