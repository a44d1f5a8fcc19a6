"""``gateway.http.server.h1server`` over raw sockets in front of a real gateway and sim
replicas: the lean rollout path, the hand-off to uvicorn, framing, keep-alive and refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httptools
import httpx
import pytest
from rollout_testbed.serve import serve_asgi

from gateway.http.server import uvicorn_private
from gateway.http.server.exchange import LeanExchange
from gateway.http.server.h1server import lean_protocol
from gateway.http.server.serving import server_config
from tests.cluster import Cluster, cluster
from tests.eventually import STALL_S, eventually

BODY = json.dumps({"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}).encode()


def post(path: str = "/v1/completions", body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


Answer = tuple[int, dict[bytes, bytes], bytes]


class Reader:
    """Parses the responses arriving on one connection, in order."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Answer] = []
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self.headers, self.body))
        self.headers, self.body = {}, b""

    async def responses(self, n: int, timeout: float = 10.0) -> list[Answer]:
        async with asyncio.timeout(timeout):
            while len(self.done) < n:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.parser.feed_data(data)
        return self.done[:n]


@asynccontextmanager
async def connection(c: Cluster) -> AsyncIterator[tuple[Reader, asyncio.StreamWriter]]:
    port = int(c.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield Reader(reader), writer
    finally:
        writer.close()


@pytest.fixture
def handoffs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts connections handed to uvicorn."""
    count: list[int] = []

    class Counting(uvicorn_private.BoundedHttpToolsProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            count.append(1)
            super().connection_made(transport)  # type: ignore[arg-type]

    monkeypatch.setattr(uvicorn_private, "BoundedHttpToolsProtocol", Counting)
    return count


async def test_rollouts_keep_alive_then_admin_calls_on_the_same_connection(
    handoffs: list[int],
) -> None:
    """Lean requests first, then a GET (handed to uvicorn), then a rollout again: every
    answer arrives, in order, on one connection."""
    async with cluster(2) as c, connection(c) as (reader, writer):
        for _ in range(3):
            writer.write(post())
            [(status, headers, body)] = await reader.responses(1)
            reader.done.clear()
            assert status == 200, body
            assert json.loads(body)["object"] == "text_completion"
            assert headers[b"content-length"] == str(len(body)).encode()
            assert b"x-gateway-replica" in headers and b"x-request-id" in headers
            assert b"date" in headers and headers[b"server"] == b"uvicorn"  # as uvicorn's
            assert b"connection" not in headers and b"transfer-encoding" not in headers
        assert not handoffs  # served lean
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
        writer.write(post())
        (s1, _, models), (s2, _, completion) = await reader.responses(2)
        assert s1 == 200 and json.loads(models)["object"] == "list"
        assert s2 == 200 and json.loads(completion)["object"] == "text_completion"
        assert len(handoffs) == 1


async def test_pipelined_rollouts_are_answered_in_order() -> None:
    bodies = [json.dumps({"model": "tiny-base", "prompt": [i], "max_tokens": 1 + i}).encode()
              for i in range(4)]  # fmt: skip
    async with cluster(2) as c, connection(c) as (reader, writer):
        writer.write(b"".join(post(body=b) for b in bodies))
        answers = await reader.responses(4)
    assert [s for s, _, _ in answers] == [200] * 4
    tokens = [json.loads(b)["usage"]["completion_tokens"] for _, _, b in answers]
    assert tokens == [1, 2, 3, 4]


async def test_request_pipelined_behind_a_rollout_is_handed_off_after_it(
    handoffs: list[int],
) -> None:
    """A GET arriving in the same packet as a rollout waits for the rollout's answer, then
    the connection (with the GET's bytes) goes to uvicorn."""
    async with cluster(1) as c, connection(c) as (reader, writer):
        writer.write(post() + b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
        (s1, _, completion), (s2, _, models) = await reader.responses(2)
    assert s1 == 200 and json.loads(completion)["object"] == "text_completion"
    assert s2 == 200 and json.loads(models)["object"] == "list"
    assert len(handoffs) == 1


async def test_streamed_rollout_is_chunked_and_ends_with_done() -> None:
    body = json.dumps({"model": "tiny-base", "prompt": [1], "max_tokens": 3, "stream": True})
    async with cluster(1) as c, connection(c) as (reader, writer):
        writer.write(post(body=body.encode()))
        [(status, headers, data)] = await reader.responses(1)
    assert status == 200
    assert headers[b"transfer-encoding"] == b"chunked"
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert data.rstrip().endswith(b"data: [DONE]")


async def test_odd_framings_are_served_by_uvicorn(handoffs: list[int]) -> None:
    """Chunked bodies, Expect: 100-continue and a query string leave the lean path; the
    answers are the same."""
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    )
    async with cluster(1) as c:
        for request in (chunked, post("/v1/completions?x=1")):
            async with connection(c) as (reader, writer):
                writer.write(request)
                handoffs.clear()
                [(status, _, body)] = await reader.responses(1)
                assert status == 200, body
                assert handoffs
        async with connection(c) as (reader, writer):
            writer.write(post(extra=b"expect: 100-continue\r\n"))
            [(status, _, _)] = await reader.responses(1)
            assert status == 100  # uvicorn's interim answer: the connection was handed off


async def test_connection_close_is_honoured() -> None:
    async with cluster(1) as c, connection(c) as (reader, writer):
        writer.write(post(extra=b"connection: close\r\n"))
        [(status, headers, _)] = await reader.responses(1)
        assert status == 200
        assert headers[b"connection"] == b"close"
        assert await reader.reader.read() == b""  # closed by the gateway


async def test_malformed_requests_get_400_and_never_reach_a_replica() -> None:
    bad = [
        post(extra=b"x-bad: a\rb\r\n"),  # bare CR inside a value
        post(extra=b"x-fold: a\r\n b\r\n"),  # obs-fold
        post(extra=b"x-nul: a\x00b\r\n"),  # NUL inside a value
        post(extra=b"bad header: 1\r\n"),  # space in a name
    ]
    async with cluster(1) as c:
        for request in bad:
            async with connection(c) as (reader, writer):
                writer.write(request)
                answers = await reader.responses(1)
                assert answers and answers[0][0] == 400, request
        assert sum(c.sim(0).stats.requests_by_model.values()) == 0


_CHUNK = b"a" * (64 << 10)


async def _refused_head(reader: Reader, writer: asyncio.StreamWriter) -> Answer:
    """Send a head that never ends (2 MiB at most: the lingering close reads all of it)
    and return the answer, which must be the 431."""
    writer.write(b"GET /health HTTP/1.1\r\nhost: gw\r\nx-big: ")
    for _ in range(2 * uvicorn_private._MAX_OPEN_HEAD // len(_CHUNK)):
        writer.write(_CHUNK)
        await writer.drain()
    [answer] = await reader.responses(1)
    assert answer[0] == 431
    return answer


async def test_a_head_that_never_ends_gets_431_and_the_connection_closes() -> None:
    """Past ``_MAX_OPEN_HEAD`` bytes with no end of head, on a connection handed to uvicorn
    (which bounds nothing there): 431 with the gateway's JSON error, then the connection
    is closed; nothing reaches a replica and the gateway keeps serving."""
    async with cluster(1) as c:
        async with connection(c) as (reader, writer):
            _, headers, body = await _refused_head(reader, writer)
            assert headers[b"connection"] == b"close"
            error = json.loads(body)["error"]
            assert error["type"] == "RequestHeaderFieldsTooLarge"
            assert "1024 KiB" in error["message"]
            # A lingering close: what the client still sends is read and dropped, so its
            # end of stream is met by an orderly close, never a reset.
            writer.write(_CHUNK)
            await writer.drain()
            writer.write_eof()
            assert await reader.reader.read() == b""  # no ConnectionResetError
        async with connection(c) as (reader, writer):  # a complete big head: the app's 431
            writer.write(post(extra=b"x-big: " + b"a" * (70 << 10) + b"\r\n"))
            [(status, _, body)] = await reader.responses(1)
            assert status == 431 and "16384 bytes" in json.loads(body)["error"]["message"]
        async with connection(c) as (reader, writer):
            writer.write(post())
            [(status, _, _)] = await reader.responses(1)
            assert status == 200
        assert sum(c.sim(0).stats.requests_by_model.values()) == 1


async def _refused_by_the_kernel(
    writer: asyncio.StreamWriter, rounds: int, chunk: bytes = _CHUNK
) -> bool:
    """Whether writing (``rounds`` x ``chunk`` at most) fails: the gateway has closed."""
    for _ in range(rounds):
        try:
            writer.write(chunk)
            await writer.drain()
        except ConnectionError:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_the_lingering_close_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its 431 the gateway half-closes at once and still reads (and drops) what the
    client sends; ``_LINGER_S`` later it closes, and the client's bytes are refused."""
    # 3 s: the checks of the lingering phase must fit inside it, and the loop they share
    # with the gateway may stall (0.5 s left a 2-core CI box too little; 2 s must fit).
    monkeypatch.setattr(uvicorn_private, "_LINGER_S", 3.0)
    async with cluster(1) as c, connection(c) as (reader, writer):
        loop = asyncio.get_running_loop()
        sent_at = loop.time()  # before the gateway saw the head, so before its timer
        await _refused_head(reader, writer)
        assert await reader.reader.read() == b""  # the gateway's half-close
        assert not await _refused_by_the_kernel(writer, 4)  # lingering: read and dropped
        # Then closed by the timer: polled with one byte at a time, so the byte bound
        # (_LINGER_BYTES, 4 MiB) cannot be what closes it. Never before _LINGER_S (a stall
        # only makes it later); a close that never came fails the wait.
        await eventually(lambda: _refused_by_the_kernel(writer, 1, b"a"), "the lingering close",
                         interval=0.05)  # fmt: skip
        assert loop.time() - sent_at >= uvicorn_private._LINGER_S


async def test_the_lingering_close_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that keeps sending after its 431 is cut off after ``_LINGER_BYTES`` more."""
    monkeypatch.setattr(uvicorn_private, "_LINGER_S", 30.0)
    monkeypatch.setattr(uvicorn_private, "_LINGER_BYTES", 256 << 10)
    async with cluster(1) as c, connection(c) as (reader, writer):
        await _refused_head(reader, writer)
        async with asyncio.timeout(10):
            assert await _refused_by_the_kernel(writer, 256)  # 16 MiB at most


async def test_gateway_errors_keep_their_status_and_body() -> None:
    async with cluster(1) as c, connection(c) as (reader, writer):
        writer.write(post(body=b"{not json"))
        writer.write(post(body=json.dumps({"model": "nope", "prompt": [1]}).encode()))
        (s1, h1, b1), (s2, _, b2) = await reader.responses(2)
    assert s1 == 400 and json.loads(b1)["error"]["type"] == "BadRequestError"
    assert h1[b"content-type"] == b"application/json"
    assert s2 == 404 and json.loads(b2)["error"]["param"] == "model"


async def test_idle_keep_alive_connection_is_closed() -> None:
    """The server's keep-alive timeout applies to lean connections too."""
    async with cluster(1, idle_s=1) as c, connection(c) as (reader, writer):
        writer.write(post())
        [(status, _, _)] = await reader.responses(1)
        assert status == 200
        async with asyncio.timeout(1 + STALL_S):
            assert await reader.reader.read() == b""


async def test_the_gateway_outwaits_the_client_pools_idle_expiry() -> None:
    """A client whose pool keeps an idle connection as long as the server does races the
    server's close with its next request (``serving`` module docstring): the gateway waits
    longer than httpx's and aiohttp's pools keep one, read from the libraries themselves."""
    config = server_config(object(), None, 10)
    httpx_expiry = httpx.Limits().keepalive_expiry
    connector = aiohttp.TCPConnector()
    aiohttp_expiry = connector._keepalive_timeout  # its default: the argument is a sentinel
    await connector.close()
    assert httpx_expiry is not None and isinstance(aiohttp_expiry, float)
    assert config.timeout_keep_alive > max(httpx_expiry, aiohttp_expiry) + STALL_S


async def test_handler_failures_become_500_or_a_closed_connection() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # lifespan only
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    async def handler(exchange: LeanExchange) -> None:
        case = json.loads(exchange.body)["case"]
        if case == "raise":
            raise ValueError("boom")
        if case == "bad-header":
            await exchange.send({"type": "http.response.start", "status": 200,
                                 "headers": [(b"x-evil", b"a\r\nset-cookie: x")]})  # fmt: skip
            await exchange.send({"type": "http.response.body", "body": b"never"})
        # "silent": returns without a response

    async with serve_asgi(app, http=lean_protocol(handler)) as url:
        port = int(url.rsplit(":", 1)[1])
        for case in ("raise", "bad-header", "silent"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post(body=json.dumps({"case": case}).encode()))
            answers = await Reader(reader).responses(1)
            assert [(s, b) for s, _, b in answers] == [(500, b"Internal Server Error")], case
            assert await reader.read() == b""  # closed: never reused after a failure
            writer.close()
