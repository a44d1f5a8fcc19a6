"""``bench/keepalive_race.py``: both pool settings run against the real gateway app, and
the one that gives an idle connection up before the server does loses nothing (it never
sends on a connection the server may be closing; the other one's losses are the bench's
measurement, by chance, so they are not asserted here)."""

from __future__ import annotations

from tests.bench import load_bench


async def test_a_pool_that_gives_up_first_loses_nothing() -> None:
    bench = load_bench("keepalive_race")
    same, shorter = await bench.measure(idle_s=1, rounds=3)
    assert [same["expiry_s"], shorter["expiry_s"]] == [1, 0.5]
    assert same["sent"] == shorter["sent"] == 6
    assert shorter["lost"] == 0, shorter
