"""An instant fake vLLM upstream for overhead benchmarks: raw asyncio + uvloop, keep-alive,
one canned ~0.9 KB completion body per request, so the proxy is what gets measured.

    python bench/instant_upstream.py --port 9101
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvloop

_BODY = orjson.dumps(
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
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_BODY)).encode()
    + b"\r\n\r\n"
    + _BODY
)
_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class _Protocol(asyncio.Protocol):
    """Parses just enough HTTP/1.1 (headers + Content-Length body) to answer in order."""

    def __init__(self) -> None:
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.WriteTransport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (request := next_request(self.buf)) is not None:
            head, _, self.buf = request
            self.transport.write(_HEALTH if head.startswith(b"get /health") else _RESPONSE)


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


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
