"""``rollout_testbed.sim.fleet_host``: K simulated replicas in one process.

What the control-plane benchmark rests on: each port is its own replica (state never
leaks between ports), ``/fleet/hold`` keeps a call in flight on the host and
``/fleet/state`` shows that it arrived, and one signal to the process takes all K away
together, while a restart on the same argv brings K fresh replicas back on the same ports.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from rollout_testbed.procs import LOCAL, Proc, free_ports, http_status
from rollout_testbed.sim.fleet_host import FleetHost, build_parser, format_ports, parse_ports

from tests.eventually import eventually, eventually_sync

LOAD = {"lora_name": "trl-policy-v1", "lora_path": "/adapters/trl-policy-v1"}


def test_ports_parse_and_format_round_trip() -> None:
    assert parse_ports("9100-9103,9200") == [9100, 9101, 9102, 9103, 9200]
    assert parse_ports(" 7 , 9-9 ") == [7, 9]
    for ports in ([9100, 9101, 9102, 9200], [5], [1, 3, 4, 5, 8]):
        assert parse_ports(format_ports(ports)) == ports
    assert format_ports([9100, 9101, 9102, 9200]) == "9100-9102,9200"
    for bad in ("", "9-7", "0", "70000", "5,5", "a"):
        with pytest.raises(ValueError):
            parse_ports(bad)


def test_flags() -> None:
    args = build_parser().parse_args(["--ports", "10-11", "--max-loras", "8"])
    assert (args.ports, args.max_loras, args.host) == ([10, 11], 8, LOCAL)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ports", "9-7"])


def _client(host: FleetHost, port: int) -> httpx.AsyncClient:
    """In process: httpx's ASGI transport puts the URL's port in ``scope["server"]``."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=host),
                             base_url=f"http://{LOCAL}:{port}")  # fmt: skip


async def test_each_port_is_its_own_replica() -> None:
    host = FleetHost([9001, 9002])
    async with _client(host, 9001) as a, _client(host, 9002) as b:
        assert (await a.post("/v1/load_lora_adapter", json=LOAD)).status_code == 200
        assert (await b.post("/pause", params={"mode": "keep"})).status_code == 200
        models_a = (await a.get("/v1/models")).json()["data"]
        models_b = (await b.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models_a][-1] == "trl-policy-v1"
        assert "trl-policy-v1" not in [m["id"] for m in models_b]
        state = (await a.get("/fleet/state")).json()
    assert state["replicas"] == {
        "9001": {"adapters": ["trl-policy-v1"], "paused": False},
        "9002": {"adapters": [], "paused": True},
    }
    assert state["received"]["/v1/load_lora_adapter"] == 1
    async with _client(host, 9003) as other:  # no replica on that port
        assert (await other.get("/health")).status_code == 404


async def test_a_hold_keeps_the_call_in_flight_and_counts_its_arrival() -> None:
    host = FleetHost([9001, 9002])
    async with _client(host, 9001) as a, _client(host, 9002) as b:
        r = await a.post("/fleet/hold", json={"path": "/pause", "seconds": 0.5})
        assert r.status_code == 200 and r.json() == {"holds": {"/pause": 0.5}}
        calls = [asyncio.ensure_future(c.post("/pause", params={"mode": "keep"})) for c in (a, b)]

        async def arrived() -> bool:
            return bool((await a.get("/fleet/state")).json()["received"].get("/pause") == 2)

        await eventually(arrived, "both pauses to reach the host")
        assert not any(host.sim(p).paused for p in (9001, 9002))  # held: not applied yet
        assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
        assert all(host.sim(p).paused for p in (9001, 9002))
        await a.post("/fleet/hold", json={"path": "/pause", "seconds": 0})
        assert (await a.get("/fleet/state")).json()["holds"] == {}
        for bad in ({"path": "/fleet/state", "seconds": 1}, {"path": "/pause", "seconds": -1},
                    {"path": "/pause", "seconds": 1e9}, {"path": "/pause"}):  # fmt: skip
            assert (await a.post("/fleet/hold", json=bad)).status_code == 400, bad
        assert (await a.delete("/fleet/state")).status_code == 404


def test_one_process_serves_every_port_and_vanishes_with_them(tmp_path: Path) -> None:
    ports = free_ports(3)
    argv = [sys.executable, "-m", "rollout_testbed.sim.fleet_host", "--ports", format_ports(ports)]
    urls = [f"http://{LOCAL}:{p}" for p in ports]
    with Proc("fleet-host", argv, tmp_path / "host.log", url=urls[0]) as proc:
        proc.wait_http("/health", timeout=60)
        eventually_sync(lambda: all(http_status(u + "/health") == 200 for u in urls),
                        "every port to answer")  # fmt: skip
        with httpx.Client(base_url=urls[1], trust_env=False, timeout=10) as c:
            assert c.post("/v1/load_lora_adapter", json=LOAD).status_code == 200
        proc.freeze()  # SIGSTOP
        assert all(http_status(u + "/health", timeout=0.5) is None for u in urls)
        proc.thaw()
        assert all(http_status(u + "/health") == 200 for u in urls)
        proc.kill()
        assert all(http_status(u + "/health", timeout=0.5) is None for u in urls)
        proc.start()  # the same argv: the same ports, fresh replicas
        proc.wait_http("/health", timeout=60)
        eventually_sync(lambda: all(http_status(u + "/health") == 200 for u in urls),
                        "every port to answer after the restart")  # fmt: skip
        with httpx.Client(base_url=urls[1], trust_env=False, timeout=10) as c:
            state = c.get("/fleet/state").json()
        assert state["replicas"][str(ports[1])]["adapters"] == []
