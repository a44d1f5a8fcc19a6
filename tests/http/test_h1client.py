"""``gateway.http.h1client`` against a scripted raw-socket server: framing, keep-alive reuse,
and the error contract (what is retryable, what is a mid-response failure)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.http import h1client
from gateway.http.h1client import H1Pool
from gateway.http.h1response import BrokenResponse, ConnectFailed, ResetBeforeResponse
from tests.eventually import eventually

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """A server running ``handler`` per connection; yields (port, connection counter)."""
    accepted = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield port, accepted
    finally:
        srv.close()
        await srv.wait_closed()


def pool_for(port: int, **kwargs: float) -> H1Pool:
    return H1Pool(0, "127.0.0.1", port, **kwargs)  # type: ignore[arg-type]


async def test_sized_responses_reuse_one_connection() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
                         b"X-Extra: 1\r\nContent-Length: 7\r\n\r\n{\"a\":1}")  # fmt: skip
            await writer.drain()

    async with server(handler) as (port, accepted):
        pool = pool_for(port)
        for _ in range(3):
            response = await pool.request(HEAD, b"{}")
            assert response.status == 200
            assert response.content_length == 7
            assert response.content_type == "application/json"
            assert (b"X-Extra", b"1") in response.raw_headers
            assert await response.read() == b'{"a":1}'
            response.release()
        pool.close()
    assert accepted[0] == 1
    assert seen[0] == HEAD + b"{}"


async def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")  # fmt: skip
        await writer.drain()
        await release.wait()
        writer.write(b"4\r\nDONE\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        response = await pool.request(HEAD, b"{}")
        assert response.content_length is None
        assert response.content_type == "text/event-stream"
        chunks = response.content.iter_any()
        assert await anext(chunks) == b"data: "  # before the rest was even written
        release.set()
        assert [c async for c in chunks] == [b"DONE"]
        response.release()
        assert len(pool._idle) == 1  # complete: kept for reuse
        pool.close()


async def test_chunks_read_together_come_out_as_one_piece() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: 1\n\n", b"data: 2\n\n"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" + events + b"0\r\n\r\n")  # fmt: skip
        await writer.drain()
        await reader.read()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        response = await pool.request(HEAD, b"{}")
        await asyncio.sleep(0.05)  # the whole burst is buffered before the relay reads it
        pieces = [c async for c in response.content.iter_any()]
        assert pieces == [b"data: 1\n\ndata: 2\n\n"]  # one write downstream, not one per event
        response.release()
        pool.close()


async def test_new_connection_closed_before_any_byte_is_a_reset_not_resent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with server(handler) as (port, accepted):
        pool = pool_for(port)
        with pytest.raises(ResetBeforeResponse):
            await pool.request(HEAD, b"{}")
        assert not pool._open
        assert pool.stale_resends == 0  # only a *reused* connection is resent
    assert accepted[0] == 1


async def test_reused_connection_closed_as_the_request_went_out_is_resent_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keep-alive race: the replica drops an idle connection just as the next request
    is written on it. That request is sent again on a new connection, not failed over."""
    # What is "at once" is tested by ..._dying_later_is_a_reset_not_resent; here, a loop
    # stalled for 1 s between the send and the close must not turn the race into a reset.
    monkeypatch.setattr(h1client, "_RACE_S", 30.0)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)  # the second request on this connection: dropped

    async with server(handler) as (port, accepted):
        pool = pool_for(port)
        first = await pool.request(HEAD, b"{}")
        assert await first.read() == b"ok"
        first.release()
        second = await pool.request(HEAD, b"{}")  # reuses, is dropped, resent
        assert await second.read() == b"ok"
        second.release()
        assert pool.stale_resends == 1
        pool.close()
    assert accepted[0] == 2


async def test_read_nowait_has_the_body_only_once_all_of_it_arrived() -> None:
    """``read_nowait``: the body when it came with the head; None while some is missing
    (then ``read`` waits for it); the error, once it broke."""

    checked_half = asyncio.Event()  # the rest of "half" is sent only after the check

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nha")
        await writer.drain()
        await checked_half.wait()
        writer.write(b"lf")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nbro")
        await writer.drain()

    def broke(response: Any) -> bool:
        """False while ``read_nowait`` still waits (None); True once it raises."""
        try:
            assert response.read_nowait() is None, "a broken body read as whole"
        except BrokenResponse:
            return True
        return False

    async with server(handler) as (port, _):
        pool = pool_for(port)
        whole = await pool.request(HEAD, b"{}")
        assert whole.read_nowait() == b"ok"
        whole.release()
        half = await pool.request(HEAD, b"{}")
        assert half.read_nowait() is None
        checked_half.set()
        assert await half.read() == b"half"
        half.release()
        broken = await pool.request(HEAD, b"{}")
        # The server's close arrives on a later loop pass: until then None, then the error.
        await eventually(lambda: broke(broken), "read_nowait to report the server's close")
        broken.release()
        assert not pool._idle
        pool.close()


async def test_close_mid_body_is_a_broken_response() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        response = await pool.request(HEAD, b"{}")
        with pytest.raises(BrokenResponse):
            await response.read()
        response.release()
        assert not pool._idle


async def test_body_until_eof_without_length() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        response = await pool.request(HEAD, b"{}")
        assert await response.read() == b"all of it"
        response.release()
        assert not pool._idle


async def test_refused_connect_is_connect_failure() -> None:
    async with server(read_request) as (port, _):
        pass  # closed: nothing listens on the port any more
    with pytest.raises(ConnectFailed) as info:
        await pool_for(port).request(HEAD, b"{}")
    assert info.value.kind == "refused"  # named for what it is (``gateway.http.failures``)


async def test_silent_replica_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers

    async with server(handler) as (port, _):
        pool = pool_for(port, read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await pool.request(HEAD, b"{}")
        assert not pool._open


async def test_idle_connection_closed_by_server_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # then close: like a keep-alive timeout on the replica

    async with server(handler) as (port, accepted):
        pool = pool_for(port)
        first = await pool.request(HEAD, b"{}")
        assert await first.read() == b"ok"
        first.release()
        # The FIN arrives asynchronously: the pool drops the connection when it does.
        await eventually(lambda: not pool._idle, "the closed connection dropped from idle")
        second = await pool.request(HEAD, b"{}")
        assert await second.read() == b"ok"
        second.release()
        pool.close()
    assert accepted[0] == 2


async def test_cancelled_request_closes_its_connection() -> None:
    got_request, got_eof = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        got_request.set()
        await reader.read()  # returns at EOF: the client closed
        got_eof.set()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        task = asyncio.create_task(pool.request(HEAD, b"{}"))
        await asyncio.wait_for(got_request.wait(), 5)  # cancelled waiting for the answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(got_eof.wait(), 5)
        assert not pool._open


async def test_a_closed_connection_is_freed_by_reference_counting() -> None:
    """Upstream connections churn all day (idle drops, ``Connection: close``, aborts). A
    closed one must be freed when it closes, not wait for a full GC pass: the gateway
    makes those rare (``cli.serve``), and the soak's RSS grew while they waited."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        gc.disable()
        try:
            response = await pool.request(HEAD, b"{}")
            conns = [weakref.ref(conn) for conn in pool._open]
            assert len(conns) == 1
            assert await response.read() == b"{}"
            response.release()
            del response
            # connection_lost runs on a later loop pass; gc stays disabled throughout, so
            # only reference counting can free it.
            await eventually(lambda: conns[0]() is None, "the closed connection freed "
                             "without the GC (else it is only reachable by the GC)")  # fmt: skip
        finally:
            gc.enable()
        pool.close()


async def test_large_bodies_sized_and_streamed() -> None:
    """Back-pressure pauses a stream the reader lags behind, never a ``read()``."""
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB
    streaming = asyncio.Event()  # the client took the stream's first chunk

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\n%s\r\n" % big[:1])
        await writer.drain()
        await streaming.wait()
        for i in range(1, len(big), 65536):
            part = big[i : i + 65536]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(handler) as (port, _):
        pool = pool_for(port)
        sized = await pool.request(HEAD, b"{}")
        (conn,) = pool._open
        assert await asyncio.wait_for(sized.read(), 10) == big  # 3 MiB read whole
        assert not conn.paused
        sized.release()
        stream = await pool.request(HEAD, b"{}")
        chunks = stream.content.iter_any()
        received = bytearray(await asyncio.wait_for(anext(chunks), 10))
        streaming.set()
        # The server sends 3 MiB to a reader that reads nothing: the stream pauses reading.
        await eventually(lambda: conn.paused, "the lagging stream paused its connection")
        async for chunk in chunks:
            received += chunk
        assert bytes(received) == big
        assert not conn.paused  # read to the end: reading resumed
        stream.release()
        assert len(pool._idle) == 1
        pool.close()


async def test_reused_connection_dying_later_is_a_reset_not_resent() -> None:
    """Past the keep-alive race (the replica held the request, then died on it), the
    request is not sent to the same replica again: the caller fails over."""
    requests = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        requests[0] += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        requests[0] += 1
        await asyncio.sleep(1.3)  # "generating", then the replica dies

    async with server(handler) as (port, accepted):
        pool = pool_for(port)
        first = await pool.request(HEAD, b"{}")
        assert await first.read() == b"ok"
        first.release()
        with pytest.raises(ResetBeforeResponse):
            await pool.request(HEAD, b"{}")
        assert pool.stale_resends == 0
        pool.close()
    assert accepted[0] == 1 and requests[0] == 2


@pytest.mark.parametrize(
    "headers",
    [b"".join(b"x-%d: 1\r\n" % i for i in range(101)), b"x-big: " + b"a" * (65 << 10) + b"\r\n"],
    ids=["101 headers", "65 KiB"],
)
async def test_response_headers_over_the_limits_are_a_broken_response(headers: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + headers + b"content-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # until the client drops the connection

    async with server(handler) as (port, _):
        pool = pool_for(port)
        with pytest.raises(BrokenResponse, match="response headers over"):
            await pool.request(HEAD, b"{}")
        pool.close()
