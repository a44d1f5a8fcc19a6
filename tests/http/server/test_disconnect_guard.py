"""``disconnect.DisconnectGuard``: the client leaving cancels the wait, and nothing else does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.http.server.disconnect import ClientDisconnected, DisconnectGuard


def _current() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


async def test_lost_connection_cancels_the_wait_and_raises_client_disconnected() -> None:
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    guard = DisconnectGuard(_current(), lost=lost)
    asyncio.get_running_loop().call_later(0.01, lost.set_result, None)
    with pytest.raises(ClientDisconnected), guard:
        await asyncio.sleep(5)
    assert _current().cancelling() == 0  # the guard's own cancel is taken back
    await asyncio.sleep(0)  # and the task goes on normally


async def test_work_that_ends_first_is_returned_and_a_late_signal_does_nothing() -> None:
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    guard = DisconnectGuard(_current(), lost=lost)
    with guard:
        value = await asyncio.sleep(0.01, result=7)
    assert value == 7
    lost.set_result(None)  # the client leaves after the block: no cancellation
    await asyncio.sleep(0.02)
    assert _current().cancelling() == 0


async def test_a_guard_is_reusable_block_after_block() -> None:
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    guard = DisconnectGuard(_current(), lost=lost)
    with guard:
        await asyncio.sleep(0)
    asyncio.get_running_loop().call_later(0.01, lost.set_result, None)
    with pytest.raises(ClientDisconnected), guard:
        await asyncio.sleep(5)


async def test_other_cancellations_propagate_unchanged() -> None:
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> None:
        with DisconnectGuard(_current(), lost=lost):
            await asyncio.sleep(5)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    task.cancel()  # shutdown, or an ejection abort: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not lost.done()


async def test_asgi_receive_watcher_is_armed_lazily_and_sees_the_disconnect() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return await messages.get()

    guard = DisconnectGuard(_current(), receive=receive)
    with guard:
        await asyncio.sleep(0.01)  # shorter than the arming delay
    assert reads == 0  # a quick exchange never started a watcher

    asyncio.get_running_loop().call_later(0.1, messages.put_nowait, {"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected), guard:
        await asyncio.sleep(5)
    assert reads >= 1
