"""``tests.eventually``: returns the first truthy value, fails naming what and the last value."""

from __future__ import annotations

import itertools

import pytest

from tests.eventually import eventually, eventually_sync


async def test_returns_the_first_truthy_value_sync_and_async_checks() -> None:
    counter = itertools.count()
    assert await eventually(lambda: next(counter) >= 3 and "done", "three polls") == "done"

    async def check() -> int:
        return next(counter)

    assert await eventually(check, "an async check") == 4


async def test_failure_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the moon .*last value: 0"):
        await eventually(lambda: 0, "the moon", timeout=0.05, interval=0.01)


async def test_ignored_errors_are_not_yet_and_reported_others_fail_at_once() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("not up")

    with pytest.raises(AssertionError, match=r"last error: ConnectionRefusedError"):
        await eventually(refused, "a server", timeout=0.05, ignore=(OSError,))
    with pytest.raises(ConnectionRefusedError):
        await eventually(refused, "a server", timeout=30)  # not swallowed: no 30 s wait


def test_sync_variant_checks_after_the_deadline_then_reports() -> None:
    seen: list[str] = []

    def check() -> list[int]:
        seen.append("check")
        return []

    with pytest.raises(AssertionError, match=r"waiting for a list \(\d+ checks; last value: \[\]"):
        eventually_sync(check, "a list", timeout=0.05, interval=0.01,
                        on_timeout=lambda: seen.append("on_timeout"))  # fmt: skip
    assert seen[-1] == "on_timeout" and seen.count("check") >= 2
    assert eventually_sync(lambda: 5, "five") == 5
