"""``python -m rollout_testbed.sim.fleet_host``: K simulated replicas in one process, one
event loop, K ports.

Why: a 256-replica control-plane benchmark on a 2-core machine cannot afford 256 Python
processes (each ~40 MB and ~1 s to start), and "a quarter of the fleet vanishes" should be
one signal: SIGSTOP or SIGKILL of the one process that serves that quarter. Each port
still serves its own ``create_sim_app`` (its own adapters, pause state, faults, stats), so
to a gateway they are K independent replicas; they only share a CPU.

One uvicorn server listens on all K sockets; ``FleetHost`` picks the replica by the local
port of the connection (ASGI ``scope["server"]``).

Host-level control, answered on every port (the replicas' own ``/sim/...`` paths stay per
replica), so a benchmark can make a call stay in flight on exactly this host and see that
it arrived before it makes the host vanish:

  GET  /fleet/state   {"replicas": {"PORT": {"adapters": [...], "paused": bool}},
                       "received": {"/path": n}, "holds": {"/path": seconds}}
  POST /fleet/hold    {"path": "/pause", "seconds": 5}: requests to that path wait this
                      long before their replica sees them (0 clears); resets the path's
                      ``received`` count, which counts requests that reached this host

    python -m rollout_testbed.sim.fleet_host --ports 9100-9163 --max-loras 8

(Not a ``rollout-testbed`` subcommand: it is a benchmark's tool, not a user's.)
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from gateway.http.server.serving import listen_socket
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.server import VLLM_IDLE_S, add_config_args, config_from_args
from rollout_testbed.sim.state import SimState

__all__ = ["MAX_HOLD_S", "FleetHost", "build_parser", "format_ports", "main", "parse_ports"]

MAX_HOLD_S = 600.0
"""The longest hold accepted: a forgotten hold must not keep a call open forever."""


def parse_ports(spec: str) -> list[int]:
    """``"9100-9103,9200"`` -> ``[9100, 9101, 9102, 9103, 9200]``; order kept, no repeats."""
    ports: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        lo, hi = int(first), int(last) if sep else int(first)
        if not 0 < lo <= hi <= 65535:
            raise ValueError(f"bad port range {part!r}")
        ports += range(lo, hi + 1)
    if not ports:
        raise ValueError("no ports given")
    if len(set(ports)) != len(ports):
        raise ValueError("a port is listed twice")
    return ports


def format_ports(ports: Sequence[int]) -> str:
    """The inverse of ``parse_ports``: consecutive runs as ranges (keeps argv short)."""
    parts: list[str] = []
    i = 0
    while i < len(ports):
        j = i
        while j + 1 < len(ports) and ports[j + 1] == ports[j] + 1:
            j += 1
        parts.append(str(ports[i]) if i == j else f"{ports[i]}-{ports[j]}")
        i = j + 1
    return ",".join(parts)


async def _answer(send: Send, status: int, body: Any) -> None:
    data = orjson.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # a disconnect: nothing more will come
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class FleetHost:
    """The ASGI app of one host: ``/fleet/...`` itself, anything else to the port's sim."""

    def __init__(self, ports: Sequence[int], config: SimConfig | None = None) -> None:
        self.apps: dict[int, FastAPI] = {p: create_sim_app(config) for p in ports}
        self.holds: dict[str, float] = {}
        self.received: Counter[str] = Counter()

    def sim(self, port: int) -> SimState:
        state: SimState = self.apps[port].state.sim
        return state

    def state(self) -> dict[str, Any]:
        replicas: dict[str, dict[str, Any]] = {}
        for port in self.apps:
            sim = self.sim(port)
            replicas[str(port)] = {"adapters": sorted(sim.adapters), "paused": sim.paused}
        return {"replicas": replicas, "received": dict(self.received), "holds": dict(self.holds)}

    def hold(self, path: str, seconds: float) -> None:
        if not path.startswith("/") or path.startswith("/fleet/"):
            raise ValueError(f"cannot hold {path!r}")
        if not 0 <= seconds <= MAX_HOLD_S:
            raise ValueError(f"seconds must be within 0..{MAX_HOLD_S:g}")
        if seconds:
            self.holds[path] = seconds
        else:
            self.holds.pop(path, None)
        self.received.pop(path, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path.startswith("/fleet/"):
            await self._control(scope, receive, send)
            return
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:
            await _answer(send, 404, {"error": "no replica on this port"})
            return
        self.received[path] += 1
        held = self.holds.get(path, 0.0)
        if held:
            await asyncio.sleep(held)
        await app(scope, receive, send)

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/fleet/state" and method == "GET":
            await _answer(send, 200, self.state())
        elif path == "/fleet/hold" and method == "POST":
            try:
                body = orjson.loads(await _read_body(receive))
                self.hold(str(body["path"]), float(body["seconds"]))
            except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
                await _answer(send, 400, {"error": str(exc)})
                return
            await _answer(send, 200, {"holds": self.holds})
        else:
            await _answer(send, 404, {"error": f"no {method} {path}"})


def _ports(spec: str) -> list[int]:
    try:
        return parse_ports(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollout_testbed.sim.fleet_host",
        description="K simulated vLLM replicas in one process, one port each.",
    )
    p.add_argument("--ports", type=_ports, required=True, help="e.g. 9100-9163,9200")
    p.add_argument("--host", default="127.0.0.1")
    add_config_args(p)  # every replica's options, as one sim-replica's
    p.add_argument(
        "--keep-alive-s",
        type=float,
        default=float(VLLM_IDLE_S),
        help=f"idle keep-alive connections are closed after this long (vLLM's default: "
        f"{VLLM_IDLE_S})",
    )
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (without the subcommand name), then serve every port until stopped."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    ports: list[int] = args.ports
    server = uvicorn.Server(
        uvicorn.Config(
            FleetHost(ports, config),
            loop="uvloop",
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            log_level=args.log_level,
            timeout_keep_alive=args.keep_alive_s,
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[listen_socket(args.host, port) for port in ports])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
