"""Fault 1: a replica is SIGKILLed under load (streaming and non-streaming), then restarted.

Proves, with real processes: requests that had no response byte are retried elsewhere
(none lost); streams in flight on the dead replica end with the SSE error event instead of
hanging; the replica is ejected within one health interval, re-admitted after its restart,
and reconciled -- the live adapter is replayed onto it before any adapter request reaches
it (a request reaching it first would get vLLM's 404, and none does).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from tests.eventually import STALL_S, eventually
from tests.faults.procs import Fleet, Load, Outcome, fleet, metric

HEALTH_INTERVAL_S = 0.5
LATENCY = "decode=0.01"  # 10 ms a token: 8-20 tokens = 80-200 ms per request
VICTIM = 1


async def _adapters_synced(f: Fleet, index: int) -> bool:
    status = await f.status()
    replica = status["replicas"][index]
    return bool(replica["healthy"]) and status["adapters"]["replicas"][index]["state"] == "up"


async def test_sigkill_under_load_loses_nothing_and_reconciles(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3, latency=LATENCY, health_interval_s=HEALTH_INTERVAL_S) as f:
        assert (await f.load("pol-v1")).status_code == 200
        load = Load(f, workers=12, models=["tiny-base", "pol-v1"], seed=1)
        try:
            # A stream mid-body on the victim, and a buffered request waiting on it.
            await eventually(
                lambda: _ready(f, load), "a stream mid-body and a request waiting on replica 1"
            )
            doomed = {id(o) for o in load.live_on(VICTIM, stream=True, mid_body=True)}
            killed_at = time.monotonic()
            f.sims[VICTIM].kill()
            await eventually(lambda: _down(f, VICTIM), "replica 1 ejected", interval=0.01)
            ejected_after = time.monotonic() - killed_at
            # Ejected by the refused connections, before any probe round could fail twice:
            # read now, before the restart (probes of the dead replica may add some later).
            ejections_at_kill = await _ejections(f)
            await asyncio.sleep(1.0)  # the fleet serves on two replicas for a while
            served_before = await _served(f)
            f.sims[VICTIM].start()  # same port, empty adapter set, like a restarted vLLM
            await f.wait_sim_up(VICTIM)
            restarted_at = time.monotonic()
            await eventually(lambda: _adapters_synced(f, VICTIM), "replica 1 re-admitted")
            readmitted_after = time.monotonic() - restarted_at
            await eventually(
                lambda: _victim_served_adapter(f), "adapter traffic on the restarted replica"
            )
        finally:
            outcomes = await load.stop()

        print(
            f"kill: {len(outcomes)} requests, {len(broken_streams(outcomes))} streams cut, "
            f"ejected after {ejected_after * 1000:.0f} ms, re-admitted (reconciled) "
            f"{readmitted_after * 1000:.0f} ms after restart"
        )
        # Ejection on the spot: passive, by the first refused connection under load, not
        # after probes. The gateway's own count says which, with no clock involved: a
        # gateway that waited for its probes would have counted cause="probe" (two failed
        # rounds take one interval at least, and the status poll sees the first ejection).
        assert ejections_at_kill["passive"] >= 1, ejections_at_kill  # one per worker
        assert ejections_at_kill["probe"] == 0, ejections_at_kill
        metrics = await f.metrics()
        # Re-admitted by the first good probe (healthy_threshold 1) and reconciled: within
        # two probe rounds, with STALL_S for a stalled machine. A gateway that left a
        # restarted replica out (or waited for something else, e.g. its outlier ejection)
        # would still be out at this bound, or never back (the wait above fails).
        assert readmitted_after <= 2 * HEALTH_INTERVAL_S + STALL_S, readmitted_after

        # Nothing lost: every request answered 200; no client-side timeouts or resets.
        assert len(outcomes) >= 100, len(outcomes)
        assert [o.error for o in outcomes if o.error] == []
        assert sorted({o.status for o in outcomes}) == [200], _statuses(outcomes)
        buffered = [o for o in outcomes if not o.stream]
        assert all(b'"choices"' in o.body for o in buffered)
        # Streams: complete, or (only those mid-body on the victim at the kill) one clean
        # SSE error event as the last event -- never a hang, never a truncated stream.
        streams = [o for o in outcomes if o.stream]
        broken = [o for o in streams if not o.sse_done]
        assert broken, "no stream was mid-body on the victim: the test proved nothing"
        for o in broken:
            error = o.sse_error
            assert error is not None, f"stream neither done nor errored: {o.body[-200:]!r}"
            assert error["message"] and error["code"] == 502, error
            assert o.replica == str(VICTIM) and o.started < killed_at, o
            # Ended at the kill, not by a timeout (the client's is 20 s).
            assert o.ended is not None and o.ended - killed_at < 5.0
        assert doomed & {id(o) for o in broken}, "no stream mid-body at the kill was cut"
        retries = metric(metrics, "gateway_upstream_retries_total")
        assert retries >= 1, "no request was retried: none was waiting on the victim"

        # Reconciled before adapter traffic: the restarted replica got pol-v1 replayed once,
        # and every pol-v1 request (200 above; a request before the replay would be 404)
        # that it served came after.
        stats = await f.sim_stats(VICTIM)
        assert stats["loads"] == ["pol-v1"], stats["loads"]
        assert stats["adapters"] == {"pol-v1": "/adapters/pol-v1"}
        assert stats["requests_by_model"].get("pol-v1", 0) >= 1
        served_after = await _served(f)
        assert served_after[VICTIM] > served_before[VICTIM], "victim got no traffic back"
        await eventually(lambda: _in_flight_zero(f), "in-flight counts back to zero")
        assert f.gateway_errors() == []


async def _ready(f: Fleet, load: Load) -> bool:
    """A stream mid-body on the victim, and more requests in flight there than the streams
    the client knows of (so at least one is waiting for its response headers)."""
    if not load.live_on(VICTIM, stream=True, mid_body=True):
        return False
    in_flight = int((await f.status())["replicas"][VICTIM]["in_flight"])
    return in_flight > len(load.live_on(VICTIM, stream=True, mid_body=False))


def broken_streams(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.stream and not o.sse_done]


async def _down(f: Fleet, index: int) -> bool:
    return not await f.healthy(index)


async def _ejections(f: Fleet) -> dict[str, int]:
    text = await f.metrics()
    return {cause: int(metric(text, "gateway_replica_ejections_total", replica=str(VICTIM),
                              cause=cause)) for cause in ("passive", "probe")}  # fmt: skip


async def _served(f: Fleet) -> list[int]:
    return [int(r["served"]) for r in (await f.status())["replicas"]]


async def _victim_served_adapter(f: Fleet) -> bool:
    stats = await f.sim_stats(VICTIM)
    return int(stats["requests_by_model"].get("pol-v1", 0)) >= 1


async def _in_flight_zero(f: Fleet) -> bool:
    return await f.in_flight() == 0


def _statuses(outcomes: list[Outcome]) -> dict[int, int]:
    return dict(Counter(o.status for o in outcomes))
