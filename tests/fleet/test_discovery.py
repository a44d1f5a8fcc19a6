"""Replica discovery: the pure parts (specs, DNS queries against a dnslib zone, diff, replicas
file), the pool's stable indices, minimal ring movement, and end to end: an in-process DNS
server on 127.0.0.1 whose records change during a run, sim replicas on 127.0.0.2/.3, and a
watched replicas file (change and SIGHUP)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_testbed.procs import free_port_on
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.app import create_sim_app

from gateway.app import create_app
from gateway.config import ReplicaSpec, load_settings
from gateway.core import Gateway
from gateway.fleet.discovery import (
    DnsError,
    DnsTarget,
    diff_membership,
    parse_dns_target,
    parse_replicas_file,
    query_nameserver,
    urls_for,
)
from gateway.fleet.replicas import ReplicaPool
from gateway.routing.policy import PrefixAffinityRouter
from tests.deploy.tools import ensure_tools
from tests.eventually import eventually

# The first test to need promtool/hadolint/... may install them (ensure_tools.sh).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dnslib() -> Any:
    ensure_tools()
    import dnslib
    import dnslib.server

    return dnslib


# ------------------------------------------------------------------ pure parts


def test_parse_dns_target() -> None:
    assert parse_dns_target("vllm.ns.svc.cluster.local:8000") == DnsTarget(
        "http", "vllm.ns.svc.cluster.local", 8000
    )
    assert parse_dns_target("https://vllm:8443/") == DnsTarget("https", "vllm", 8443)
    for bad in ("vllm", "vllm:", "vllm:0", "ftp://vllm:80", ":80"):
        with pytest.raises(ValueError):
            parse_dns_target(bad)


def test_urls_for_sorts_dedups_and_brackets_v6() -> None:
    t = DnsTarget("http", "x", 8000)
    assert urls_for(t, ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1"]) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://[fd00::1]:8000",
    ]


async def test_query_nameserver_against_a_dnslib_zone(dnslib: Any) -> None:
    zone = Zone(dnslib)
    zone.records["vllm.test"] = ["10.1.0.6", "10.1.0.5", "fd00::7"]
    zone.records["v4only.test"] = ["10.1.0.9"]
    server = ("127.0.0.1", zone.port)
    with zone.running():
        assert sorted(await query_nameserver(server, "vllm.test", "A", 2.0)) == [
            "10.1.0.5", "10.1.0.6",
        ]  # fmt: skip
        assert await query_nameserver(server, "vllm.test", "AAAA", 2.0) == ["fd00::7"]
        assert await query_nameserver(server, "v4only.test", "AAAA", 2.0) == []  # NODATA
        with pytest.raises(DnsError, match="NXDOMAIN"):
            await query_nameserver(server, "missing.test", "A", 2.0)
    with pytest.raises(DnsError, match="no answer from"):  # the server is gone: a timeout
        await query_nameserver(server, "vllm.test", "A", 0.3)


def test_parse_replicas_file(tmp_path: Path) -> None:
    assert parse_replicas_file("") == []
    assert parse_replicas_file("# nothing\n\n") == []
    lines = "http://10.0.0.1:8000  # a\n\nhttp://10.0.0.2:8000/\n"
    assert [s.url for s in parse_replicas_file(lines)] == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    ]
    token = tmp_path / "tok"
    token.write_text("hf_secret\n")
    specs = parse_replicas_file(
        f"- http://10.0.0.1:8000\n- {{url: 'http://10.0.0.2:8000', token_file: '{token}'}}\n"
    )
    assert specs[1].token is not None and specs[1].token.get_secret_value() == "hf_secret"
    assert [s.url for s in parse_replicas_file('["http://a:1", "http://b:2"]')] == [
        "http://a:1",
        "http://b:2",
    ]
    for bad in ("not a url\n", "- {url: 'http://a:1', bogus: 1}\n", "[1, 2"):
        with pytest.raises(ValueError):
            parse_replicas_file(bad)


def test_diff_membership() -> None:
    cur = {"http://a:1": 0, "http://b:1": 1}
    specs = [ReplicaSpec(url=u) for u in ("http://b:1", "http://c:1", "http://c:1")]
    change = diff_membership(cur, specs)
    assert [s.url for s in change.added] == ["http://c:1"] and change.removed == (0,)
    assert not diff_membership(cur, [ReplicaSpec(url="http://a:1"), ReplicaSpec(url="http://b:1")])


# ----------------------------------------------------------- pool and ring


def test_pool_indices_are_stable_and_never_reused() -> None:
    settings = load_settings({"replicas": ["http://s:1"]}, environ={})
    pool = ReplicaPool.from_settings(settings)
    a = pool.add(ReplicaSpec(url="http://a:1"), None)
    b = pool.add(ReplicaSpec(url="http://b:1"), "tok")
    assert (a, b) == (1, 2) and pool.indices() == [0, 1, 2]
    assert pool[b].auth_header == "Bearer tok"
    assert pool.add(ReplicaSpec(url="http://a:1"), None) == a  # already a member
    pool.admit(a)
    pool.acquire(a)
    pool.remove(a)
    assert pool.indices() == [0, 2] and len(pool) == 2 and a not in pool.healthy_indices()
    assert pool.record_probe(a, True) is None and not pool[a].up  # ignored once removed
    pool.release(a)  # in flight to a removed replica still releases
    assert pool[a].in_flight == 0
    c = pool.add(ReplicaSpec(url="http://c:1"), None)
    assert c == 3  # a's index stays reserved for a
    assert pool.add(ReplicaSpec(url="http://a:1"), None) == a  # same address, same index
    assert not pool[a].up and pool.indices() == [0, 1, 2, 3]
    assert pool.membership() == {"http://s:1": 0, "http://a:1": 1, "http://b:1": 2, "http://c:1": 3}


def test_ring_moves_minimally_on_join_and_leave() -> None:
    router = PrefixAffinityRouter()
    keys = [int.from_bytes(os.urandom(8), "little") for _ in range(4000)]

    def owners() -> list[int | None]:
        return [router.ring.preferred(k) for k in keys]

    router.set_members([0, 1, 2, 3])
    before = owners()
    router.set_members([0, 1, 2, 3, 4])  # join
    joined = owners()
    moved = [(b, j) for b, j in zip(before, joined, strict=True) if b != j]
    assert all(j == 4 for _, j in moved)  # only keys now owned by the newcomer move
    assert 0.10 < len(moved) / len(keys) < 0.30  # ~1/5
    router.set_members([0, 1, 3, 4])  # leave
    left = owners()
    moved = [(j, x) for j, x in zip(joined, left, strict=True) if j != x]
    assert all(j == 2 for j, _ in moved)  # only the leaver's keys move


# ------------------------------------------------------------ end to end


class Zone:
    """A tiny authoritative zone served by dnslib on 127.0.0.1; records mutable at run time."""

    def __init__(self, dnslib: Any) -> None:
        self.dnslib = dnslib
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        zone = self

        class Resolver(dnslib.server.BaseResolver):  # type: ignore[misc]
            def resolve(self, request: Any, handler: Any) -> Any:
                zone.queries += 1
                reply = request.reply()
                name = str(request.q.qname).rstrip(".")
                if name not in zone.records:
                    reply.header.rcode = dnslib.RCODE.NXDOMAIN
                    return reply
                for addr in zone.records[name]:
                    v6 = ":" in addr
                    qtype = dnslib.QTYPE.AAAA if v6 else dnslib.QTYPE.A
                    if request.q.qtype == qtype:
                        rdata = dnslib.AAAA(addr) if v6 else dnslib.A(addr)
                        reply.add_answer(dnslib.RR(request.q.qname, qtype, rdata=rdata, ttl=1))
                return reply

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = dnslib.server.DNSServer(
            Resolver(), address="127.0.0.1", port=self.port, logger=_QuietLogger()
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[Zone]:
        self.server.start_thread()
        try:
            yield self
        finally:
            self.server.stop()
            self.server.server.server_close()


class _QuietLogger:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


@contextlib.asynccontextmanager
async def sim_at(host: str, port: int) -> AsyncIterator[Any]:
    """A sim replica on host:port (same port on several loopback addresses)."""
    app = create_sim_app()
    async with serve_asgi(app, host=host, port=port):
        yield app.state.sim


def _count_rounds(gw: Gateway) -> list[int]:
    """Count discovery rounds: each one hands its list to ``apply_membership``, which the
    lifespan looks up when it starts discovery (so call this before ``serve_asgi``)."""
    rounds = [0]
    apply = gw.health.apply_membership

    async def counted(desired: Sequence[ReplicaSpec]) -> None:
        rounds[0] += 1
        await apply(desired)

    gw.health.apply_membership = counted  # type: ignore[method-assign]
    return rounds


def _members(gw: Gateway) -> dict[int, str]:
    return {r.index: r.display for r in gw.pool.replicas}


def _synced(gw: Gateway, index: int) -> bool:
    return any(r["index"] == index and r["state"] == "up" for r in gw.adapters.status()["replicas"])


async def test_dns_discovery_follows_records_and_moves_traffic(dnslib: Any) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    zone = Zone(dnslib)
    zone.records["vllm.test"] = ["127.0.0.2"]
    with zone.running():
        async with sim_at("127.0.0.2", port) as sim_a, sim_at("127.0.0.3", port) as sim_b:
            settings = load_settings(
                {
                    "discovery_dns": f"vllm.test:{port}",
                    "discovery_nameserver": f"127.0.0.1:{zone.port}",
                    "discovery_interval_s": 0.1,
                    "health_interval_s": 0.2,
                    "max_staleness": 1,
                },
                environ={},
            )
            app = create_app(settings)
            gw: Gateway = app.state.gateway
            async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
                a = f"http://127.0.0.2:{port}"
                b = f"http://127.0.0.3:{port}"
                assert _members(gw) == {0: a}
                assert (await c.get("/health")).status_code == 200
                load = {"lora_name": "policy-v1", "lora_path": "/adapters/policy-v1"}
                assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 200
                assert "policy-v1" in sim_a.adapters and "policy-v1" not in sim_b.adapters

                # Rollouts on the adapter keep flowing while a record is added: each one
                # must succeed, so none reaches the newcomer before it holds the adapter.
                served: dict[str, int] = {}
                stop = asyncio.Event()

                async def rollouts() -> None:
                    i = 0
                    while not stop.is_set():
                        i += 1
                        body = {"model": "policy-v1", "prompt": f"q{i} " * 30, "max_tokens": 2}
                        r = await c.post("/v1/completions", json=body)
                        assert r.status_code == 200, r.text
                        who = r.headers["x-gateway-replica"]
                        served[who] = served.get(who, 0) + 1

                traffic = asyncio.create_task(rollouts())
                await asyncio.sleep(0.2)
                zone.records["vllm.test"] = ["127.0.0.2", "127.0.0.3"]
                await eventually(lambda: _members(gw) == {0: a, 1: b}, "the pool to add b")
                await eventually(lambda: gw.pool[1].up and _synced(gw, 1), "b admitted and synced")
                assert "policy-v1" in sim_b.adapters  # reconciled: the live adapter replayed
                await eventually(lambda: served.get("1", 0) >= 5, "traffic on the new replica")
                stop.set()
                await traffic
                assert gw.router.ring.members == frozenset({0, 1})  # type: ignore[attr-defined]

                # Remove a's record: a leaves the pool; everything goes to b.
                zone.records["vllm.test"] = ["127.0.0.3"]
                await eventually(lambda: _members(gw) == {1: b}, "the pool to drop a")
                assert gw.router.ring.members == frozenset({1})  # type: ignore[attr-defined]
                for i in range(6):
                    body = {"model": "policy-v1", "prompt": f"after {i}", "max_tokens": 2}
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200 and r.headers["x-gateway-replica"] == "1"
                metrics = (await c.get("/metrics")).text
                assert 'gateway_replica_healthy{replica="1"} 1.0' in metrics
                assert 'gateway_replica_healthy{replica="0"}' not in metrics

                # A failed lookup keeps the last answer; a's address back -> its old index.
                zone.records.pop("vllm.test")
                seen = zone.queries
                await eventually(lambda: zone.queries > seen + 4, "more lookups")
                assert _members(gw) == {1: b}
                zone.records["vllm.test"] = ["127.0.0.3", "127.0.0.2"]
                await eventually(lambda: _members(gw) == {0: a, 1: b}, "a back under index 0")
                await eventually(lambda: gw.pool[0].up and _synced(gw, 0), "a re-admitted")
                assert (await c.get("/health")).status_code == 200


async def test_replicas_file_reload_on_change_and_on_sighup(tmp_path: Path) -> None:
    port = free_port_on("127.0.0.2", "127.0.0.3")
    listing = tmp_path / "replicas.txt"
    a, b = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    async with sim_at("127.0.0.2", port), sim_at("127.0.0.3", port):
        # Polling: a change is picked up within an interval.
        listing.write_text(f"{a}\n")
        settings = load_settings(
            {"replicas_file": str(listing), "discovery_interval_s": 0.1, "health_interval_s": 0.2},
            environ={},
        )
        app = create_app(settings)
        gw: Gateway = app.state.gateway
        rounds = _count_rounds(gw)
        async with serve_asgi(app):
            assert _members(gw) == {0: a}
            listing.write_text(f"# two now\n{a}\n{b}\n")
            await eventually(lambda: _members(gw) == {0: a, 1: b}, "file change picked up")
            await eventually(lambda: gw.pool[1].up, "b admitted")
            listing.unlink()  # an unreadable file keeps the last list
            # Two whole rounds after the unlink (the first may have begun before it) each
            # found no file: had a missing file emptied the list, it would show by now.
            after_unlink = rounds[0]
            await eventually(lambda: rounds[0] >= after_unlink + 2, "two discovery rounds")
            assert _members(gw) == {0: a, 1: b}

        # SIGHUP: re-read at once, long before the next interval.
        listing.write_text(f"{a}\n")
        settings = load_settings(
            {"replicas_file": str(listing), "discovery_interval_s": 3600}, environ={}
        )
        app = create_app(settings)
        gw = app.state.gateway
        rounds = _count_rounds(gw)
        async with serve_asgi(app):
            listing.write_text(f"{b}\n")
            assert _members(gw) == {0: a}
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(lambda: _members(gw) == {1: b}, "SIGHUP reload")
            await eventually(lambda: gw.pool[1].up, "b admitted")
            # It was the SIGHUP's round, the only one: no poll for an hour. (Counted, not
            # waited for: a quiet wait proves nothing about a poll that comes later; a
            # gateway that polled at start or kept polling would count more than one.)
            assert rounds[0] == 1, rounds


async def test_system_resolver_path_resolves_localhost() -> None:
    """Without discovery_nameserver, getaddrinfo is used (search domains, /etc/hosts)."""
    from gateway.fleet.discovery import Discovery

    async def ignore(_: list[ReplicaSpec]) -> None:
        return None

    settings = load_settings({"discovery_dns": "localhost:8000"}, environ={})
    discovery = Discovery(settings, ignore)
    urls = await discovery.resolve(parse_dns_target("localhost:8000"))
    assert urls and set(urls) <= {"http://127.0.0.1:8000", "http://[::1]:8000"}
    with pytest.raises(DnsError):
        await discovery.resolve(parse_dns_target("no-such-host.invalid:8000"))
