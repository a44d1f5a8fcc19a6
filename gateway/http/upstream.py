"""Upstream HTTP: one shared aiohttp session, header hygiene, auth injection, error mapping.

Client choice, by measurement: on a 2-core box the proxy's CPU per request *is* its
throughput, and a plain ``aiohttp.ClientSession`` costs the least of the clients measured
(docs/decisions.md, 'HTTP: aiohttp for upstream calls'), so upstream calls speak aiohttp
directly: no cookie jar, no redirect or auth machinery, URLs pre-built per replica and
path. The ROUTED path goes one step further: ``send_routed`` uses ``gateway.http.h1client``
(one pre-assembled write per request, httptools parsing; docs/decisions.md, 'HTTP: an own
client for rollouts'). Control-plane calls keep aiohttp.

Header hygiene (RFC 9110 §7.6.1): hop-by-hop headers (and any named in ``Connection``),
``Host``, ``Content-Length`` and the client's ``Authorization`` never go upstream; the
replica's own credential is added instead. ``X-Request-Id`` is propagated.

Errors. Every aiohttp failure is mapped once, here, to ``gateway.errors``. A failure before
the response headers arrived (DNS, refused, TLS, reset, a stale keep-alive connection,
each named by ``gateway.http.failures``) is a
``ReplicaConnectError``: the only kind that is safe to retry on another replica, because
the replica produced nothing the client could have seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from yarl import URL

from gateway.config import Settings
from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.http.failures import CONCLUSIVE, connect_kind
from gateway.http.h1client import H1Pool
from gateway.http.h1response import ConnectFailed, H1Response, ResetBeforeResponse

__all__ = [
    "HOP_BY_HOP",
    "BufferedResponse",
    "ReplicaConnectError",
    "Upstream",
    "UpstreamResponse",
    "make_session",
    "map_errors",
    "request_head_lines",
    "request_headers",
    "response_headers",
]

# Never forwarded in either direction (RFC 9110 §7.6.1); the one definition (the data-plane
# worker's relay to its owner uses it too).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_HOP_BY_HOP = HOP_BY_HOP | {b"content-length"}  # and what each hop computes itself
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"authorization", b"x-request-id", b"expect"}
# uvicorn adds its own Date/Server; the gateway sets its own replica and request headers.
_RESPONSE_DROP = _HOP_BY_HOP | {b"date", b"server", b"x-gateway-replica", b"x-request-id"}
_URL_CACHE_LIMIT = 4096


class ReplicaConnectError(UpstreamUnavailable):
    """The replica failed before sending any response byte; retrying elsewhere is safe.
    ``kind``: what the failure was (``gateway.http.failures``)."""

    def __init__(self, replica: int, kind: str) -> None:
        super().__init__(f"replica {replica} is unreachable ({kind})")
        self.replica = replica
        self.kind = kind

    @property
    def conclusive(self) -> bool:
        """The replica cannot be reached at all (down, unresolvable, TLS refused), not
        merely slow to connect or unlucky with one connection."""
        return self.kind in CONCLUSIVE


class _Chunks(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamResponse(Protocol):
    """What the relay needs of a response: ``aiohttp.ClientResponse`` or ``H1Response``."""

    @property
    def status(self) -> int: ...
    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content(self) -> _Chunks: ...
    async def read(self) -> bytes: ...
    def release(self) -> Any: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BufferedResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes
    replica: int

    def header(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), default)


def upstream_tls(settings: Settings) -> ssl.SSLContext:
    """How https replicas are verified, the same for both clients: the system's CAs, or
    ``upstream_ca_file`` (a private CA for in-cluster TLS). Hostnames are always checked."""
    ca = settings.upstream_ca_file
    return ssl.create_default_context(cafile=str(ca) if ca else None)


def make_session(settings: Settings) -> aiohttp.ClientSession:
    """The shared keep-alive session every upstream call goes through (create in a loop)."""
    connector = aiohttp.TCPConnector(
        # ``max_connections`` per replica, as in H1Pool; no cap across replicas.
        limit=0, limit_per_host=settings.max_connections, keepalive_timeout=4,
        ttl_dns_cache=300, ssl=upstream_tls(settings),
    )  # fmt: skip
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),  # a proxy must not keep cookies
        auto_decompress=False,  # relay bytes exactly as the replica sent them
        trust_env=False,
        # Send only what the client sent: an added Accept-Encoding would let a compressing
        # replica hand clients gzip they never asked for (bytes are relayed as they are).
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    )


def _connection_tokens(raw: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in ``Connection:`` are hop-by-hop too (RFC 9110 §7.6.1)."""
    names: set[bytes] = set()
    for key, value in raw:
        if key.lower() == b"connection":
            names.update(t.strip().lower() for t in value.split(b","))
    return frozenset(names)


def request_headers(raw: Iterable[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
    """Client headers (ASGI raw pairs, lower-case) as they may go upstream."""
    raw = list(raw)
    drop = _REQUEST_DROP | _connection_tokens(raw)
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k not in drop]
    out.append(("x-request-id", request_id))
    return out


def request_head_lines(raw: Sequence[tuple[bytes, bytes]], request_id: str) -> bytes:
    """``request_headers`` as ready-to-send HTTP/1.1 header lines (for ``send_routed``).

    Names and values come from the server's parser (lower-case names, no CR/LF possible)
    or are ours. One pass; a ``Connection`` header (the names it lists are hop-by-hop too)
    is rare, so it starts the filtering over with them."""
    lines = []
    for k, v in raw:
        if k not in _REQUEST_DROP:
            lines.append(k + b": " + v + b"\r\n")
        elif k == b"connection":
            drop = _REQUEST_DROP | _connection_tokens(raw)
            lines = [k + b": " + v + b"\r\n" for k, v in raw if k not in drop]
            break
    lines.append(b"x-request-id: " + request_id.encode("latin-1") + b"\r\n")
    return b"".join(lines)


def response_headers(
    upstream: Sequence[tuple[bytes, bytes]], replica: int, request_id: str
) -> list[tuple[bytes, bytes]]:
    """Upstream raw response headers as ASGI pairs, hop-by-hop removed, ours added. One
    pass, as ``request_head_lines``."""
    out = []
    for k, v in upstream:
        k = k.lower()
        if k not in _RESPONSE_DROP:
            out.append((k, v))
        elif k == b"connection":
            pairs = [(k.lower(), v) for k, v in upstream]
            drop = _RESPONSE_DROP | _connection_tokens(pairs)
            out = [(k, v) for k, v in pairs if k not in drop]
            break
    out.append((b"x-gateway-replica", str(replica).encode()))
    out.append((b"x-request-id", request_id.encode("latin-1")))
    return out


@contextlib.contextmanager
def map_errors(replica: int, *, sending: bool) -> Iterator[None]:
    """Turn transport exceptions into gateway errors (``raise ... from exc``).

    ``sending``: no response byte has arrived yet, so connection failures are retryable.
    """
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise ReplicaConnectError(replica, "connect_timeout") from exc
    except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
        raise UpstreamTimeout(f"replica {replica} did not answer in time") from exc
    except aiohttp.ClientSSLError as exc:  # certificate or handshake: no os_error to read
        raise ReplicaConnectError(replica, "tls") from exc
    except aiohttp.ClientConnectorError as exc:
        raise ReplicaConnectError(replica, connect_kind(exc)) from exc
    except (aiohttp.ClientError, ConnectionError) as exc:
        if sending and not isinstance(exc, aiohttp.ClientResponseError):
            raise ReplicaConnectError(replica, "reset") from exc
        raise UpstreamError(f"replica {replica} failed mid-response") from exc


class Address(Protocol):
    """What sending needs of one replica: where it is and its credential."""

    @property
    def base_url(self) -> URL: ...

    @property
    def auth_header(self) -> str | None: ...


class Addresses(Protocol):
    """The replicas by index (``gateway.fleet.replicas.ReplicaPool`` is one), named here
    so that HTTP, which the fleet's parts call, does not import the fleet. Read at every
    send: discovery can give an index a new URL."""

    def __getitem__(self, index: int) -> Address: ...


class Upstream:
    """Sends requests to replica ``i`` of the pool with its credential attached."""

    def __init__(
        self,
        pool: Addresses,
        make_session: Callable[[], aiohttp.ClientSession],
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_connections: int = 1024,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.pool = pool
        self._make_session = make_session
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[int, str, str], URL] = {}
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._tls = tls or ssl.create_default_context()
        # replica -> (its base URL when built, pool, fixed head lines, path prefix)
        self._h1: dict[int, tuple[object, H1Pool, bytes, bytes]] = {}

    def _h1_for(self, replica: int) -> tuple[object, H1Pool, bytes, bytes]:
        """The replica's connection pool and constant head bytes, rebuilt if discovery
        gave the index a new URL."""
        member = self.pool[replica]
        entry = self._h1.get(replica)
        if entry is not None and entry[0] is member.base_url:
            return entry
        if entry is not None:
            entry[1].close()
        url = member.base_url
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        host = url.host or ""
        pool = H1Pool(
            replica, host, port, ssl_context=self._tls if tls else None,
            connect_timeout_s=self._connect_timeout_s,
            read_timeout_s=self._read_timeout_s, max_connections=self._max_connections,
        )  # fmt: skip
        default_port = port == (443 if tls else 80)
        netloc = f"[{host}]" if ":" in host else host
        fixed = f"host: {netloc if default_port else f'{netloc}:{port}'}\r\n"
        if member.auth_header:
            fixed += f"authorization: {member.auth_header}\r\n"
        prefix = url.raw_path.rstrip("/").encode("latin-1")
        entry = self._h1[replica] = (url, pool, fixed.encode("latin-1"), prefix)
        return entry

    async def send_routed(
        self, replica: int, method: str, target: bytes, head_lines: bytes, body: bytes
    ) -> tuple[H1Response, bytes | None]:
        """The data path's lean twin of ``send`` (``gateway.http.h1client``): ``target`` is the
        raw path and query, ``head_lines`` the client's forwardable headers
        (``request_head_lines``). A sized body is read too (the content, else None: a
        stream for the caller to relay). Errors are mapped exactly as ``map_errors`` maps
        them; on any failure the connection is closed, never reused."""
        _, pool, fixed, prefix = self._h1_for(replica)
        head = b"".join((
            method.encode("ascii"), b" ", prefix, target, b" HTTP/1.1\r\n", fixed, head_lines,
            b"content-length: ", str(len(body)).encode(), b"\r\n\r\n",
        ))  # fmt: skip
        try:
            response = await pool.request(head, body)
        except ConnectFailed as exc:
            raise ReplicaConnectError(replica, exc.kind) from exc
        except ResetBeforeResponse as exc:
            raise ReplicaConnectError(replica, "reset") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"replica {replica} did not answer in time") from exc
        except ConnectionError as exc:
            raise UpstreamError(f"replica {replica} failed mid-response") from exc
        if response.content_length is None or response.content_type == "text/event-stream":
            return response, None
        try:
            content = response.read_nowait()
            if content is None:
                content = await response.read()
        except TimeoutError as exc:
            response.close()
            raise UpstreamTimeout(f"replica {replica} did not answer in time") from exc
        except ConnectionError as exc:
            response.close()
            raise UpstreamError(f"replica {replica} failed mid-response") from exc
        except BaseException:
            response.close()
            raise
        response.release()
        return response, content

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop (aiohttp requires one)."""
        if self._session is None:
            self._session = self._make_session()
        return self._session

    def url(self, replica: int, path: str, query: str = "") -> URL:
        """Pre-built (already encoded) URL; parsing one per request costs more than routing."""
        key = (replica, path, query)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= _URL_CACHE_LIMIT:
                self._urls.clear()
            base = str(self.pool[replica].base_url).rstrip("/")
            url = URL(f"{base}{path}?{query}" if query else f"{base}{path}", encoded=True)
            self._urls[key] = url
        return url

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
    ) -> aiohttp.ClientResponse:
        """Send; return once the response headers arrived. The caller reads the body and
        then ``release()``s (or ``close()``s, to abort the upstream request)."""
        hdrs = list(headers) if headers else []
        auth = self.pool[replica].auth_header
        if auth:
            hdrs.append(("Authorization", auth))
        url = self.url(replica, path, query)
        data = body or None
        with map_errors(replica, sending=True):
            if timeout is None:  # the session's connect/read timeouts apply
                return await self.session.request(
                    method, url, headers=hdrs, data=data, allow_redirects=False
                )
            return await self.session.request(
                method, url, headers=hdrs, data=data, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            )  # fmt: skip

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
                content = await response.read()
        finally:
            response.release()
        return BufferedResponse(response.status, list(response.raw_headers), content, replica)

    async def aclose(self) -> None:
        for _, pool, _, _ in self._h1.values():
            pool.close()
        self._h1.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
            # aiohttp closes transports on the next loop iteration; let that happen.
            await asyncio.sleep(0)
