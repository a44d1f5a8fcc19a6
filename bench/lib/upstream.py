"""The instant fake vLLM upstream: raw asyncio + uvloop, keep-alive, answers in order.

A benchmark of a front must measure the front, so the upstream does nothing: ``GET
/health`` -> 200; a body with ``"stream": true`` -> 16 vLLM-shaped SSE token events and
``data: [DONE]``, each event its own HTTP chunk and its own
``write()``, like a token flush; anything else -> one canned ~0.9 KB completion. (The
FastAPI sim replica serves ~800 req/s on the 2-core machine, below every front, so it
cannot be the upstream of a throughput benchmark.)

    python -m bench.lib.upstream --port 9101
"""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import Callable

import orjson
import uvloop

STREAM_TOKENS = 16
LOCAL = "127.0.0.1"

BODY = orjson.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "tiny-base",
        "choices": [
            {
                "index": 0,
                "text": "x" * 600,
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": list(range(40)),
            }
        ],
        "usage": {"prompt_tokens": 200, "completion_tokens": 16, "total_tokens": 216},
    }
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)
HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
_STREAM_FLAG = re.compile(rb'"stream"\s*:\s*true')


def sse_chunks() -> list[bytes]:
    """One streaming response as separate writes: headers + event 1, events 2..16, [DONE]."""
    events = []
    for i in range(STREAM_TOKENS):
        last = i == STREAM_TOKENS - 1
        choice = {
            "index": 0,
            "text": " tok",
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
            "token_ids": [1000 + i],
        }
        event = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "tiny-base",
            "choices": [choice],
        }
        events.append(b"data: " + orjson.dumps(event) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    chunks = [f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    chunks[0] = head + chunks[0]
    chunks[-1] += b"0\r\n\r\n"
    return chunks


def next_request(buf: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(lower-cased head, body, rest of ``buf``) of the first complete request in
    ``buf`` (``Content-Length`` framing only: the load clients send nothing else)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].lower()
    length = 0
    marker = head.find(b"content-length:")
    if marker >= 0:
        line_end = head.find(b"\r\n", marker)
        length = int(head[marker + 15 : line_end if line_end > 0 else None])
    total = end + 4 + length
    if len(buf) < total:
        return None
    return head, buf[end + 4 : total], buf[total:]


class Upstream(asyncio.Protocol):
    """One connection: parses just enough HTTP/1.1 to answer each request in order."""

    stream_chunks: list[bytes] = sse_chunks()

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        assert self.transport is not None
        while (request := next_request(self.buf)) is not None:
            head, body, self.buf = request
            if head.startswith(b"get /health"):
                self.transport.write(HEALTH)
            elif _STREAM_FLAG.search(body):
                for chunk in self.stream_chunks:  # one write per SSE event, like a token flush
                    self.transport.write(chunk)
            else:
                self.transport.write(RESPONSE)


async def serve_forever(factory: Callable[[], asyncio.Protocol], port: int) -> None:
    """A protocol server on 127.0.0.1:``port`` until the process is stopped."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, LOCAL, port, backlog=2048)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(serve_forever(Upstream, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
