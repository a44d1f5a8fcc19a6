"""The suite's one way to wait for something: poll a check until it holds, or fail clearly.

Why one helper: the suite had about a dozen hand-written "poll until" loops, each with its
own deadline, interval and failure text (some returned ``False`` on timeout and left the
caller to assert, some said only "condition not reached"). A slow CI box then failed with
no clue of what was awaited or how far it got.

Why a generous default deadline (30 s): a deadline only costs time when the test is about
to fail anyway; a short one turns a stalled machine into a false failure. A deadline here
is never a claim about speed -- a test that means to bound a duration measures it and
asserts (or prints) the measurement separately.

``check`` may be a plain function or return an awaitable (``eventually`` awaits it), so
``lambda: client.get(...)``-style checks and ``async def`` predicates both work. The first
truthy value is returned, so a check can hand back what it found (a response, a count).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

__all__ = ["DEFAULT_TIMEOUT_S", "STALL_S", "eventually", "eventually_sync"]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0

STALL_S = 2.5
"""The slack every real-time upper bound in the suite keeps: CI boxes (2 cores, shared)
have stalled whole processes for 0.5-1 s, and a bound must survive a 2 s stall of the
whole machine. A bound that cannot afford it is tested through an injected clock, or
measured and printed instead of asserted."""


def _failure(what: str, timeout: float, checks: int, last: object) -> AssertionError:
    kind = "last error" if isinstance(last, BaseException) else "last value"
    return AssertionError(
        f"timed out after {timeout:g} s waiting for {what} ({checks} checks; {kind}: {last!r})"
    )


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    what: str,
    *,
    timeout: float = ...,
    interval: float = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = ...,
    interval: float = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    what: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``check`` until it returns something truthy, and return that.

    ``what`` names what is awaited (it is the failure message). Exceptions listed in
    ``ignore`` count as "not yet" (e.g. connection refused while a process starts) and
    the last one is reported on timeout; any other exception fails at once. The check
    always runs at least once, and once more after the deadline, so a stall of the test
    process that eats the whole deadline still gets a final look instead of a failure.
    """
    deadline = time.monotonic() + timeout
    checks = 0
    last: object = None
    while True:
        expired = time.monotonic() >= deadline
        checks += 1
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if expired:
            raise _failure(what, timeout, checks, last)
        await asyncio.sleep(interval)


def eventually_sync(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
    on_timeout: Callable[[], Any] | None = None,
) -> T:
    """``eventually`` for blocking code (subprocess and container tests, no event loop).

    ``on_timeout`` runs before the failure is raised (e.g. to dump a process's log).
    """
    deadline = time.monotonic() + timeout
    checks = 0
    last: object = None
    while True:
        expired = time.monotonic() >= deadline
        checks += 1
        try:
            value = check()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if expired:
            if on_timeout is not None:
                on_timeout()
            raise _failure(what, timeout, checks, last)
        time.sleep(interval)
