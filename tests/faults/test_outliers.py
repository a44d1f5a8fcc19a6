"""Fault 3: a replica answers 5xx, or slow 429s; retries must not amplify an outage.

With real processes under continuous concurrent load:

* a replica answering slow 429s is ejected by passive outlier detection after
  ``outlier_consecutive_errors`` answers in a row; while OPEN it gets nothing; each
  HALF-OPEN period lets exactly one trial through (slow answers keep the trial in flight
  while other requests arrive, so a second concurrent trial would show); a failed trial
  re-opens the breaker for twice as long; a good trial closes it and traffic returns;
* when every replica answers 500, at most ``outlier_max_ejected_fraction`` of them are
  ejected: the failure reaches the client as the replica's own answer, the pool is not
  emptied;
* the retry budget: when a replica dies under many in-flight requests, only the budgeted
  number are retried; the rest get a 503 with ``Retry-After`` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.eventually import eventually
from tests.faults.procs import Fleet, fleet, metric

EJECTION_S = 0.3
CONSECUTIVE = 3
SLOW_S = 0.15
ANSWER_SLACK_S = 0.05  # the gateway's and the sim's own time on top of SLOW_S
VICTIM = 1


@dataclass(frozen=True)
class Answer:
    sent: float
    done: float
    replica: int
    status: int


async def _hammer(f: Fleet, stop: asyncio.Event, answers: list[Answer], seed: int) -> None:
    """One closed-loop client with a fresh prompt per request (spread over replicas)."""
    for k in range(10_000):
        if stop.is_set():
            return
        body = {"model": "tiny-base", "prompt": [seed, k % 997 + 1, 3], "max_tokens": 2}
        sent = time.monotonic()
        r = await f.client.post("/v1/completions", json=body)
        answers.append(
            Answer(sent, time.monotonic(), int(r.headers["x-gateway-replica"]), r.status_code)
        )


async def _breaker(f: Fleet, index: int) -> float:
    return metric(await f.metrics(), "gateway_replica_breaker_state", replica=str(index))


async def test_slow_429s_eject_then_half_open_trials_back_off_and_close(tmp_path: Path) -> None:
    args = ["--outlier-consecutive-errors", str(CONSECUTIVE),
            "--outlier-ejection-s", str(EJECTION_S)]  # fmt: skip
    async with fleet(tmp_path, 3, gateway_args=args, settings={"outlier_max_ejection_s": 5}) as f:
        await f.faults(VICTIM, completion_error=-1, completion_error_status=429,
                       completion_error_delay_s=SLOW_S)  # fmt: skip
        answers: list[Answer] = []
        stop = asyncio.Event()
        clients = [asyncio.create_task(_hammer(f, stop, answers, s)) for s in range(6)]
        try:
            await eventually(lambda: _trials(answers, 3), "three failed half-open trials")
            await f.clear_faults(VICTIM)
            cleared_at = time.monotonic()
            await eventually(lambda: _closed(f), "a good trial to close the breaker")
            closed_at = time.monotonic() - cleared_at
            await eventually(lambda: _victim_answers(answers, 200, 5), "traffic back")
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 30)

        _, trials = _split(answers)
        # OPEN: nothing reaches the victim for EJECTION_S, then one trial at a time, each
        # failed trial doubling the wait. The gateway says so itself, in its own clock:
        assert _ejections_logged(f)[:4] == [round(EJECTION_S * 2**n, 1) for n in range(4)]
        # And the client sees it: each gap runs from a failed answer (the ejection is the
        # CONSECUTIVE-th) to the next trial's arrival. A stalled client loop moves ``sent``
        # early and ``done`` late, so each is bounded by the other and SLOW_S: a stall can
        # only make a gap look longer. (From the raw times, CI saw a gap of 0.03 s where the
        # next was an exact 1.19 s: a 0.57 s stall; here once, 0.81 s for 1.2 s.)
        # So only lower bounds are asserted: the bounding above puts each estimate within
        # ANSWER_SLACK_S of the truth, so a gap is at least ``want - 2 * ANSWER_SLACK_S``
        # unless the breaker let a trial through early. Upper bounds ("never stuck") are
        # the waits above: a breaker that never half-opened again fails them.
        answered = sorted(_answered(a) for a in answers if a.replica == VICTIM and a.status == 429)
        starts = [answered[CONSECUTIVE - 1]] + [_answered(t) for t in trials]
        gaps = [_arrived(b) - a for a, b in zip(starts, trials, strict=False)]
        print(f"outliers: trial gaps {[round(g, 2) for g in gaps]} s, closed in {closed_at:.2f}s")
        for n, gap in enumerate(gaps[:3]):
            want = EJECTION_S * 2**n
            assert 0.5 * want <= gap, (n, gaps)  # never early
        # The wait grows: the third gap is at least 0.6 s, where a breaker that kept its
        # first 0.3 s would give 0.3 s plus the estimates' 0.1 s (plus stalls: a false pass
        # at worst, never a false failure). The doubling itself is in the gateway's log.
        assert len(gaps) >= 3, gaps
        for a, b in itertools.pairwise(trials):
            assert b.sent >= a.done, "two trials were in flight at once"
        assert all(a.status == 200 for a in answers if a.replica != VICTIM)
        metrics = await f.metrics()
        assert metric(metrics, "gateway_replica_ejections_total",
                      replica=str(VICTIM), cause="outlier") >= 1 + 3  # fmt: skip
        assert await _breaker(f, VICTIM) == 0
        assert f.gateway_errors() == []


async def test_fleet_wide_500s_are_relayed_not_ejected_past_the_fraction(tmp_path: Path) -> None:
    args = ["--outlier-consecutive-errors", str(CONSECUTIVE), "--outlier-ejection-s", "30"]
    async with fleet(tmp_path, 2, gateway_args=args) as f:
        for i in range(2):
            await f.faults(i, completion_error=-1, completion_error_status=500)
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
        seen: list[httpx.Response] = []
        for k in range(40):
            seen.append(await f.client.post("/v1/completions", json={**body, "prompt": [k]}))
        # The replica's own 500 body, relayed unchanged; never the gateway's 503.
        assert {r.status_code for r in seen} == {500}
        assert {r.json()["error"]["message"] for r in seen} == {"Simulated failure (HTTP 500)"}
        states = [await _breaker(f, i) for i in range(2)]
        assert sorted(states) == [0, 1], states  # max_ejected_fraction 0.5 of 2 replicas
        still_open = states.index(0)
        assert seen[-1].headers["x-gateway-replica"] == str(still_open)
        assert f.gateway_errors() == []


async def test_retry_budget_caps_retries_when_a_replica_dies(tmp_path: Path) -> None:
    budget = {"retry_budget_ratio": 0.0, "retry_budget_min_per_s": 0.2}  # 2 per 10 s
    async with fleet(
        tmp_path, 2, latency="decode=0.02", settings=budget,
        gateway_args=["--router", "round_robin"],
    ) as f:  # fmt: skip
        body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 250}  # 5 s each
        sent = [asyncio.create_task(f.client.post("/v1/completions", json=body))
                for _ in range(16)]  # fmt: skip
        # Round robin sends every other request to the victim: 8 of 16 from one process;
        # with ``--workers N`` each worker alternates on its own share, so 7 or 8.
        await eventually(lambda: _running(f, VICTIM, 7), "7+ requests on the victim")
        await eventually(lambda: _all_running(f, 16), "all 16 generating")
        on_victim = int((await f.sim_stats(VICTIM))["running"])
        f.sims[VICTIM].kill()
        answers = await asyncio.wait_for(asyncio.gather(*sent), 30)

        ok = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 503]
        metrics = await f.metrics()
        retried = metric(metrics, "gateway_upstream_retries_total")
        exhausted = metric(metrics, "gateway_retry_budget_exhausted_total")
        assert len(ok) + len(refused) == 16, [r.status_code for r in answers]
        assert retried == 2, retried  # the budget: 0.2/s over a 10 s window, gateway-wide
        assert exhausted == len(refused) == on_victim - 2, (exhausted, len(refused), on_victim)
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert "retry budget" in r.json()["error"]["message"]
        stats = await f.sim_stats(0)
        assert sum(stats["requests_by_model"].values()) == 16 - on_victim + 2  # + the retries
        assert f.gateway_errors() == []


def _split(answers: list[Answer]) -> tuple[float, list[Answer]]:
    """(when the victim was ejected, as the client saw it; the trials sent after that)."""
    errors = [a for a in answers if a.replica == VICTIM and a.status == 429]
    if len(errors) < CONSECUTIVE:
        return float("inf"), []
    ejected_at = sorted(a.done for a in errors)[CONSECUTIVE - 1]
    return ejected_at, sorted((a for a in errors if a.sent > ejected_at), key=lambda a: a.sent)


def _answered(a: Answer) -> float:
    """When a slow 429 reached the gateway: ``done``, unless the client's loop was stalled
    and saw it late; it cannot have come before ``sent + SLOW_S``."""
    return min(a.done, a.sent + SLOW_S + ANSWER_SLACK_S)


def _arrived(a: Answer) -> float:
    """When a slow 429's request reached the gateway: ``sent``, unless the client's loop was
    stalled before sending it; it cannot have come after ``done - SLOW_S``."""
    return max(a.sent, a.done - SLOW_S - ANSWER_SLACK_S)


def _ejections_logged(f: Fleet) -> list[float]:
    """The ejection lengths the gateway logged for the victim ("ejected for 0.3 s"), in order."""
    found = (re.search(r"ejected for ([0-9.]+) s", str(r.get("message", "")))
             for r in f.gateway_records()
             if f"replica {VICTIM} " in str(r.get("message", "")))  # fmt: skip
    return [float(m.group(1)) for m in found if m]


async def _trials(answers: list[Answer], n: int) -> bool:
    return len(_split(answers)[1]) >= n


async def _closed(f: Fleet) -> bool:
    breaker = (await f.status())["replicas"][VICTIM]["breaker"]
    return breaker == "closed" and await _breaker(f, VICTIM) == 0


async def _victim_answers(answers: list[Answer], status: int, n: int) -> bool:
    return sum(1 for a in answers if a.replica == VICTIM and a.status == status) >= n


async def _running(f: Fleet, index: int, n: int) -> bool:
    return int((await f.sim_stats(index))["running"]) >= n


async def _all_running(f: Fleet, n: int) -> bool:
    """All ``n`` sent are generating: none still on its way to the victim at the kill."""
    return sum([int((await f.sim_stats(i))["running"]) for i in range(2)]) >= n
