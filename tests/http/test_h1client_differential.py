"""Differential test of ``gateway.http.h1client`` against aiohttp: one corpus of scripted upstream
responses (a raw asyncio server on 127.0.0.1 writing exact bytes), each fetched twice by
``H1Pool`` and twice by an ``aiohttp.ClientSession`` (the second time on the connection
the first left, if it was kept: a response that desynchronised it shows there).

Both must give the same result: the same status, raw headers and body bytes, or a failure
that the gateway maps to the same error (``ReplicaConnectError``: retried elsewhere,
``UpstreamTimeout``, ``UpstreamError``). h1client's failures must be its documented types
(``ResetBeforeResponse``, ``BrokenResponse``, ``TimeoutError``), mapped as
``Upstream.send_routed`` maps them; aiohttp's are mapped by ``upstream.map_errors``, as the
gateway's control plane maps them. Never an unexpected exception, never a hang.

Where aiohttp is lenient or strict in a way a proxy should not be, the case says what
aiohttp gives (``aiohttp=``) and why h1client's answer is the right one for the gateway.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from gateway.errors import GatewayError
from gateway.http.h1client import H1Pool
from gateway.http.h1response import BrokenResponse, ResetBeforeResponse
from gateway.http.upstream import map_errors


class Close:
    """A step: close the connection (FIN)."""


class Reset:
    """A step: reset the connection (RST, SO_LINGER 0)."""


CLOSE, RESET = Close(), Reset()
Step = bytes | float | Close | Reset  # bytes: one write; float: a pause (s)
Result = tuple[Any, ...]  # ("ok", status, raw headers, body) or (mapped error name,)

# Both clients: no byte for this long is a timeout. The scripted server shares the clients'
# loop, so a loop stall longer than this between one of a script's pauses (0.1 s at most)
# and its next write reads as a timeout: CI once stalled ~1 s and turned three of them into
# UpstreamTimeout at 1.0 s. 3 s leaves a 30x margin and costs the timeout cases ~4 s.
READ_TIMEOUT_S = 3.0
BOUND_S = 8.0  # any one request, headers and body: longer is a hang


def ok(status: int, body: bytes, *headers: tuple[bytes, bytes]) -> Result:
    """A response; header values compared without OWS (aiohttp strips it, llhttp not)."""
    return ("ok", status, tuple((n, v.strip(b" \t")) for n, v in headers), body)


RETRY = ("ReplicaConnectError",)  # the replica produced nothing: safe to retry elsewhere
BROKEN = ("UpstreamError",)  # 502 to the client, never retried
TIMEOUT = ("UpstreamTimeout",)
HANG = ("hang",)  # no result within BOUND_S (then the case is not tried a second time)

CL2: tuple[bytes, bytes] = (b"content-length", b"2")
TE: tuple[bytes, bytes] = (b"transfer-encoding", b"chunked")


def head(status: bytes, *headers: tuple[bytes, bytes]) -> bytes:
    return b"HTTP/1.1 %s\r\n%s\r\n" % (status, b"".join(b"%s: %s\r\n" % h for h in headers))


OK_2 = head(b"200 OK", CL2) + b"ok"
CHUNKED = head(b"200 OK", TE)
MANY = [(b"x-%d" % i, b"1") for i in range(128)]


@dataclass(frozen=True)
class Case:
    name: str
    script: Sequence[Step]  # played for each request on a connection
    expect: Result  # h1client's result (and aiohttp's, unless ``aiohttp`` says otherwise)
    aiohttp: Result | None = None  # a deliberate difference: what aiohttp gives instead


# fmt: off
CORPUS = [
    Case("content_length", [OK_2], ok(200, b"ok", CL2)),
    Case("content_length_with_ows", [head(b"200 OK", (b"content-length", b"2 ")) + b"ok"],
         ok(200, b"ok", CL2)),
    # -- chunked bodies: extensions, trailers ------------------------------------------
    Case("chunked_with_extensions",
         [CHUNKED + b'5;name=val\r\nhello\r\n3;a="b c";x\r\nabc\r\n0\r\n\r\n'],
         ok(200, b"helloabc", TE)),
    Case("chunked_extension_on_last_chunk", [CHUNKED + b"5\r\nhello\r\n0;done\r\n\r\n"],
         ok(200, b"hello", TE)),
    Case("chunked_with_trailers", [CHUNKED + b"5\r\nhello\r\n0\r\nx-trailer: v\r\nx-2: w\r\n\r\n"],
         ok(200, b"hello", TE)),  # trailers are no headers (h1client used to add them)
    Case("chunked_upper_hex_and_zeros",
         [CHUNKED + b"A\r\n0123456789\r\n005\r\nhello\r\n000\r\n\r\n"],
         ok(200, b"0123456789hello", TE)),
    Case("chunked_in_pieces",
         [CHUNKED + b"5\r\nhel", 0.05, b"lo\r\n3\r\nabc\r", 0.05, b"\n0\r\n\r\n"],
         ok(200, b"helloabc", TE)),
    Case("chunked_then_close", [CHUNKED + b"5\r\nhello\r\n", 0.05, b"0\r\n\r\n", CLOSE],
         ok(200, b"hello", TE)),
    # -- bad chunk sizes -----------------------------------------------------------------
    Case("chunk_size_not_hex", [CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n"], BROKEN),
    Case("chunk_size_negative", [CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n"], BROKEN),
    Case("chunk_size_0x", [CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n"], BROKEN),
    Case("chunk_size_overflow", [CHUNKED + b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n"], BROKEN),
    Case("chunk_size_bare_lf", [CHUNKED + b"5\nhello\n0\n\n"], BROKEN),
    Case("chunk_data_longer_than_size", [CHUNKED + b"2\r\nabc\r\n0\r\n\r\n"], BROKEN),
    # RFC 9112 §7.1: chunk-size is 1*HEXDIG; whitespace is allowed only before a ';'
    # extension. aiohttp reads "5 " as 5; the gateway refuses a size it would have to guess.
    Case("chunk_size_trailing_space", [CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n"], BROKEN,
         aiohttp=ok(200, b"hello", TE)),
    # -- 1xx ------------------------------------------------------------------------------
    Case("100_then_200", [head(b"100 Continue"), 0.05, OK_2], ok(200, b"ok", CL2)),
    Case("100_and_200_in_one_write", [head(b"100 Continue") + OK_2], ok(200, b"ok", CL2)),
    # an interim response's headers are not the response's (h1client used to merge them)
    Case("103_then_200", [head(b"103 Early Hints", (b"link", b"</a>; rel=preload")) + OK_2],
         ok(200, b"ok", CL2)),
    # h1client used to answer with the 103 itself when the 200 came in a later read
    Case("two_103_then_200_later",
         [head(b"103 Early Hints", (b"link", b"</a>")) + head(b"103 Early Hints"), 0.05, OK_2],
         ok(200, b"ok", CL2)),
    # No request asks for an upgrade: a 101 would hand the connection to another protocol.
    # aiohttp returns it as a response; h1client refuses it (it used to crash inside the
    # parser callback, httptools' HttpParserUpgrade, and answer an empty 101).
    Case("101_switching_protocols",
         [head(b"101 Switching Protocols", (b"upgrade", b"h2c"), (b"connection", b"upgrade")),
          CLOSE],
         BROKEN, aiohttp=ok(101, b"", (b"upgrade", b"h2c"), (b"connection", b"upgrade"))),
    # A long run of interim responses (150 KB): h1client's bound on the head, interim ones
    # included, ends it at once; aiohttp gives no answer at all (not even its timeout).
    Case("endless_1xx", [head(b"100 Continue") * 6000], BROKEN, aiohttp=HANG),
    # -- 204 and 304: no body, whatever Content-Length says ------------------------------
    Case("204_with_content_length", [head(b"204 No Content", (b"content-length", b"5"))],
         ok(204, b"", (b"content-length", b"5"))),
    Case("304_with_content_length", [head(b"304 Not Modified", (b"content-length", b"5"))],
         ok(304, b"", (b"content-length", b"5"))),
    Case("204_without_headers", [head(b"204 No Content")], ok(204, b"")),
    # Bytes behind a complete response (here: a 204 "body") are no part of it: h1client
    # answers the 204 and closes the connection (never reused). aiohttp reads the bytes as
    # the next status line and fails the 204 it had already read in full.
    Case("204_followed_by_bytes", [head(b"204 No Content", (b"content-length", b"5")) + b"hello"],
         ok(204, b"", (b"content-length", b"5")), aiohttp=BROKEN),
    # -- no length: the body ends with the close ----------------------------------------
    Case("no_length_ended_by_close", [head(b"200 OK") + b"all of it", CLOSE],
         ok(200, b"all of it")),
    Case("no_length_http10", [b"HTTP/1.0 200 OK\r\n\r\nall of it", CLOSE], ok(200, b"all of it")),
    Case("no_length_never_closed", [head(b"200 OK") + b"all of it"], TIMEOUT),
    # A body ended by the close is whole only if the close is clean; after a reset nobody
    # can tell whether it was cut. aiohttp returns what it had; h1client fails it.
    Case("no_length_ended_by_reset", [head(b"200 OK") + b"all of it", 0.05, RESET], BROKEN,
         aiohttp=ok(200, b"all of it")),
    # -- oversized headers: h1client allows 100 headers and 64 KiB of names and values ----
    Case("100_headers", [head(b"200 OK", *MANY[:99], CL2) + b"ok"],
         ok(200, b"ok", *MANY[:99], CL2)),
    Case("129_headers", [head(b"200 OK", *MANY, CL2) + b"ok"], BROKEN),
    # aiohttp's limits are 128 headers and 8190 bytes a line; h1client's, 100 headers and
    # 64 KiB in all (what it holds per response). Between the two, they differ both ways:
    Case("101_headers", [head(b"200 OK", *MANY[:100], CL2) + b"ok"], BROKEN,
         aiohttp=ok(200, b"ok", *MANY[:100], CL2)),
    Case("70_kib_in_10_headers",
         [head(b"200 OK", *[(b"x-%d" % i, b"a" * 7000) for i in range(10)], CL2) + b"ok"],
         BROKEN, aiohttp=ok(200, b"ok", *[(b"x-%d" % i, b"a" * 7000) for i in range(10)], CL2)),
    Case("one_10_kib_header", [head(b"200 OK", (b"x-big", b"a" * 10240), CL2) + b"ok"],
         ok(200, b"ok", (b"x-big", b"a" * 10240), CL2), aiohttp=BROKEN),
    Case("10_kib_status_line",
         [b"HTTP/1.1 200 " + b"O" * 10240 + b"\r\ncontent-length: 2\r\n\r\nok"],
         ok(200, b"ok", CL2), aiohttp=BROKEN),
    Case("one_65_kib_header", [head(b"200 OK", (b"x-big", b"a" * (65 << 10)), CL2) + b"ok"],
         BROKEN),
    # httptools holds a header until its end: h1client used to buffer an endless one (the
    # bytes kept coming, so not even its read timeout ended it)
    Case("endless_header", [b"HTTP/1.1 200 OK\r\nx-big: ", *[b"a" * 65536, 0.02] * 40], BROKEN),
    # -- early close -----------------------------------------------------------------------
    Case("close_before_any_byte", [CLOSE], RETRY),
    # A response byte arrived: the replica took the request. aiohttp (as the gateway maps
    # it) calls that retryable; h1client never sends a request a replica began to answer
    # anywhere else (its ResetBeforeResponse means: no byte at all).
    Case("close_mid_status_line", [b"HTTP/1.1 20", CLOSE], BROKEN, aiohttp=RETRY),
    Case("close_mid_headers", [b"HTTP/1.1 200 OK\r\ncontent-len", CLOSE], BROKEN, aiohttp=RETRY),
    Case("close_after_headers", [head(b"200 OK", (b"content-length", b"10")), CLOSE], BROKEN),
    Case("close_mid_body", [head(b"200 OK", (b"content-length", b"10")) + b"abc", CLOSE], BROKEN),
    Case("reset_mid_body", [head(b"200 OK", (b"content-length", b"10")) + b"abc", 0.05, RESET],
         BROKEN),
    Case("close_mid_chunk", [CHUNKED + b"a\r\nabc", CLOSE], BROKEN),
    Case("close_between_chunks", [CHUNKED + b"3\r\nabc\r\n", CLOSE], BROKEN),
    Case("close_before_the_last_crlf", [CHUNKED + b"3\r\nabc\r\n0\r\n", CLOSE], BROKEN),
    Case("chunk_larger_than_what_came", [CHUNKED + b"fffffff\r\nhello", CLOSE], BROKEN),
    Case("silent_replica", [], TIMEOUT),
    # -- Content-Length mismatch and conflicts --------------------------------------------
    Case("fewer_bytes_than_declared", [head(b"200 OK", (b"content-length", b"10")) + b"abc"],
         TIMEOUT),
    # More bytes than declared: as for the 204 above, the response stands, the connection
    # is closed; aiohttp fails the whole response.
    Case("more_bytes_than_declared", [OK_2 + b"EXTRA"], ok(200, b"ok", CL2), aiohttp=BROKEN),
    # A whole second response behind the first (a desynchronised replica): h1client used
    # to append its headers and body to the first ("okevil", set-cookie included).
    Case("second_response_behind_the_first",
         [OK_2 + head(b"200 OK", (b"content-length", b"4"), (b"set-cookie", b"evil=1")) + b"evil"],
         ok(200, b"ok", CL2)),
    Case("content_length_twice_equal", [head(b"200 OK", CL2, CL2) + b"ok"], BROKEN),
    Case("content_length_twice_different",
         [head(b"200 OK", CL2, (b"content-length", b"3")) + b"ok"],
         BROKEN),
    Case("content_length_list", [head(b"200 OK", (b"content-length", b"2, 2")) + b"ok"], BROKEN),
    Case("content_length_plus", [head(b"200 OK", (b"content-length", b"+2")) + b"ok"], BROKEN),
    Case("content_length_and_chunked", [head(b"200 OK", CL2, TE) + b"5\r\nhello\r\n0\r\n\r\n"],
         BROKEN),
    # -- transfer codings other than chunked ---------------------------------------------
    # Transfer-Encoding is hop-by-hop: the gateway drops it and relays the bytes, so it can
    # relay only a body whose one transfer coding is chunked. aiohttp (auto_decompress off,
    # as the gateway runs it) hands over still-gzip-coded bytes, or reads to the close.
    Case("gzip_then_chunked", [head(b"200 OK", (b"transfer-encoding", b"gzip, chunked"))
                               + b"5\r\nhello\r\n0\r\n\r\n"],
         BROKEN, aiohttp=ok(200, b"hello", (b"transfer-encoding", b"gzip, chunked"))),
    Case("chunked_then_gzip", [head(b"200 OK", (b"transfer-encoding", b"chunked, gzip"))
                               + b"5\r\nhello\r\n0\r\n\r\n", CLOSE],
         BROKEN, aiohttp=ok(200, b"5\r\nhello\r\n0\r\n\r\n",
                            (b"transfer-encoding", b"chunked, gzip"))),
    Case("xchunked", [head(b"200 OK", (b"transfer-encoding", b"xchunked")) + b"hello", CLOSE],
         BROKEN, aiohttp=ok(200, b"hello", (b"transfer-encoding", b"xchunked"))),
    # RFC 9112 §6.1: chunked is never applied twice
    Case("chunked_twice", [head(b"200 OK", TE, TE) + b"5\r\nhello\r\n0\r\n\r\n"], BROKEN,
         aiohttp=ok(200, b"hello", TE, TE)),
    # -- syntax ---------------------------------------------------------------------------
    # RFC 9112 §5.2: a proxy may answer obs-fold with 502; aiohttp unfolds it
    Case("obs_fold", [b"HTTP/1.1 200 OK\r\nx-a: 1\r\n 2\r\ncontent-length: 2\r\n\r\nok"], BROKEN,
         aiohttp=ok(200, b"ok", (b"x-a", b"1 2"), CL2)),
    # bare LF line ends: llhttp (strict) refuses them, aiohttp accepts them
    Case("bare_lf", [b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok"], BROKEN,
         aiohttp=ok(200, b"ok", CL2)),
    Case("nul_in_value", [head(b"200 OK", (b"x-a", b"a\x00b"), CL2) + b"ok"], BROKEN),
    Case("bare_cr_in_value", [head(b"200 OK", (b"x-a", b"a\rb"), CL2) + b"ok"], BROKEN),
    Case("space_in_name", [head(b"200 OK", (b"x a", b"1"), CL2) + b"ok"], BROKEN),
    Case("four_digit_status", [head(b"2000 OK", CL2) + b"ok"], BROKEN),
    Case("http2_status_line", [b"HTTP/2 200\r\ncontent-length: 2\r\n\r\nok"], BROKEN),
    Case("not_http", [b"garbage\r\n\r\n"], BROKEN),
    Case("unknown_status", [head(b"999 Odd", CL2) + b"ok"], ok(999, b"ok", CL2)),
    Case("head_in_pieces", [b"HTTP/1.1 200 OK\r\n", 0.1, b"content-length: 2\r\n\r\n", 0.1, b"ok"],
         ok(200, b"ok", CL2)),
]
# fmt: on
CASES = {case.name: case for case in CORPUS}


async def _play(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection: for each request (``POST /<case>``), the case's script."""
    try:
        while True:
            request = await reader.readuntil(b"\r\n\r\n")
            case = CASES[request.split(b" ")[1][1:].decode()]
            length = next(
                int(line.split(b":")[1])
                for line in request.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)
            for step in case.script:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    if isinstance(step, Reset):
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        writer.transport.abort()
                    return
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _gateway_error(exc: BaseException) -> Result:
    return (type(exc).__name__,)


async def _h1client(port: int, case: Case) -> tuple[list[Result], list[int | None], int]:
    """The case twice through one ``H1Pool``, mapped as ``Upstream.send_routed`` maps it;
    also the ``content_length`` it reported, and the connections left open."""
    pool = H1Pool(0, "127.0.0.1", port, read_timeout_s=READ_TIMEOUT_S)
    head = b"POST /%s HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n" % case.name.encode()
    results: list[Result] = []
    lengths: list[int | None] = []
    try:
        for _ in range(2):
            try:
                async with asyncio.timeout(BOUND_S):
                    response = await pool.request(head, b"{}")
                    try:
                        body = await response.read()
                    finally:
                        response.close()
            except ResetBeforeResponse:  # documented, and mapped as send_routed maps them
                results.append(RETRY)
            except TimeoutError as exc:  # asyncio.timeout's has no message: a hang
                results.append(TIMEOUT if exc.args else HANG)
            except BrokenResponse:
                results.append(BROKEN)
            else:
                results.append(ok(response.status, body, *response.raw_headers))
                lengths.append(response.content_length)
            if results[-1] == HANG:
                break
            await asyncio.sleep(0.02)  # the next request finds the connection as it was left
        return results, lengths, len(pool._open)
    finally:
        pool.close()


async def _aiohttp(port: int, case: Case) -> list[Result]:
    """The case twice through one ``ClientSession`` set up as ``upstream.make_session``'s
    (no decompression), errors mapped by ``upstream.map_errors``."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S)
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        for _ in range(2):
            try:
                async with asyncio.timeout(BOUND_S):
                    with map_errors(0, sending=True):
                        response = await session.post(
                            f"http://127.0.0.1:{port}/{case.name}", data=b"{}"
                        )
                    try:
                        with map_errors(0, sending=False):
                            body = await response.read()
                    finally:
                        response.release()
            except GatewayError as exc:
                results.append(_gateway_error(exc))
            except TimeoutError:
                results.append(HANG)
            else:
                results.append(ok(response.status, body, *response.raw_headers))
            if results[-1] == HANG:
                break
            await asyncio.sleep(0.02)
    return results


Outcomes = dict[str, tuple[tuple[list[Result], list[int | None], int], list[Result]]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def outcomes() -> AsyncIterator[Outcomes]:
    server = await asyncio.start_server(_play, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gate = asyncio.Semaphore(8)

    async def both(case: Case) -> tuple[tuple[list[Result], list[int | None], int], list[Result]]:
        async with gate:
            return await asyncio.gather(_h1client(port, case), _aiohttp(port, case))

    try:
        results = await asyncio.gather(*(both(c) for c in CORPUS))
        yield {c.name: r for c, r in zip(CORPUS, results, strict=True)}
    finally:
        server.close()
        await server.wait_closed()


def test_corpus_names_are_unique() -> None:
    assert len(CASES) == len(CORPUS)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
async def test_same_result_or_a_clean_mapped_error(case: Case, outcomes: Outcomes) -> None:
    (h1, lengths, still_open), theirs = outcomes[case.name]
    assert h1 == [case.expect] * 2, "h1client"  # the second on what the first left
    aio = case.aiohttp or case.expect
    assert theirs == [aio] * (1 if aio == HANG else 2), "aiohttp"
    if case.aiohttp is not None:  # a deliberate difference is a real one
        assert case.aiohttp != case.expect
    assert still_open <= 1
    if h1[0][0] == "ok" and h1[0][1] in (204, 304):
        assert lengths == [0, 0]  # no body: a sized, empty response, never a stream
