"""Messages between the owner and its workers: length-prefixed JSON over a Unix socket.

One stream per worker, both ways. Every message is a JSON object with an ``op``; a
request that wants an answer carries an ``id`` that its reply repeats. The socket lives
in a directory only the gateway's user can enter, so it needs no authentication of its
own; it carries upstream tokens never (workers read those from the same settings).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

__all__ = ["MAX_MESSAGE", "read_message", "write_message"]

MAX_MESSAGE = 64 * 1024 * 1024
"""A snapshot of a few thousand adapters is well under a megabyte."""

_LENGTH = struct.Struct("!I")


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next message; ``asyncio.IncompleteReadError`` once the peer is gone."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_MESSAGE:
        raise ValueError(f"message of {length} bytes is over the {MAX_MESSAGE} limit")
    message = orjson.loads(await reader.readexactly(length))
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("a message is a JSON object with an 'op'")
    return message


def write_message(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    data = orjson.dumps(message)
    writer.write(_LENGTH.pack(len(data)) + data)
