"""The owner <-> worker channel: length-prefixed JSON objects over a real socket pair."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest

from gateway.workers.channel import MAX_MESSAGE, read_message, write_message

_LENGTH = struct.Struct("!I")


@dataclass
class Ends:
    """Two connected streams: what ``left`` writes, ``right`` reads, and back."""

    left_reader: asyncio.StreamReader
    left: asyncio.StreamWriter
    right: asyncio.StreamReader
    right_writer: asyncio.StreamWriter


@pytest.fixture
async def ends() -> AsyncIterator[Ends]:
    a, b = socket.socketpair()
    left_reader, left = await asyncio.open_connection(sock=a)
    right, right_writer = await asyncio.open_connection(sock=b)
    yield Ends(left_reader, left, right, right_writer)
    for writer in (left, right_writer):
        writer.close()
        with contextlib.suppress(ConnectionError):  # the test closed this end's peer
            await writer.wait_closed()


async def read(reader: asyncio.StreamReader) -> dict[str, object]:
    return await asyncio.wait_for(read_message(reader), 5)


async def test_round_trip(ends: Ends) -> None:
    message = {
        "op": "snapshot",
        "id": 7,
        "snapshot": {"epoch": 3, "healthy": [0, 2], "runs": [{"name": "", "paused": None}]},
        "text": "naïve ✓ \u0000 \n",
        "value": 1.5,
    }
    write_message(ends.left, message)
    await ends.left.drain()
    assert await read(ends.right) == message


async def test_both_directions_on_one_stream(ends: Ends) -> None:
    write_message(ends.left, {"op": "status", "id": 1})
    await ends.left.drain()
    assert await read(ends.right) == {"op": "status", "id": 1}
    write_message(ends.right_writer, {"op": "reply", "id": 1, "value": {"worker": 0}})
    await ends.right_writer.drain()
    assert await read(ends.left_reader) == {"op": "reply", "id": 1, "value": {"worker": 0}}


async def test_messages_back_to_back_keep_their_boundaries(ends: Ends) -> None:
    sent = [{"op": "ack", "epoch": n, "pad": "x" * (n * 997)} for n in range(20)]
    for message in sent:
        write_message(ends.left, message)
    await ends.left.drain()
    assert [await read(ends.right) for _ in sent] == sent


async def test_a_message_split_across_writes_is_reassembled(ends: Ends) -> None:
    data = orjson.dumps({"op": "hello", "worker": 3, "pid": 42})
    frame = _LENGTH.pack(len(data)) + data
    reading = asyncio.ensure_future(read(ends.right))
    for k in range(len(frame)):  # one byte at a time, the header too
        ends.left.write(frame[k : k + 1])
        await ends.left.drain()
        await asyncio.sleep(0)
    assert await reading == {"op": "hello", "worker": 3, "pid": 42}


async def test_frame_is_a_big_endian_length_then_json(ends: Ends) -> None:
    write_message(ends.left, {"op": "ack", "epoch": 1})
    await ends.left.drain()
    ends.left.close()
    raw = await asyncio.wait_for(ends.right.read(), 5)
    body = orjson.dumps({"op": "ack", "epoch": 1})
    assert raw == _LENGTH.pack(len(body)) + body


async def test_over_the_limit_is_refused_before_reading_the_body(ends: Ends) -> None:
    ends.left.write(_LENGTH.pack(MAX_MESSAGE + 1))  # no body follows: nothing is awaited
    await ends.left.drain()
    with pytest.raises(ValueError, match="limit"):
        await read(ends.right)


async def test_exactly_the_limit_is_accepted(ends: Ends) -> None:
    """A length of MAX_MESSAGE is read (so the peer closing mid-body is what ends it)."""
    ends.left.write(_LENGTH.pack(MAX_MESSAGE) + b'{"op"')
    await ends.left.drain()
    ends.left.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await read(ends.right)


@pytest.mark.parametrize(
    "body",
    [
        b"[1, 2]",  # not an object
        b'"op"',
        b"null",
        b"{}",  # no op
        b'{"id": 1, "value": "op"}',
        b"",  # zero-length frame: not JSON at all
        b"{not json",
    ],
)
async def test_not_an_object_with_an_op_is_refused(ends: Ends, body: bytes) -> None:
    ends.left.write(_LENGTH.pack(len(body)) + body)
    await ends.left.drain()
    with pytest.raises(ValueError):
        await read(ends.right)


async def test_peer_gone_before_a_message(ends: Ends) -> None:
    ends.left.close()
    with pytest.raises(asyncio.IncompleteReadError) as info:
        await read(ends.right)
    assert info.value.partial == b""


async def test_peer_gone_mid_length(ends: Ends) -> None:
    ends.left.write(b"\x00\x00")
    await ends.left.drain()
    ends.left.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await read(ends.right)


async def test_peer_gone_mid_body(ends: Ends) -> None:
    data = orjson.dumps({"op": "ack", "epoch": 9})
    ends.left.write(_LENGTH.pack(len(data)) + data[:-3])
    await ends.left.drain()
    ends.left.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await read(ends.right)


async def test_a_whole_message_then_close_is_read_then_incomplete(ends: Ends) -> None:
    write_message(ends.left, {"op": "ack", "epoch": 2})
    await ends.left.drain()
    ends.left.close()
    assert await read(ends.right) == {"op": "ack", "epoch": 2}
    with pytest.raises(asyncio.IncompleteReadError):
        await read(ends.right)
