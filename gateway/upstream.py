"""Upstream HTTP: one shared httpx client, header hygiene, auth injection, error mapping.

Transport. httpx's API over aiohttp's connection pool (``httpx-aiohttp``): on this
2-core machine httpx's default transport (httpcore) caps a proxy at ~740 req/s while
aiohttp's client reaches ~4,800 (``shared/reference/perf-calibration.md``;
``bench/overhead.py`` re-measures it side by side). The client is injected, so tests can
pass ``httpx.MockTransport`` or an ASGI transport instead.

Header hygiene (RFC 9110 §7.6.1): hop-by-hop headers, ``Host``, ``Content-Length`` and
the client's ``Authorization`` never go upstream; the replica's own credential is added
instead. ``X-Request-Id`` is propagated (or created by the caller).

Errors. Every httpx/aiohttp failure is mapped once, here, to ``gateway.errors``. A failure
while *sending* (before any response byte: connection refused, reset, closed keep-alive
connection) is a ``ReplicaConnectError`` -- the only kind that is safe to retry on another
replica, because the replica produced nothing the client could have seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.config import Settings
from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.replicas import ReplicaPool

__all__ = [
    "BufferedResponse",
    "ReplicaConnectError",
    "Upstream",
    "make_client",
    "request_headers",
    "response_headers",
]

# Never forwarded in either direction (RFC 9110 §7.6.1) or recomputed by the hop itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "authorization", "x-request-id", "expect"}
# uvicorn adds its own Date/Server; the gateway sets its own replica and request headers.
_RESPONSE_DROP = _HOP_BY_HOP | {"date", "server", "x-gateway-replica", "x-request-id"}


class ReplicaConnectError(UpstreamUnavailable):
    """The replica failed before sending any response byte; retrying elsewhere is safe."""

    def __init__(self, replica: int, kind: str) -> None:
        super().__init__(f"replica {replica} is unreachable ({kind})")
        self.replica = replica
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BufferedResponse:
    status: int
    headers: list[tuple[str, str]]
    content: bytes
    replica: int

    def header(self, name: str, default: str = "") -> str:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)


def make_client(settings: Settings) -> httpx.AsyncClient:
    """The shared keep-alive client every upstream call goes through."""
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_connections,
        keepalive_expiry=30.0,
    )
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=settings.read_timeout_s,
        write=settings.read_timeout_s,
        pool=settings.connect_timeout_s,
    )
    return httpx.AsyncClient(
        transport=AiohttpTransport(limits=limits, trust_env=False),
        timeout=timeout,
        trust_env=False,
    )


def _connection_tokens(raw: Iterable[tuple[bytes, bytes]]) -> frozenset[str]:
    """Header names listed in ``Connection:`` are hop-by-hop too (RFC 9110 §7.6.1)."""
    names: set[str] = set()
    for key, value in raw:
        if key.lower() == b"connection":
            names.update(t.strip().lower() for t in value.decode("latin-1").split(","))
    return frozenset(names)


def request_headers(raw: Iterable[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
    """Client headers (ASGI raw pairs) as they may go upstream, minus credentials."""
    raw = list(raw)
    extra = _connection_tokens(raw)
    out = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in raw
        if (name := k.decode("latin-1").lower()) not in _REQUEST_DROP and name not in extra
    ]
    out.append(("x-request-id", request_id))
    return out


def response_headers(
    upstream: Iterable[tuple[str, str]], replica: int, request_id: str
) -> list[tuple[bytes, bytes]]:
    """Upstream response headers as ASGI raw pairs, hop-by-hop removed, ours added."""
    pairs = list(upstream)
    extra = _connection_tokens((k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs)
    out = [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in pairs
        if (name := k.lower()) not in _RESPONSE_DROP and name not in extra
    ]
    out.append((b"x-gateway-replica", str(replica).encode()))
    out.append((b"x-request-id", request_id.encode("latin-1")))
    return out


@contextlib.contextmanager
def map_errors(replica: int, *, sending: bool) -> Iterator[None]:
    """Turn transport exceptions into gateway errors (``raise ... from exc``)."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        if sending:
            raise ReplicaConnectError(replica, "connect") from exc
        raise UpstreamError(f"replica {replica} closed the connection mid-response") from exc
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(f"replica {replica} did not answer in time") from exc
    except (httpx.TransportError, aiohttp.ClientError, ConnectionError) as exc:
        if sending:
            raise ReplicaConnectError(replica, "reset") from exc
        raise UpstreamError(f"replica {replica} closed the connection mid-response") from exc


class Upstream:
    """Sends requests to replica ``i`` of the pool with its credential attached."""

    def __init__(self, client: httpx.AsyncClient, pool: ReplicaPool) -> None:
        self.client = client
        self.pool = pool

    def _url(self, replica: int, path: str, query: str) -> str:
        base = str(self.pool[replica].base_url).rstrip("/")
        return f"{base}{path}?{query}" if query else f"{base}{path}"

    async def send(
        self,
        replica: int,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send and return once headers arrived; the caller reads and closes the body."""
        hdrs = list(headers) if headers else []
        auth = self.pool[replica].auth_header
        if auth:
            hdrs.append(("authorization", auth))
        request = self.client.build_request(
            method,
            self._url(replica, path, query),
            headers=hdrs,
            content=body or None,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        with map_errors(replica, sending=True):
            return await self.client.send(request, stream=True)

    async def call(
        self,
        replica: int,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        headers: list[tuple[str, str]] | None = None,
        timeout: float | None = None,
    ) -> BufferedResponse:
        """A whole request/response exchange, for control-plane calls (fan-out, probes)."""
        if body is not None and not any(k.lower() == "content-type" for k, _ in headers or []):
            headers = [*(headers or []), ("content-type", "application/json")]
        response = await self.send(
            replica, method, path, query=query, headers=headers, body=body, timeout=timeout
        )
        try:
            with map_errors(replica, sending=False):
                content = await response.aread()
        finally:
            await response.aclose()
        return BufferedResponse(
            response.status_code, list(response.headers.multi_items()), content, replica
        )

    async def aclose(self) -> None:
        await self.client.aclose()
