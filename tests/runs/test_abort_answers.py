"""A run's ``/pause?mode=abort`` answers every rollout it cancels (real sockets, sim
replicas): a held rollout and a running one get a complete 503 with ``Retry-After`` and
an OpenAI-style error naming why, a running stream ends with an SSE error event and its
final chunk; none is a reset or an EOF. Their retries are held until ``/resume``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from tests.eventually import eventually
from tests.runs.test_many_runs import COMPLETION, as_run, shared

SLOW = SimConfig(latency=LatencyModel(decode=0.1))  # 100 tokens: 10 s
SHORT = {**COMPLETION, "model": "tiny-base"}
LONG = {**SHORT, "max_tokens": 100}
WHY = "Run 'run-a' was paused with mode=abort, which cancelled this rollout"


def _is_abort_answer(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailable" and error["code"] == 503
    assert error["message"].startswith(WHY), error


async def test_pause_abort_answers_running_and_held_rollouts(tmp_path: Path) -> None:
    async with (
        shared(tmp_path, sim_config=SLOW) as c,
        as_run(c, "run-a") as a,
        as_run(c, "run-b") as b,
    ):
        tenant = c.gateway.tenancy.tenants["run-a"]
        running = asyncio.ensure_future(a.post("/v1/completions", json=LONG))
        stream_head: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def stream() -> tuple[int, bytes]:
            async with a.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                chunks = []
                async for chunk in r.aiter_bytes():
                    chunks.append(chunk)
                    if not stream_head.done():
                        stream_head.set_result(None)
                return r.status_code, b"".join(chunks)  # raises if the stream is cut

        streaming = asyncio.ensure_future(stream())
        await asyncio.wait_for(stream_head, 10)  # the stream's headers and a token are out
        await eventually(lambda: tenant.in_flight == 2, "both rollouts running")
        assert (await a.post("/pause", params={"mode": "keep"})).status_code == 200
        held = asyncio.ensure_future(a.post("/v1/completions", json=LONG))
        await eventually(lambda: tenant.in_flight == 3, "the third rollout held")
        other = asyncio.ensure_future(b.post("/v1/completions", json=SHORT))

        pause = await a.post("/pause", params={"mode": "abort"})
        assert pause.status_code == 200  # returned once the run's rollouts were answered
        for answer in (await asyncio.wait_for(running, 5), await asyncio.wait_for(held, 5)):
            _is_abort_answer(answer)
        status, text = await asyncio.wait_for(streaming, 5)
        assert status == 200  # its headers were out before the abort
        assert text.rstrip().endswith(b"}") and WHY.encode() in text.rsplit(b"data: ", 1)[1]
        assert b"[DONE]" not in text  # not mistaken for a finished generation
        assert (await asyncio.wait_for(other, 5)).status_code == 200  # run-b untouched
        assert tenant.in_flight == 0 and c.gateway.ledger.admission.in_flight == 0  # nothing leaked
        metrics = (await b.get("/metrics")).text  # the cut stream: no client left it
        assert "gateway_client_disconnects_total 0.0" in metrics
        await eventually(lambda: c.sim(0).running + c.sim(1).running == 0,
                         "the replicas' generations cancelled")  # fmt: skip

        served = c.sim(0).stats.requests_by_model.total() + c.sim(1).stats.requests_by_model.total()
        retry = asyncio.ensure_future(a.post("/v1/completions", json=SHORT))
        # what TRL's retry meets: held at the gateway until the run's /resume
        await eventually(lambda: tenant.holding == 1, "the retry held at the gateway")
        assert not retry.done()
        assert (
            served
            == c.sim(0).stats.requests_by_model.total() + c.sim(1).stats.requests_by_model.total()
        )
        assert (await a.post("/resume")).status_code == 200
        assert (await asyncio.wait_for(retry, 5)).status_code == 200


async def test_an_aborted_rollout_leaves_its_connection_usable(tmp_path: Path) -> None:
    """The 503 is a whole response on a kept-alive connection: the next request on the
    same socket is served (the same TCP connection: the client's address is compared, and
    the pool holds one connection at most)."""
    limits = httpx.Limits(max_connections=1)
    async with shared(tmp_path, sim_config=SLOW) as c:
        auth = ("run-a", "key-run-a")
        async with httpx.AsyncClient(base_url=c.url, auth=auth, limits=limits, timeout=10) as a:
            tenant = c.gateway.tenancy.tenants["run-a"]
            running = asyncio.ensure_future(a.post("/v1/completions", json=LONG))
            await eventually(lambda: tenant.in_flight == 1, "the rollout running")
            tenant.hold("mode=abort")  # as a data-plane worker applies the owner's pause
            aborted = await asyncio.wait_for(running, 5)
            _is_abort_answer(aborted)
            tenant.resume()
            r = await a.post("/v1/completions", json=SHORT)
            assert r.status_code == 200
            sockets = [x.extensions["network_stream"].get_extra_info("client_addr")
                       for x in (aborted, r)]  # fmt: skip
            assert sockets[0] is not None and sockets[0] == sockets[1], sockets  # not a new one
