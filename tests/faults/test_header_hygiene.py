"""Header hygiene over raw sockets: what reaches the replica, what reaches the client.

The replica here is the harness's echo replica (a raw-socket process that answers with the
request line and headers it received, ``Authorization`` as a digest) so the test sees
exactly what the gateway put on the wire. Requests are written byte for byte, which is
the only way to send what a well-behaved client library refuses to: bare CR or LF inside a
header value, obsolete line folding, NUL bytes.

* Hop-by-hop request headers (``Connection`` and every header it names, ``Keep-Alive``,
  ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``, ``Expect``) never reach the replica;
  neither does the client's ``Host`` (the replica sees its own host:port) nor the client's
  ``Authorization`` (the upstream token is injected instead); end-to-end headers pass.
* Hop-by-hop response headers never reach the client; the replica cannot set the
  gateway's ``X-Request-Id`` / ``X-Gateway-Replica``.
* CR/LF injection is refused with 400 and nothing of it reaches the replica or the
  response headers; an ``X-Request-Id`` that is not a plain token is replaced.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import CLIENT_KEY, UPSTREAM_TOKEN
from tests.faults.procs import Fleet, digest, fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")

BODY = b'{"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def f(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    async with fleet(tmp_path_factory.mktemp("hygiene"), 1, echo=True) as fl:
        yield fl


def _request(extra: bytes, path: bytes = b"/v1/completions", method: bytes = b"POST") -> bytes:
    body = BODY if method == b"POST" else b""
    return (
        method + b" " + path + b" HTTP/1.1\r\nHost: attacker.example:666\r\n"
        b"Authorization: Bearer " + CLIENT_KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\n" + extra +
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


async def _raw(f: Fleet, data: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send ``data``, read one whole response: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", f.gateway.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head[:-4].decode("latin-1").split("\r\n")
            headers = [(k.lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines[1:])]
            length = int(next((v for k, v in headers if k == "content-length"), "0"))
            body = await reader.readexactly(length)
    finally:
        writer.transport.abort()
    f.capture.add_raw("raw", head + body)
    return int(lines[0].split(" ")[1]), headers, body


async def _seen(f: Fleet) -> list[dict[str, Any]]:
    """Every request the echo replica received so far."""
    r = await f.control.get(f"{f.sims[0].url}/echo/requests")
    seen: list[dict[str, Any]] = r.json()
    return seen


def _names(headers: list[tuple[str, str]] | list[list[str]]) -> list[str]:
    return [h[0].lower() for h in headers]


async def test_hop_by_hop_host_and_auth_are_not_forwarded(f: Fleet) -> None:
    extra = (
        b"Connection: keep-alive, X-Hop-Req\r\nX-Hop-Req: must-not-pass\r\n"
        b"Keep-Alive: timeout=5\r\nTE: trailers\r\nTrailer: X-Checksum\r\n"
        b"Upgrade: h2c\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Connection: keep-alive\r\nX-End-To-End: passes\r\nX-Request-Id: trace-42\r\n"
    )
    status, headers, body = await _raw(f, _request(extra))
    assert status == 200, body
    echoed = json.loads(body)
    sent = dict((k.lower(), v) for k, v in echoed["headers"])
    assert _names(echoed["headers"]).count("host") == 1
    assert sent["host"] == f"127.0.0.1:{f.sims[0].port}"  # the replica's own
    for name in ("connection", "x-hop-req", "keep-alive", "te", "trailer", "upgrade",
                 "proxy-authorization", "proxy-connection", "transfer-encoding"):  # fmt: skip
        assert name not in sent, (name, sent)
    assert sent["authorization"] == digest(f"Bearer {UPSTREAM_TOKEN}")  # injected, not ours
    assert _names(echoed["headers"]).count("authorization") == 1
    assert sent["x-end-to-end"] == "passes" and sent["x-request-id"] == "trace-42"
    assert sent["content-length"] == str(len(BODY)) and echoed["body"] == BODY.decode()

    # Response: the replica's hop-by-hop headers are gone, its end-to-end ones pass, and
    # the gateway's own headers are the gateway's, once each.
    names = _names(headers)
    for name in ("connection", "x-hop-resp", "keep-alive", "proxy-authenticate",
                 "proxy-connection", "trailer", "transfer-encoding"):  # fmt: skip
        assert name not in names, (name, headers)
    assert ("x-echo-custom", "kept") in headers
    assert [v for k, v in headers if k == "x-request-id"] == ["trace-42"]
    assert [v for k, v in headers if k == "x-gateway-replica"] == ["0"]
    assert names.count("content-length") == 1


async def test_expect_continue_is_answered_here_not_forwarded(f: Fleet) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", f.gateway.port)
    try:
        head, _, body = _request(b"Expect: 100-continue\r\n").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        async with asyncio.timeout(5):
            interim = await reader.readuntil(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100"), interim
            writer.write(body)
            response = await reader.readuntil(b"}")  # the echo's JSON object ends the body
    finally:
        writer.transport.abort()
    f.capture.add_raw("expect", interim + response)
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    last = (await _seen(f))[-1]
    assert "expect" not in _names(last["headers"])


@pytest.mark.parametrize(
    "injection",
    [
        pytest.param(b"X-Note: a\rInjected: yes\r\n", id="bare-CR-in-value"),
        pytest.param(b"X-Note: a\nInjected: yes\r\n", id="bare-LF-in-value"),
        pytest.param(b"X-Request-Id: abc\r\n Injected: yes\r\n", id="obs-fold-request-id"),
        pytest.param(b"X-Request-Id: abc\rInjected: yes\r\n", id="CR-in-request-id"),
        pytest.param(b"X-Note: a\x00Injected: yes\r\n", id="NUL-in-value"),
    ],
)
async def test_crlf_injection_is_refused_and_reaches_nobody(f: Fleet, injection: bytes) -> None:
    before = len(await _seen(f))
    status, headers, body = await _raw(f, _request(injection))
    assert status == 400, (status, body)
    assert not any("injected" in k or "injected" in v.lower() for k, v in headers)
    assert len(await _seen(f)) == before, "the malformed request reached the replica"
    # The connection was closed, the gateway still serves.
    status, _, _ = await _raw(f, _request(b""))
    assert status == 200


@pytest.mark.parametrize(
    "given",
    [b"abc%0d%0aInjected:%20yes", b"abc Injected: yes", b"x" * 200, b"\xc3\xa9t\xc3\xa9"],
    ids=["percent-encoded-CRLF", "spaces", "too-long", "non-ascii"],
)
async def test_odd_request_ids_are_replaced_not_echoed(f: Fleet, given: bytes) -> None:
    status, headers, body = await _raw(f, _request(b"X-Request-Id: " + given + b"\r\n"))
    assert status == 200, body
    ours = [v for k, v in headers if k == "x-request-id"]
    assert len(ours) == 1 and ours[0] != given.decode("latin-1")
    assert ours[0].isalnum() and ours[0].isascii()
    sent = dict((k.lower(), v) for k, v in json.loads(body)["headers"])
    assert sent["x-request-id"] == ours[0]  # the replica got the same, clean id


async def test_encoded_crlf_in_the_path_never_becomes_a_header(f: Fleet) -> None:
    before = len(await _seen(f))
    path = b"/version%0D%0AInjected:%20yes"
    status, headers, body = await _raw(f, _request(b"", path=path, method=b"GET"))
    assert not any("injected" in k for k, _ in headers), headers
    forwarded = (await _seen(f))[before:]
    # Today Starlette's catch-all route does not match a decoded path holding a newline
    # (404, plain text); if it is ever forwarded, it must go as the encoded bytes it came.
    assert status == (200 if forwarded else 404), (status, body)
    for request in forwarded:
        assert request["target"] == path.decode(), request
        assert "injected" not in _names(request["headers"]), request
