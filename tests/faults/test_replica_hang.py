"""Fault 2: a replica hangs -- it accepts connections but never answers.

SIGSTOP is that hang, for real: the kernel keeps completing TCP handshakes into the
stopped process's backlog and buffering requests on its open keep-alive connections, so
nothing is refused and nothing is answered; only timeouts can tell. Proven here: health
probes time out and eject the replica within ``unhealthy_threshold`` probe rounds; the
requests that were waiting on it are aborted at ejection and retried elsewhere (none
lost), streams under way there end with the SSE error event; the other replicas absorb the
load; the gateway itself stays responsive throughout (no worker stuck); after SIGCONT the
replica is re-admitted. A hang the health probes cannot see (``/health`` fine, rollouts
stuck) is bounded by ``read_timeout_s``.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

import httpx

from tests.faults.procs import Fleet, Load, fleet, metric, wait_until

HEALTH_INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 0.3
UNHEALTHY_THRESHOLD = 2  # the gateway's default
LATENCY = "decode=0.01"
VICTIM = 2


async def _ready(f: Fleet, load: Load) -> bool:
    """A stream mid-body on the victim and a buffered request waiting there."""
    if not load.live_on(VICTIM, stream=True, mid_body=True):
        return False
    in_flight = int((await f.status())["replicas"][VICTIM]["in_flight"])
    return in_flight > len(load.live_on(VICTIM, stream=True, mid_body=False))


async def test_sigstopped_replica_is_ejected_and_its_requests_retried(tmp_path: Path) -> None:
    async with fleet(
        tmp_path, 3, latency=LATENCY, health_interval_s=HEALTH_INTERVAL_S,
        gateway_args=["--health-timeout-s", str(HEALTH_TIMEOUT_S)],
    ) as f:  # fmt: skip
        load = Load(f, workers=12, seed=3)
        scrapes: list[float] = []  # how long each /gateway/status took while hung
        try:
            await wait_until(lambda: _ready(f, load), 10, "requests waiting on the victim")
            served_before = [r["served"] for r in (await f.status())["replicas"]]
            stopped_at = time.monotonic()
            f.sims[VICTIM].freeze()

            async def ejected() -> bool:
                t0 = time.monotonic()
                healthy = await f.healthy(VICTIM)
                scrapes.append(time.monotonic() - t0)
                return not healthy

            ejected_after = await wait_until(ejected, 10, "the hung replica ejected", 0.01)
            # Nothing is left waiting on the stopped process: aborted at ejection.
            await wait_until(lambda: _victim_idle(f), 2, "no request left on the victim")
            await wait_until(lambda: _served_more(f, served_before), 5, "others absorbing")
            hung_for = time.monotonic() - stopped_at
            f.sims[VICTIM].thaw()
            await wait_until(lambda: f.healthy(VICTIM), 5, "re-admission after SIGCONT")
        finally:
            if f.sims[VICTIM].frozen:
                f.sims[VICTIM].thaw()
            outcomes = await load.stop()

        bound = UNHEALTHY_THRESHOLD * (HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S)
        metrics = await f.metrics()
        aborted = metric(metrics, "gateway_ejection_aborted_requests_total")
        slow = [d for d in scrapes if d > 0.5]
        print(
            f"hang: {len(outcomes)} requests, ejected {ejected_after * 1000:.0f} ms after "
            f"SIGSTOP (bound {bound * 1000:.0f} ms), {aborted:.0f} requests aborted at "
            f"ejection, gateway answers while hung: median {median(scrapes) * 1000:.0f} ms, "
            f"{len(slow)} of {len(scrapes)} over 0.5 s"
        )
        # 1.5 s of slack for a stalled loop; a probe that ignored --health-timeout-s (2 s by
        # default) would take 2 x (0.2 + 2.0) = 4.4 s at least.
        assert ejected_after <= bound + 1.5, ejected_after
        assert metric(metrics, "gateway_replica_ejections_total",
                      replica=str(VICTIM), cause="probe") >= 1  # fmt: skip
        assert aborted >= 2, "the requests waiting on the victim were not aborted"
        # No gateway worker stuck: its own endpoints answered promptly during the hang. A
        # stuck worker slows every scrape; a stalled loop (the client's or the gateway's),
        # only the one in flight: the scrapes go one at a time.
        assert median(scrapes) < 0.1 and len(slow) <= 1, sorted(scrapes)[-3:]
        # None lost: every buffered request answered 200 (retried), no client timeout.
        assert [o.error for o in outcomes if o.error] == []
        assert {o.status for o in outcomes} == {200}
        assert all(b'"choices"' in o.body for o in outcomes if not o.stream)
        broken = [o for o in outcomes if o.stream and not o.sse_done]
        assert broken, "no stream was under way on the victim"
        for o in broken:
            assert o.sse_error is not None, o.body[-200:]
            assert o.replica == str(VICTIM) and o.started < stopped_at
        # Each request took at most the hang detection time plus its own duration.
        assert max(o.ended - o.started for o in outcomes if o.ended) < hung_for + 2.0
        await wait_until(lambda: _in_flight_zero(f), 5, "in-flight counts back to zero")
        assert f.gateway_errors() == []


async def test_rollouts_hung_behind_a_healthy_health_check_time_out(tmp_path: Path) -> None:
    """``/health`` answers but rollouts never do (``completion_hang``): only the read
    timeout can end them, with a 504 -- never a request held forever."""
    read_timeout = 2.0
    async with fleet(tmp_path, 1, settings={"read_timeout_s": read_timeout}) as f:
        await f.faults(0, completion_hang=-1)
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 4}
        t0 = time.monotonic()
        r = await f.client.post("/v1/completions", json=body)
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert r.json()["error"]["message"] == "replica 0 did not answer in time"
        # Never sooner, and never retried: a second wait would take 2 x read_timeout.
        assert read_timeout <= took < 2 * read_timeout, took
        stream = await f.client.post("/v1/completions", json={**body, "stream": True})
        assert stream.status_code == 504, stream.text
        await wait_until(lambda: _in_flight_zero(f), 2, "in-flight back to zero")
        await f.clear_faults(0)
        assert (await f.client.post("/v1/completions", json=body)).status_code == 200
        assert f.gateway_errors() == []


async def _victim_idle(f: Fleet) -> bool:
    return int((await f.status())["replicas"][VICTIM]["in_flight"]) == 0


async def _served_more(f: Fleet, before: list[int]) -> bool:
    now = [r["served"] for r in (await f.status())["replicas"]]
    return all(now[i] >= before[i] + 5 for i in range(3) if i != VICTIM)


async def _in_flight_zero(f: Fleet) -> bool:
    try:
        return await f.in_flight() == 0
    except httpx.HTTPError:
        return False
