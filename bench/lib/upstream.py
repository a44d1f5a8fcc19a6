"""The instant fake vLLM upstream: raw asyncio + uvloop, keep-alive, answers in order.

A benchmark of a front must measure the front, so the upstream does nothing: ``GET
/health`` -> 200; a body with ``"stream": true`` -> 16 vLLM-shaped SSE token events and
``data: [DONE]``, each event its own HTTP chunk and its own
``write()``, like a token flush; anything else -> one canned ~0.9 KB completion. (The
FastAPI sim replica serves ~800 req/s on the 2-core machine, below every front, so it
cannot be the upstream of a throughput benchmark.)

Saturating mode (``--service-ms S --concurrency C``, issue 28): the fake behaves like a
replica with a fixed capacity, C/S requests per second. At most C completions are "being
generated" at once, each answered S ms after its slot was granted; the rest wait in one
FIFO queue for the whole process, whichever connection they came on, as requests wait in
vLLM's scheduler when its batch is full. Its CPU per request stays small (a timer and a
write), so what saturates is the modelled capacity, not the fake's core, and a front that
sends a replica more than its share sees that replica's queue grow. ``/health`` never
queues.

    python -m bench.lib.upstream --port 9101
    python -m bench.lib.upstream --port 9101 --service-ms 4 --concurrency 56   # 14k req/s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

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


class Timers(Protocol):
    """What ``Capacity`` needs of a clock: the running loop in the fake, a manual one in
    its tests (``tests/bench/test_saturating.py``), so no test races a real service time."""

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> object: ...


class Capacity:
    """One replica's modelled capacity: ``concurrency`` slots, each held ``service_s`` per
    request, and the FIFO queue of requests waiting for a slot (every connection's).
    ``timers`` defaults to the running loop, read at the first request."""

    def __init__(self, service_s: float, concurrency: int, timers: Timers | None = None) -> None:
        self.service_s = service_s
        self.free = concurrency
        self.waiting: collections.deque[Callable[[], None]] = collections.deque()
        self.timers = timers
        self.served = 0
        self.max_waiting = 0

    def submit(self, answer: Callable[[], None]) -> None:
        """``answer()`` once a slot was granted and ``service_s`` has passed."""
        if self.free > 0:
            self.free -= 1
            self._start(answer)
        else:
            self.waiting.append(answer)
            self.max_waiting = max(self.max_waiting, len(self.waiting))

    def _start(self, answer: Callable[[], None]) -> None:
        if self.timers is None:
            self.timers = asyncio.get_running_loop()
        self.timers.call_later(self.service_s, self._done, answer)

    def _done(self, answer: Callable[[], None]) -> None:
        self.served += 1
        answer()
        if self.waiting:  # the slot passes straight to the longest waiter
            self._start(self.waiting.popleft())
        else:
            self.free += 1


class SaturatingUpstream(Upstream):
    """``Upstream`` whose completions go through a shared ``Capacity``. A connection's
    answers still leave in the order its requests came: each waits on the one before."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__()
        self.capacity = capacity
        # One box per request, in order: [chunks] once answerable, [None] until then.
        self.pending: collections.deque[list[list[bytes] | None]] = collections.deque()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (request := next_request(self.buf)) is not None:
            head, body, self.buf = request
            if head.startswith(b"get /health"):
                self.pending.append([[HEALTH]])
                self._flush()
                continue
            box: list[list[bytes] | None] = [None]
            self.pending.append(box)
            chunks = self.stream_chunks if _STREAM_FLAG.search(body) else [RESPONSE]
            self.capacity.submit(partial(self._ready, box, chunks))

    def _ready(self, box: list[list[bytes] | None], chunks: list[bytes]) -> None:
        box[0] = chunks
        self._flush()

    def _flush(self) -> None:
        transport = self.transport
        while self.pending and self.pending[0][0] is not None:
            chunks = self.pending.popleft()[0] or []
            if transport is not None and not transport.is_closing():
                for chunk in chunks:  # one write per SSE event, as the instant fake
                    transport.write(chunk)


async def serve_forever(factory: Callable[[], asyncio.Protocol], port: int) -> None:
    """A protocol server on 127.0.0.1:``port`` until the process is stopped."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, LOCAL, port, backlog=2048)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--service-ms",
        type=float,
        default=0.0,
        help="saturating mode: each completion holds a slot this long (0: instant)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="saturating mode: slots (capacity = concurrency / service time)",
    )
    args = parser.parse_args(argv)
    factory: Callable[[], asyncio.Protocol] = Upstream
    if args.service_ms > 0:
        if args.concurrency < 1:
            parser.error("--service-ms needs --concurrency >= 1")
        capacity = Capacity(args.service_ms / 1000.0, args.concurrency)
        factory = partial(SaturatingUpstream, capacity)
    uvloop.run(serve_forever(factory, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
