"""``gateway.http.server.exchange``: a rollout takes one code path whichever protocol read it.

A connection whose first request is a probe is handed to uvicorn for the rest of its
life; the rollouts that follow on it must be served by the same ``FastPath.serve`` as
the lean ones, and answered alike (sized and streamed)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest

from gateway.api.fastpath import FastPath
from gateway.http.server.exchange import AsgiExchange, Exchange, LeanExchange
from tests.cluster import cluster
from tests.http.server.test_h1server import Answer, connection, post

SIZED = json.dumps({"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 3}).encode()
STREAMED = json.dumps(
    {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
).encode()
PROBE = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kind of exchange each rollout reached ``FastPath.serve`` with."""
    kinds: list[str] = []
    serve: Callable[[FastPath, Exchange], Awaitable[None]] = FastPath.serve

    async def spy(self: FastPath, exchange: Exchange) -> None:
        kinds.append(type(exchange).__name__)
        await serve(self, exchange)

    monkeypatch.setattr(FastPath, "serve", spy)
    return kinds


def _shape(answer: Answer) -> tuple[int, str, list[str]]:
    """What must match between the two protocols: status, content type, and the body's
    JSON (for a stream, each event's JSON keys and the terminator)."""
    status, headers, body = answer
    kind = headers[b"content-type"].decode().split(";")[0]
    if kind == "text/event-stream":
        events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
        return status, kind, [e.decode() if e == b"[DONE]" else str(sorted(json.loads(e)))
                              for e in events]  # fmt: skip
    return status, kind, sorted(json.loads(body))


async def _answers(*, probe_first: bool) -> list[Answer]:
    async with cluster(2) as c, connection(c) as (reader, writer):
        if probe_first:
            writer.write(PROBE)
            [(status, _, _)] = await reader.responses(1)
            assert status == 200
            reader.done.clear()
        answers = []
        for body in (SIZED, STREAMED, SIZED):
            writer.write(post(body=body))
            answers += await reader.responses(1)
            reader.done.clear()
        return answers


async def test_rollouts_after_a_probe_take_the_same_path(served: list[str]) -> None:
    lean = await _answers(probe_first=False)
    assert served == [LeanExchange.__name__] * 3
    served.clear()
    handed_off = await _answers(probe_first=True)
    assert served == [AsgiExchange.__name__] * 3
    assert [_shape(a) for a in handed_off] == [_shape(a) for a in lean]
    streamed = handed_off[1]
    assert streamed[1].get(b"transfer-encoding") == b"chunked"
    assert streamed[2].endswith(b"data: [DONE]\n\n")
    for status, headers, _ in handed_off:
        assert status == 200 and b"x-gateway-replica" in headers


async def test_refusal_after_a_probe_is_the_same_error() -> None:
    """Bad input on either protocol: the same OpenAI-style 400 body."""
    bad = json.dumps({"model": "tiny-base", "prompt": [1], "max_tokens": "three"}).encode()
    bodies = []
    for probe_first in (False, True):
        async with cluster(1) as c, connection(c) as (reader, writer):
            if probe_first:
                writer.write(PROBE)
                await reader.responses(1)
                reader.done.clear()
            writer.write(post(body=bad))
            [(status, _, body)] = await reader.responses(1)
            assert status == 400
            bodies.append(json.loads(body))
            assert bodies[-1].pop("request_id")  # each request's own (``X-Request-Id``)
    assert bodies[0] == bodies[1]
    assert bodies[0]["error"]["param"] == "max_tokens"
