"""The control-call rule (``gateway.fleet.quorum``), with real processes: a replica that cannot
be reached is lost, not failed; one that answers with an error fails the call.

TRL 1.16 retries none of ``/pause``, ``/resume``, load and unload, so each of these is a
training run that lives or dies:

* a replica SIGKILLed just before ``/pause`` (the gateway has not noticed yet): 200, the
  replica is ejected on the spot, and when it comes back it is paused like the fleet;
* a replica that hangs (SIGSTOP) during ``/pause`` and during a load: 200 as soon as the
  health checker ejects it, far inside TRL's 1800 s client timeout; once it wakes up it is
  put back in the fleet's state (resumed, adapters replayed, nothing stray);
* a replica that refuses ``/pause`` (HTTP 500): 502, and the replicas that did pause are
  resumed again (all or nothing);
* fewer replicas left than ``health_min_replicas``: 503, undone likewise.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.eventually import STALL_S, eventually
from tests.faults.procs import ADMIN, Fleet, fleet

PAUSE = "/pause?mode=keep"
# The hung replica is ejected by its probes timing out. The gateway has one probe timeout
# for every replica, so it must be one that a loaded, stalled box never trips on the
# replicas meant to stay healthy: 3 s (over a 2 s stall). Ejection then takes
# 2 x (0.2 + 3) = 6.4 s, still far under BROADCAST_S, which a control call that waited on
# the hung replica instead of its ejection would take.
BROADCAST_S = 60
HUNG_SETTINGS = {"health_timeout_s": 3.0, "broadcast_timeout_s": BROADCAST_S}


async def _paused(f: Fleet, index: int) -> bool:
    r = await f.control.get(f"{f.sims[index].url}/is_paused", timeout=4 * STALL_S)
    return bool(r.json()["is_paused"])


async def _healthy(f: Fleet, index: int) -> bool:
    return bool((await f.status())["replicas"][index]["healthy"])


async def _adapters_up(f: Fleet, index: int) -> bool:
    status = await f.status()
    return status["replicas"][index]["healthy"] and (
        status["adapters"]["replicas"][index]["state"] == "up"
    )


async def test_pause_with_a_just_killed_replica_succeeds_and_it_rejoins_paused(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, 3, health_interval_s=1.0) as f:
        f.sims[1].kill()  # the gateway still counts it healthy: no probe since
        r = await f.client.post(PAUSE, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "paused"}
        assert not await _healthy(f, 1)  # ejected on the spot, not a probe round later
        assert await _paused(f, 0) and await _paused(f, 2)

        f.sims[1].start()
        await f.wait_sim_up(1)
        await eventually(lambda: _healthy(f, 1), "replica 1 re-admitted")
        assert await _paused(f, 1), "a replica rejoining a paused fleet must be paused too"

        r = await f.client.post("/resume", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert [await _paused(f, i) for i in range(3)] == [False, False, False]


async def test_a_refused_pause_fails_and_is_undone_everywhere(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3) as f:
        await f.faults(1, pause_error=1)
        r = await f.client.post(PAUSE, headers=ADMIN)
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "replica 1: HTTP 500" in message and "Resumed again on replicas [0, 2]" in message
        assert [await _paused(f, i) for i in range(3)] == [False, False, False]
        assert await _healthy(f, 1), "an answer, even an error, is not a lost replica"
        # The next sync works: the refusal was one call, not a broken fleet.
        assert (await f.client.post(PAUSE, headers=ADMIN)).status_code == 200
        assert (await f.client.post("/resume", headers=ADMIN)).status_code == 200


async def test_a_hung_replica_is_left_out_of_pause_and_resumed_when_it_wakes(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, 3, health_interval_s=0.2, settings=HUNG_SETTINGS) as f:
        f.sims[2].freeze()  # SIGSTOP: accepts, never answers
        start = time.monotonic()
        r = await f.client.post(PAUSE, headers=ADMIN)
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        # Answered at the ejection, not after the per-replica broadcast timeout.
        assert took < BROADCAST_S / 2, f"/pause waited {took:.1f}s on a hung replica"
        assert not await _healthy(f, 2)
        assert (await f.client.post("/resume", headers=ADMIN)).status_code == 200

        f.sims[2].thaw()  # it may now apply the /pause it was left out of
        await eventually(lambda: _healthy(f, 2), "replica 2 re-admitted")
        await eventually(lambda: _running(f, 2), "the woken replica resumed like the fleet")


async def _running(f: Fleet, index: int) -> bool:
    return not await _paused(f, index)


async def test_a_load_with_a_hung_replica_goes_live_on_the_others_and_heals(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, 3, health_interval_s=0.2, settings=HUNG_SETTINGS) as f:
        f.sims[2].freeze()
        start = time.monotonic()
        r = await f.load("pol-v1")
        assert r.status_code == 200, r.text
        # Live at the ejection, not after the per-replica broadcast timeout.
        assert time.monotonic() - start < BROADCAST_S / 2
        # Live on exactly the two that answered (a probe timeout of the healthy ones,
        # which a loaded box could trip at 0.3 s, is out of reach at 3 s).
        assert await f.routable("pol-v1") == [0, 1]

        f.sims[2].thaw()
        await eventually(lambda: _adapters_up(f, 2), "replica 2 reconciled")
        assert set(await f.held(2)) == {"pol-v1"}
        assert await f.routable("pol-v1") == [0, 1, 2]
        unload = {"lora_name": "pol-v1"}
        r = await f.client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
        assert r.status_code == 200

        async def empty() -> bool:
            return [await f.held(i) for i in range(3)] == [{}, {}, {}]

        await eventually(empty, "no replica keeps a stray copy")


async def test_fewer_replicas_than_health_min_replicas_is_503_and_undone(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, 2, health_interval_s=1.0, settings={"health_min_replicas": 2}) as f:
        f.sims[1].kill()
        r = await f.client.post(PAUSE, headers=ADMIN)
        assert r.status_code == 503, r.text
        assert "fewer than the 2 required" in r.json()["error"]["message"]
        assert not await _paused(f, 0)
        r = await f.load("pol-v1")
        assert r.status_code == 503, r.text
        assert await f.routable("pol-v1") == []


async def test_control_characters_in_names_and_paths_are_refused_at_once(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, 2) as f:
        cases = [
            ("/v1/load_lora_adapter", {"lora_name": "pol-v1\r\nINFO forged", "lora_path": "/a"}),
            ("/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": "/a/\x00b"}),
            ("/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": "/a/\nb"}),
            ("/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": "/a/\x1bb"}),
            ("/v1/unload_lora_adapter", {"lora_name": "pol\nv1"}),
        ]
        for path, body in cases:
            r = await f.client.post(path, json=body, headers=ADMIN)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert "control characters" in error["message"]
            assert error["param"] in ("lora_name", "lora_path")
        assert not await f.held(0) and not await f.held(1)
        # Refused at once: no replica was asked at all (a gateway that forwarded the call
        # and refused only the answer would show here, whatever the timing).
        for i in range(2):
            stats = await f.sim_stats(i)
            assert stats["loads"] == [] and stats["unloads"] == [], stats
        r = await f.client.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["tiny-base"]
        assert (await f.client.get("/health")).status_code == 200


async def test_unreachable_everywhere_is_503_not_500(tmp_path: Path) -> None:
    async with fleet(tmp_path, 2, health_interval_s=5.0) as f:
        for sim in f.sims:
            sim.kill()
        for path in (PAUSE, "/resume", "/reset_prefix_cache"):
            r = await f.client.post(path, headers=ADMIN)
            assert r.status_code == 503, (path, r.text)
        assert (await f.client.get("/gateway/status")).status_code == 200
