"""Outlier ejection, half-open trials, retry budgets and ejection aborts, over HTTP."""

from __future__ import annotations

import asyncio

import httpx
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from gateway.fleet.outliers import BreakerState
from tests.cluster import Cluster, cluster
from tests.eventually import eventually

BODY = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 4}


class Clock:
    """The gateway's ``now`` (``Rotation.clock``), moved by the test instead of slept past."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def until_reopen(c: Cluster, clock: Clock, index: int) -> None:
    """Jump to the breaker's own deadline (``reopen_at``): no sleep, no race with a slow
    machine, and the ejection time itself is checked."""
    reopen_at = c.gateway.rotation.outliers.breaker(index).reopen_at
    assert reopen_at > clock.now, "the breaker is not open"
    clock.now = reopen_at


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))  # fmt: skip


async def test_5xx_replica_is_ejected_probed_half_open_and_restored() -> None:
    settings = {"router": "round_robin", "outlier_consecutive_errors": 3,
                "outlier_ejection_s": 0.6}  # fmt: skip
    async with cluster(2, **settings) as c, httpx.AsyncClient(base_url=c.url) as client:
        c.gateway.rotation.clock = clock = Clock()
        c.sim(0).faults.completion_error = -1  # every completion: HTTP 500
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(20)]
        assert codes.count(500) == 3, codes  # relayed as they are, then no more traffic there
        assert c.gateway.rotation.outliers.states()[0] is BreakerState.OPEN
        status = (await client.get("/gateway/status")).json()
        assert status["replicas"][0]["breaker"] == "open"
        assert status["replicas"][0]["healthy"]  # /health still passes: only outliers see it
        served_before = c.sim(1).stats.requests_by_model.total()
        assert c.gateway.rotation.outliers.breaker(0).reopen_at == clock.now + 0.6
        until_reopen(c, clock, 0)  # half-open: one trial reaches replica 0 and fails
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(6)]
        assert codes.count(500) == 1, codes
        assert c.sim(1).stats.requests_by_model.total() == served_before + 5
        c.sim(0).clear_faults()
        assert c.gateway.rotation.outliers.breaker(0).ejections == 2
        assert c.gateway.rotation.outliers.breaker(0).reopen_at == clock.now + 1.2  # doubled
        until_reopen(c, clock, 0)
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(6)]
        assert codes == [200] * 6
        assert c.gateway.rotation.outliers.states()[0] is BreakerState.CLOSED
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, 'gateway_replica_ejections_total{cause="outlier",replica="0"}') == 2
        assert 'gateway_replica_breaker_state{replica="0"} 0.0' in metrics


async def test_slow_429s_eject_too_but_never_the_last_replica() -> None:
    async with (
        cluster(1, outlier_consecutive_errors=2) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        c.sim(0).faults.completion_error = -1
        c.sim(0).faults.completion_error_status = 429
        c.sim(0).faults.completion_error_delay_s = 0.05
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(5)]
        assert codes == [429] * 5  # the replica's own answer; ejecting it would help no one
        assert c.gateway.rotation.outliers.states()[0] is BreakerState.CLOSED


async def test_retry_budget_stops_retry_storms() -> None:
    settings = {"router": "least_loaded", "retry_budget_ratio": 0.0,
                "retry_budget_min_per_s": 0.1, "health_interval_s": 30}  # fmt: skip
    async with cluster(3, **settings) as c, httpx.AsyncClient(base_url=c.url) as client:
        await c.replicas[0].stop()
        await c.replicas[1].stop()
        r = await client.post("/v1/completions", json=BODY)  # 0 refused, retry on 1 refused
        assert r.status_code == 503, r.text
        assert "retry budget" in r.json()["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "gateway_retry_budget_exhausted_total") == 1
        assert metric(metrics, "gateway_upstream_retries_total") == 1
        # Both dead replicas were ejected passively; the next request goes straight to 2.
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


async def _eject_by_probe(c: Cluster, index: int) -> None:
    c.sim(index).faults.health_status = 503
    await eventually(lambda: not c.gateway.pool[index].up, f"replica {index} ejected by probes")


async def test_ejection_retries_requests_waiting_on_a_hung_replica() -> None:
    async with (
        cluster(2, router="least_loaded") as c,
        httpx.AsyncClient(base_url=c.url, timeout=10) as client,
    ):
        c.sim(0).faults.completion_hang = -1
        tasks = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(6)]
        await eventually(lambda: c.gateway.pool[0].in_flight > 0, "requests on replica 0")
        await _eject_by_probe(c, 0)
        # Retried at the ejection: a request left waiting on the hung replica would wait
        # for the read timeout (600 s) and fail this gather with the client's 10 s timeout
        # -- no clock of ours needed to tell.
        results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 6
        assert {r.headers["x-gateway-replica"] for r in results} == {"1"}
        assert c.gateway.pool[0].in_flight == 0 and c.gateway.rotation.tasks.count(0) == 0
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "gateway_ejection_aborted_requests_total") >= 1
        c.sim(0).clear_faults()


async def test_ejection_ends_streams_in_flight_with_an_sse_error() -> None:
    slow = SimConfig(latency=LatencyModel(decode=0.05))
    async with cluster(1, slow) as c, httpx.AsyncClient(base_url=c.url, timeout=10) as client:
        body = {**BODY, "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            await _eject_by_probe(c, 0)
            rest = [line async for line in lines if line.startswith("data:")]
        assert rest, "the stream ended without a word"
        assert '"error"' in rest[-1] and "mid-stream" in rest[-1]
        assert "[DONE]" not in "".join(rest)
        await eventually(lambda: c.gateway.pool[0].in_flight == 0, "the gateway's count at 0")
        # The upstream generation was aborted (200 tokens would run for 10 s).
        await eventually(lambda: c.sim(0).running == 0, "the replica's generation aborted")


async def test_timeouts_count_as_outlier_errors() -> None:
    # 2 s, not less: the healthy replica's answers share this loop, and a stall of the
    # loop as long as the read timeout would time one of them out too
    settings = {"router": "least_loaded", "read_timeout_s": 2.0,
                "outlier_consecutive_errors": 2}  # fmt: skip
    async with cluster(2, **settings) as c, httpx.AsyncClient(base_url=c.url) as client:
        c.sim(0).faults.completion_hang = -1  # /health still passes
        codes = [(await client.post("/v1/completions", json=BODY)).status_code for _ in range(4)]
        assert codes == [504, 504, 200, 200], codes
        assert c.gateway.rotation.outliers.states()[0] is BreakerState.OPEN
        assert c.gateway.pool[0].in_flight == 0
        c.sim(0).clear_faults()


async def test_idle_replica_refusing_a_probe_is_ejected_at_once() -> None:
    # The health loop is parked (an hour between rounds); the test runs the rounds itself,
    # so "one probe, not five" is counted in rounds, not guessed from a clock.
    async with cluster(2, health_interval_s=3600, unhealthy_threshold=5) as c:
        await c.replicas[1].stop()
        before = c.gateway.pool[1].up  # idle: no request saw the refusal
        await c.gateway.health.round()
        assert (before, c.gateway.pool[1].up) == (True, False), "not ejected at the first probe"
        async with httpx.AsyncClient(base_url=c.url) as client:
            metrics = (await client.get("/metrics")).text
        assert metric(metrics, 'gateway_replica_ejections_total{cause="passive",replica="1"}') == 1
