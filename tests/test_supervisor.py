"""``serve --workers 2`` as users run it: real processes, sim replicas, 127.0.0.1 only.

One port, two workers and an owner: both workers serve, ``/metrics`` and
``/gateway/status`` speak for the whole gateway, a load's 200 means every worker routes
the new version, a killed worker is restarted while the other keeps its connections, a
killed owner is restarted while the workers keep serving, and SIGTERM drains them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from rollout_testbed.procs import SimFleet, sim_fleet

from tests.eventually import eventually
from tests.faults.procs import metric

CONNECTIONS = 16  # spread over 2 workers by SO_REUSEPORT: all on one is 2^-15 likely
COMPLETION = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}


@contextlib.contextmanager
def workers_fleet(tmp_path: Path, *args: str, sim_args: tuple[str, ...] = ()) -> Iterator[SimFleet]:
    with sim_fleet(2, tmp_path, gateway_args=["--workers", "2", *args], sim_args=sim_args) as f:
        yield f


class Conn:
    """One keep-alive HTTP/1.1 connection, written and read by hand (so a test knows
    which requests shared it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Conn:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        pairs = (line.partition(":") for line in lines[1:] if line)
        headers = {k.lower(): v.strip() for k, _, v in pairs}
        content = await self.reader.readexactly(int(headers["content-length"]))
        return status, headers, content

    def close(self) -> None:
        self.writer.close()


async def _status(f: SimFleet) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f.url, timeout=10) as client:
        r = await client.get("/gateway/status")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data


async def _load(client: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


async def _running(f: SimFleet, n: int) -> bool:
    """Whether ``n`` requests are generating: read by the gateway, so SIGTERM drains them."""
    async with httpx.AsyncClient(timeout=10) as client:
        stats = [(await client.get(f"{sim.url}/sim/stats")).json() for sim in f.sims]
    return sum(int(s["running"]) for s in stats) >= n


async def _exited(f: SimFleet) -> bool:
    return not f.gateway.alive


async def _until(check: Any, what: str) -> Any:
    """``eventually``, where a check may meet a process mid-restart (refused, a 503)."""
    return await eventually(
        check, what, interval=0.1, ignore=(httpx.HTTPError, AssertionError, OSError)
    )


async def test_two_workers_serve_one_port_and_report_as_one_gateway(tmp_path: Path) -> None:
    with workers_fleet(tmp_path) as f:
        conns = [await Conn.open(f.url) for _ in range(CONNECTIONS)]
        body = httpx.Request("POST", "/", json=COMPLETION).content
        for _ in range(3):
            answers = await asyncio.gather(*(c.post("/v1/completions", body) for c in conns))
            assert [s for s, _, _ in answers] == [200] * CONNECTIONS
        for c in conns:
            c.close()
        status = await _status(f)
        workers = status["workers"]
        assert [w["worker"] for w in workers] == [0, 1]
        assert len({w["pid"] for w in workers} | {status["owner_pid"]}) == 3
        assert all(w["routed"] > 0 for w in workers), workers  # the kernel used both
        assert sum(w["routed"] for w in workers) == 3 * CONNECTIONS
        assert sum(r["served"] for r in status["replicas"]) == 3 * CONNECTIONS
        async with httpx.AsyncClient(base_url=f.url, timeout=10) as client:
            text = (await client.get("/metrics")).text
        assert metric(text, "gateway_requests_total", route="routed",
                      status_class="2xx") == 3 * CONNECTIONS  # fmt: skip


async def test_a_loaded_version_is_routable_by_every_worker_once_answered(tmp_path: Path) -> None:
    with workers_fleet(tmp_path, "--max-staleness", "1") as f:
        conns = [await Conn.open(f.url) for _ in range(CONNECTIONS)]
        async with httpx.AsyncClient(base_url=f.url, timeout=30) as client:
            for v in range(1, 6):
                name = f"policy-v{v}"
                r = await _load(client, name, f"/adapters/{v}")
                assert r.status_code == 200, r.text
                # At once, from every connection (so from both workers): never a 404.
                body = httpx.Request("POST", "/", json={**COMPLETION, "model": name}).content
                answers = await asyncio.gather(*(c.post("/v1/completions", body) for c in conns))
                assert [s for s, _, _ in answers] == [200] * CONNECTIONS, (v, answers[:2])
            # max_staleness 1 keeps v4 and v5: v1 goes, on every worker. A rollout that
            # still names it is served by the oldest live version (docs/adapters.md,
            # "Retired versions"); a version no run published is vLLM's 404.
            gone = httpx.Request("POST", "/", json={**COMPLETION, "model": "policy-v1"}).content
            answers = await asyncio.gather(*(c.post("/v1/completions", gone) for c in conns))
            assert {s for s, _, _ in answers} == {200}
            assert {orjson.loads(b)["model"] for _, _, b in answers} == {"policy-v4"}
            never = httpx.Request("POST", "/", json={**COMPLETION, "model": "other-v1"}).content
            answers = await asyncio.gather(*(c.post("/v1/completions", never) for c in conns))
            assert {s for s, _, _ in answers} == {404}
            models = (await client.get("/v1/models")).json()
            assert {m["id"] for m in models["data"]} >= {"policy-v4", "policy-v5"}
            assert "policy-v1" not in {m["id"] for m in models["data"]}
        for c in conns:
            c.close()


async def test_a_killed_worker_is_restarted_and_the_other_keeps_its_connections(
    tmp_path: Path,
) -> None:
    with workers_fleet(tmp_path) as f:
        conns = [await Conn.open(f.url) for _ in range(CONNECTIONS)]
        body = httpx.Request("POST", "/", json=COMPLETION).content
        await asyncio.gather(*(c.post("/v1/completions", body) for c in conns))
        before = await _status(f)
        victim = before["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        outcomes = await asyncio.gather(*(c.post("/v1/completions", body) for c in conns),
                                        return_exceptions=True)  # fmt: skip
        kept = [o for o in outcomes if not isinstance(o, BaseException)]
        lost = [o for o in outcomes if isinstance(o, BaseException)]
        # The survivor's connections answer on the same socket; only the victim's broke.
        assert kept and lost, outcomes
        assert all(s == 200 for s, _, _ in kept)

        async def restarted() -> bool:
            pids = [w["pid"] for w in (await _status(f))["workers"]]
            return len(pids) == 2 and victim not in pids

        await _until(restarted, "worker 0 restarted")
        fresh = [await Conn.open(f.url) for _ in range(CONNECTIONS)]
        answers = await asyncio.gather(*(c.post("/v1/completions", body) for c in fresh))
        assert [s for s, _, _ in answers] == [200] * CONNECTIONS
        for c in conns + fresh:
            c.close()
        assert f.gateway.alive


async def test_a_killed_owner_is_restarted_while_the_workers_keep_serving(tmp_path: Path) -> None:
    with workers_fleet(tmp_path) as f:
        async with httpx.AsyncClient(base_url=f.url, timeout=30) as client:
            r = await _load(client, "p-v1", "/adapters/1")
            assert r.status_code == 200
            owner = (await _status(f))["owner_pid"]
            os.kill(owner, signal.SIGKILL)
            rollout = {**COMPLETION, "model": "p-v1"}
            control = []
            for _ in range(20):  # ~1 s while the owner restarts and rebuilds
                assert (await client.post("/v1/completions", json=rollout)).status_code == 200
                control.append((await _load(client, "p-v2", "/adapters/2")).status_code)
                await asyncio.sleep(0.05)
            assert set(control) <= {200, 503}, control

            async def new_owner() -> bool:
                status = await _status(f)
                return status["owner_pid"] != owner and len(status["workers"]) == 2

            await _until(new_owner, "the owner restarted and both workers rejoined")
            r = await _load(client, "p-v3", "/adapters/3")
            assert r.status_code == 200, r.text
            for model in ("p-v1", "p-v3"):  # adopted from the replicas, and the new one
                r = await client.post("/v1/completions", json={**COMPLETION, "model": model})
                assert r.status_code == 200, (model, r.text)
        assert f.gateway.alive


async def test_sigterm_drains_every_worker_and_exits_0(tmp_path: Path) -> None:
    with workers_fleet(tmp_path, "--shutdown-timeout-s", "10",
                       sim_args=("--latency-model", "decode=0.02")) as f:  # fmt: skip
        pids = [w["pid"] for w in (await _status(f))["workers"]]
        conns = [await Conn.open(f.url) for _ in range(8)]
        body = httpx.Request("POST", "/", json={**COMPLETION, "max_tokens": 40}).content  # ~0.8 s
        sent = [asyncio.ensure_future(c.post("/v1/completions", body)) for c in conns]
        await _until(lambda: _running(f, 8), "all 8 generating on the replicas")
        f.gateway.signal(signal.SIGTERM)
        answers = await asyncio.gather(*sent)
        assert [s for s, _, _ in answers] == [200] * 8  # finished, not cut
        await _until(lambda: _exited(f), "the supervisor to exit")
        assert f.gateway.returncode == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for c in conns:
            c.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--workers", "0"], "workers must be 1..256"),
        (["--workers", "many"], "expected a number or 'auto'"),
        (["--workers", "2", "--replicas-file", "/nonexistent"], "static replica list"),
    ],
)
def test_bad_worker_settings_are_refused_clearly(args: list[str], says: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--replica", "http://127.0.0.1:1", *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert says in r.stderr
    assert "Traceback" not in r.stderr
