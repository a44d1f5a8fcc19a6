"""Differential test of the gateway's fast HTTP path (``gateway.http.server.h1server``)
against plain uvicorn: one corpus of raw requests, over real 127.0.0.1 sockets, to the
same gateway app served twice in front of one simulated replica -- once with
``lean_protocol`` (as ``rollout-gateway serve`` runs it), once with uvicorn's own
``HttpToolsProtocol``.

Both must make the same framing decision: served identically (same statuses, headers and
bodies, less what is per request: ``date``, ``x-request-id``, the completion's ``id`` and
``created``), or refused with the same class of status (4xx / 5xx) and the connection
closed the same way. Each case also pins what the fast path answers, and whether it served
the connection itself or handed it to uvicorn (``fast``), so the corpus provably covers
both sides of that fence and an outcome both get wrong the same way still fails.

Deliberate difference (``drops_answer``): when a well-formed request is pipelined in front
of a malformed one, uvicorn writes its 400 as soon as its parser reaches the bad bytes and
closes, so the answer to the good request in flight is lost. The fast path answers in
order: the good request's response, then the same 400 and close. The framing decision on
each request is the same; answering a request that was read in full is the right one.

Half-close (``shutdown(SHUT_WR)`` after the request) is the client leaving on both sides:
the request is abandoned (a rollout's generation cancelled) and the connection closed.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest
import pytest_asyncio
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.testing import running_sim
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import create_app
from gateway.config import load_settings
from gateway.http.server import uvicorn_private

BODY = json.dumps({"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
LINE = b"POST /v1/completions HTTP/1.1\r\n"
HEAD = LINE + b"host: gw\r\ncontent-type: application/json\r\n"
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
HEALTH = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"
REFUSAL = b"Invalid HTTP request received."  # uvicorn's 400 for what its parser refuses
PER_REQUEST = frozenset({b"date", b"x-request-id"})
# After the expected answers, a connection meant to stay open gets one more request, this
# one: its answer (a rollout of MARKER_TOKENS tokens, which no case asks for) is the
# positive marker that anything extra the server had to say, an answer or a close, has
# been said -- responses come in order. (A quiet wait instead passed whenever the extra
# thing was merely late.) A rollout, so that the fast path keeps the connection.
MARKER_TOKENS = 7
_MARKER_BODY = json.dumps({"model": "tiny-base", "prompt": [1], "max_tokens": MARKER_TOKENS})
MARKER = (
    b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_MARKER_BODY), _MARKER_BODY.encode())
)
DEADLINE_S = 15.0  # per conversation, the whole exchange


def post(body: bytes = BODY, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    """A rollout, Content-Length framed, ``extra`` header lines added."""
    return (
        b"POST /v1/completions HTTP/%s\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (version, len(body), extra, body)
    )


def framed(header: bytes, body: bytes = BODY) -> bytes:
    """A rollout whose framing is exactly ``header`` (one or more lines)."""
    return HEAD + header + b"\r\n" + body


def padded(size: int) -> bytes:
    """A valid rollout body of ``size`` bytes (a long ``user`` field)."""
    base = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2, "user": ""}
    pad = size - len(json.dumps(base, separators=(",", ":")))
    return json.dumps({**base, "user": "u" * pad}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Responses:
    """A step: wait until this many responses arrived (the client waits for its answer)."""

    n: int


Step = bytes | float | Responses  # bytes: one write; float: a pause (s)


@dataclass(frozen=True)
class Case:
    name: str
    steps: Sequence[Step]
    expect: list[int]  # the fast path's statuses, in order
    closed: bool  # the fast path closes the connection (before answering MARKER)
    fast: bool | None  # the fast path served it without handing it to uvicorn (None: either)
    half_close: bool = False  # shutdown(SHUT_WR) after the steps
    drops_answer: bool = False  # the deliberate difference (module docstring)
    reading: bool = False  # the server is still reading the request: MARKER's bytes join it


BIG_HEAD = post(extra=b"x-big: " + b"a" * (70 << 10) + b"\r\n")
# fmt: off
CORPUS = [
    # -- served -----------------------------------------------------------------------
    Case("rollout", [post()], [200], False, True),
    Case("rollout_split_in_request_line", [post()[:10], 0.05, post()[10:]], [200], False, True),
    Case("rollout_split_in_body", [post()[:-10], 0.05, post()[-10:]], [200], False, True),
    Case("cl_leading_zeros", [framed(b"content-length: 000%d\r\n" % len(BODY))],
         [200], False, True),
    Case("body_4mib_at_the_fast_path_bound", [post(padded(4 << 20))], [200], False, True),
    Case("body_over_4mib_streamed_by_uvicorn", [post(padded(5 << 20))], [200], False, False),
    Case("health_not_a_rollout", [HEALTH], [200], False, False),
    Case("get_on_rollout_path", [b"GET /v1/completions HTTP/1.1\r\nhost: gw\r\n\r\n"],
         [405], False, False),
    Case("connection_close", [post(extra=b"connection: close\r\n")], [200], True, True),
    # -- Content-Length / Transfer-Encoding -------------------------------------------
    Case("cl_cl_equal", [post(extra=b"content-length: %d\r\n" % len(BODY))], [400], True, True),
    Case("cl_cl_different", [post(extra=b"content-length: 5\r\n")], [400], True, True),
    Case("cl_list", [framed(b"content-length: %d, %d\r\n" % (len(BODY), len(BODY)))],
         [400], True, True),
    Case("cl_plus_sign", [framed(b"content-length: +%d\r\n" % len(BODY))], [400], True, True),
    Case("cl_negative", [framed(b"content-length: -1\r\n")], [400], True, True),
    Case("cl_overflow", [framed(b"content-length: 99999999999999999999999\r\n")],
         [400], True, True),
    Case("cl_space_before_colon", [framed(b"content-length : %d\r\n" % len(BODY))],
         [400], True, True),
    # OWS after the digits: both parsers frame 48 bytes; the app's read_body refuses it on
    # uvicorn's path, so the fast path hands such a value over instead of guessing.
    Case("cl_trailing_space", [framed(b"content-length: %d \r\n" % len(BODY))],
         [400], False, False),
    Case("no_cl_no_te", [framed(b"", b"")], [400], False, False),  # an empty body: the app's 400
    Case("cl_te", [post(extra=b"transfer-encoding: chunked\r\n", body=CHUNKED)],
         [400], True, True),
    Case("te_chunked", [framed(b"transfer-encoding: chunked\r\n", CHUNKED)], [200], False, False),
    Case("te_chunked_upper", [framed(b"Transfer-Encoding: CHUNKED\r\n", CHUNKED)],
         [200], False, False),
    Case("te_leading_space", [framed(b"transfer-encoding:  chunked\r\n", CHUNKED)],
         [200], False, False),
    Case("te_leading_tab", [framed(b"transfer-encoding:\tchunked\r\n", CHUNKED)],
         [200], False, False),
    Case("te_gzip_chunked", [framed(b"transfer-encoding: gzip, chunked\r\n", CHUNKED)],
         [200], False, False),
    Case("te_chunked_gzip", [framed(b"transfer-encoding: chunked, gzip\r\n", CHUNKED)],
         [400], True, True),
    Case("te_space_before_colon", [framed(b"Transfer-Encoding : chunked\r\n", CHUNKED)],
         [400], True, True),
    Case("te_xchunked", [framed(b"transfer-encoding: xchunked\r\n", CHUNKED)], [400], True, True),
    Case("te_vertical_tab", [framed(b"transfer-encoding: \x0bchunked\r\n", CHUNKED)],
         [400], True, True),
    Case("te_identity", [framed(b"transfer-encoding: identity\r\n")], [400], True, True),
    Case("te_chunked_twice",
         [framed(b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n", CHUNKED)],
         [400], True, True),
    Case("te_header_line_starts_with_space", [framed(b" transfer-encoding: chunked\r\n", CHUNKED)],
         [400], True, True),
    # -- header syntax ----------------------------------------------------------------
    Case("obs_fold", [post(extra=b"x-fold: a\r\n b\r\n")], [400], True, True),
    Case("obs_fold_in_cl", [framed(b"content-length:\r\n %d\r\n" % len(BODY))], [400], True, True),
    Case("bare_lf_everywhere", [post().replace(b"\r\n", b"\n")], [400], True, False),
    Case("bare_lf_in_one_header", [post(extra=b"x-a: 1\nx-b: 2\r\n")], [400], True, True),
    # the head never holds CRLF CRLF: the fast path used to wait for it (no answer until
    # the keep-alive timeout) where uvicorn refuses at once; now it hands such heads over
    Case("bare_lf_ends_the_head", [post(extra=b"x-a: 1\n")], [400], True, False),
    Case("bare_lf_lf_ends_the_head", [framed(b"content-length: %d\n" % len(BODY))],
         [400], True, False),
    Case("empty_header_name", [post(extra=b": x\r\n")], [400], True, True),
    Case("upgrade_h2c_without_connection_upgrade", [post(extra=b"upgrade: h2c\r\n")],
         [200], False, False),
    # uvicorn (ws="none") ignores the upgrade but its parser stops at the head: the body is
    # lost and the app answers 400. The fast path hands these over (it used to crash on
    # httptools' HttpParserUpgrade and drop the connection).
    Case("upgrade_h2c", [post(extra=b"connection: upgrade\r\nupgrade: h2c\r\n")],
         [400], False, False),
    Case("http2_preface", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"], [400], True, False),
    # Both wait for a request line: nothing until more bytes come (MARKER's), then a 400.
    Case("http09", [b"GET /health\r\n"], [], False, False, reading=True),
    # -- heads over 64 KiB (the app's limit is 16 KiB: 431) ---------------------------
    Case("head_40kib_parsed_by_the_fast_path",
         [post(extra=b"x-big: " + b"a" * (40 << 10) + b"\r\n")], [431], False, True),
    Case("head_70kib_one_write", [BIG_HEAD], [431], False, None),  # as the reads fall
    Case("head_70kib_handed_off_incomplete", [BIG_HEAD[: 66 << 10], 0.1, BIG_HEAD[66 << 10 :]],
         [431], False, False),
    # -- HTTP/1.0 ---------------------------------------------------------------------
    Case("http10", [post(version=b"1.0")], [200], True, False),
    Case("http10_keep_alive", [post(version=b"1.0", extra=b"connection: keep-alive\r\n")],
         [200], True, False),  # uvicorn keeps no HTTP/1.0 connection alive
    # -- pipelining and keep-alive ----------------------------------------------------
    Case("pipelined_rollouts", [post() + post()], [200, 200], False, True),
    Case("pipelined_rollout_then_health", [post() + HEALTH], [200, 200], False, False),
    Case("pipelined_after_connection_close",
         [post(extra=b"connection: close\r\n") + post()], [200], True, True),
    Case("pipelined_rollout_then_obs_fold", [post() + post(extra=b"x-fold: a\r\n b\r\n")],
         [200, 400], True, True, drops_answer=True),
    Case("pipelined_rollout_then_garbage", [post() + b"xyz\r\n\r\n"],
         [200, 400], True, False, drops_answer=True),
    # the body is 5 bytes longer than declared: they become the next (malformed) request
    Case("cl_shorter_than_body", [framed(b"content-length: %d\r\n" % (len(BODY) - 5))],
         [400, 400], True, False, drops_answer=True),
    Case("keep_alive_then_cl_te",
         [post(), Responses(1), post(extra=b"transfer-encoding: chunked\r\n", body=CHUNKED)],
         [200, 400], True, True),
    Case("keep_alive_then_health", [post(), Responses(1), HEALTH], [200, 200], False, False),
    # -- Expect: 100-continue (uvicorn's interim answer) ------------------------------
    Case("expect_100_body_sent_at_once", [post(extra=b"expect: 100-continue\r\n")],
         [100, 200], False, False),
    Case("expect_100_body_after_the_100",
         [post(extra=b"expect: 100-continue\r\n")[: -len(BODY)], Responses(1), BODY],
         [100, 200], False, False),
    # -- half-close: EOF is the client leaving; the generation is cancelled, no answer ---
    Case("half_close_after_rollout", [post()], [], True, True, half_close=True),
    Case("half_close_mid_body", [post()[:-5]], [], True, True, half_close=True),
    Case("half_close_after_pipeline", [post() + post()], [], True, True, half_close=True),
]
# fmt: on


Answer = tuple[int, list[tuple[bytes, bytes]], Any]


@dataclass
class Outcome:
    answers: list[Answer] = field(default_factory=list)
    closed: bool = False
    port: int = 0  # the client's port (which connection uvicorn was handed)
    after_marker: list[Answer] = field(default_factory=list)  # ``reading`` cases only
    garbled: str | None = None  # the response bytes did not parse


class _Parser:
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        headers = sorted(h for h in self.headers if h[0] not in PER_REQUEST)
        status = self.parser.get_status_code()
        self.outcome.answers.append((status, headers, _normalized(self.body)))
        self.headers, self.body = [], b""


def _normalized(body: bytes) -> Any:
    """A completion's body less what differs per request (its id and creation time)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if isinstance(data, dict):
        data.pop("id", None)
        data.pop("created", None)
    return data


def _is_marker(answer: Answer) -> bool:
    status, _, body = answer
    usage = body.get("usage") if isinstance(body, dict) else None
    return status == 200 and isinstance(usage, dict) and usage.get("completion_tokens") == 7


async def converse(port: int, case: Case) -> Outcome:
    """Play ``case`` on a new connection; every answer until the server closes (a case
    that expects a close), or until the answer to ``MARKER`` (one that does not)."""
    outcome = Outcome()
    parser = _Parser(outcome)
    arrived = asyncio.Event()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    outcome.port = writer.get_extra_info("sockname")[1]

    async def read() -> None:
        while True:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                data = b""
            if not data:
                outcome.closed = True
                arrived.set()
                return
            try:
                parser.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                outcome.garbled = str(exc)
            arrived.set()

    reading = asyncio.create_task(read())
    sent_marker_after: int | None = None
    try:
        async with asyncio.timeout(DEADLINE_S):
            for step in case.steps:
                if isinstance(step, Responses):
                    while len(outcome.answers) < step.n and not outcome.closed:
                        arrived.clear()
                        await arrived.wait()
                elif isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    writer.write(step)
                    await writer.drain()
            if case.half_close:
                writer.get_extra_info("socket").shutdown(socket.SHUT_WR)
            elif not case.closed:
                while len(outcome.answers) < len(case.expect) and not outcome.closed:
                    arrived.clear()
                    await arrived.wait()
                if not outcome.closed:
                    sent_marker_after = len(outcome.answers)
                    writer.write(MARKER)
                    await writer.drain()
            while not outcome.closed and not any(map(_is_marker, outcome.answers)):
                arrived.clear()
                await arrived.wait()
    except TimeoutError:
        pass  # a close or a marker that never came: the test compares what did
    finally:
        reading.cancel()
        writer.close()
    if case.reading and sent_marker_after is not None:
        # What came after MARKER was about its bytes joined to the case's (never the
        # marker's own 200): kept apart, and the close it brought is not the case's.
        outcome.after_marker = outcome.answers[sent_marker_after:]
        del outcome.answers[sent_marker_after:]
        outcome.closed = False
    elif outcome.answers and _is_marker(outcome.answers[-1]):
        outcome.answers.pop()
    return outcome


@dataclass
class Fronts:
    lean: int
    plain: int
    handed_off: set[int]  # client ports whose connection the fast path gave to uvicorn


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def outcomes() -> AsyncIterator[dict[str, tuple[Outcome, Outcome, bool]]]:
    """Every case on both fronts (a few at a time): name -> (fast path, uvicorn, handed off)."""
    handed_off: set[int] = set()

    class Counting(uvicorn_private.BoundedHttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            handed_off.add(transport.get_extra_info("peername")[1])
            super().connection_made(transport)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uvicorn_private, "BoundedHttpToolsProtocol", Counting)
        async with running_sim() as sim:
            settings = load_settings({"replicas": [str(sim)]}, environ={})
            async with (
                serve_asgi(create_app(settings)) as lean_url,
                serve_asgi(create_app(settings), http=HttpToolsProtocol) as plain_url,
            ):
                lean, plain = (int(u.rsplit(":", 1)[1]) for u in (lean_url, plain_url))
                gate = asyncio.Semaphore(6)

                async def both(case: Case) -> tuple[Outcome, Outcome, bool]:
                    async with gate:
                        a, b = await asyncio.gather(converse(lean, case), converse(plain, case))
                    return a, b, a.port in handed_off

                results = await asyncio.gather(*(both(c) for c in CORPUS))
                yield {c.name: r for c, r in zip(CORPUS, results, strict=True)}


def _decision(answer: Answer) -> tuple[Any, ...]:
    """What must match: a response that serves (1xx-3xx) in full, a refusal by class."""
    status, headers, body = answer
    return (status, headers, body) if status < 400 else (f"{status // 100}xx",)


def test_corpus_names_are_unique() -> None:
    assert len({c.name for c in CORPUS}) == len(CORPUS)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
async def test_same_framing_decision(
    case: Case, outcomes: dict[str, tuple[Outcome, Outcome, bool]]
) -> None:
    lean, plain, handed_off = outcomes[case.name]
    assert lean.garbled is None and plain.garbled is None, (lean.garbled, plain.garbled)
    # what the fast path does, pinned
    assert [s for s, _, _ in lean.answers] == case.expect, lean.answers
    assert lean.closed == case.closed
    if case.fast is not None:
        assert handed_off == (not case.fast), "served by the other side of the fence"
    for status, headers, body in lean.answers:
        if status == 200 and body and not isinstance(body, bytes):
            assert body["object"] == "text_completion", body
            assert (b"x-gateway-replica", b"0") in headers
    if case.reading:  # still reading when MARKER came: it completed a request to refuse
        for side in (lean, plain):
            assert [a[0] for a in side.after_marker] == [400], side.after_marker
    # the same decision as plain uvicorn
    assert plain.closed == lean.closed
    if case.drops_answer:
        assert len(lean.answers) == 2 and lean.answers[-1][0] >= 400
        assert [_decision(a) for a in plain.answers] == [_decision(lean.answers[-1])]
    else:
        assert [_decision(a) for a in plain.answers] == [_decision(a) for a in lean.answers]
    # the server's own refusal is uvicorn's, byte for byte (its default headers included)
    ours_last = lean.answers[len(lean.answers) - len(plain.answers) :]
    for ours, theirs in zip(ours_last, plain.answers, strict=True):
        if ours[2] == REFUSAL:
            assert ours == theirs
