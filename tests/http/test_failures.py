"""Each way a replica can be unreachable is named for what it is, the same by both
clients (``send_routed``'s h1client on the data path, aiohttp for control calls and
probes): real sockets, a real resolver, a real TLS handshake."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from rollout_testbed.procs import free_port

from gateway.config import load_settings
from gateway.fleet.replicas import ReplicaPool
from gateway.http.upstream import ReplicaConnectError, Upstream, make_session


@contextlib.asynccontextmanager
async def _not_tls() -> AsyncIterator[int]:
    """A server that answers a TLS ClientHello with plain HTTP: the handshake fails."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def _kinds(url: str) -> tuple[str, str]:
    """The kind each client names when ``url``'s replica cannot be reached."""
    settings = load_settings({"replicas": [url], "connect_timeout_s": 5}, environ={})
    upstream = Upstream(ReplicaPool.from_settings(settings), lambda: make_session(settings),
                        connect_timeout_s=5)  # fmt: skip
    kinds = []
    try:
        with pytest.raises(ReplicaConnectError) as info:
            await upstream.call(0, "GET", "/health", timeout=10)
        kinds.append(info.value.kind)
        with pytest.raises(ReplicaConnectError) as info:
            await upstream.send_routed(0, "POST", b"/v1/completions", b"", b"{}")
        kinds.append(info.value.kind)
    finally:
        await upstream.aclose()
    return kinds[0], kinds[1]


async def test_refused() -> None:
    kinds = await _kinds(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert kinds == ("refused", "refused")


async def test_a_name_that_does_not_resolve_is_dns() -> None:
    """``.invalid`` never resolves (RFC 6761): before, both said "connect"."""
    assert await _kinds("http://does-not-exist.invalid:1") == ("dns", "dns")


async def test_a_failed_tls_handshake_is_tls() -> None:
    async with _not_tls() as port:
        assert await _kinds(f"https://127.0.0.1:{port}") == ("tls", "tls")


async def test_conclusive_kinds_eject_on_a_probe_but_timeouts_do_not() -> None:
    assert ReplicaConnectError(0, "dns").conclusive and ReplicaConnectError(0, "refused").conclusive
    assert not ReplicaConnectError(0, "connect_timeout").conclusive
    assert not ReplicaConnectError(0, "reset").conclusive
