"""TRL's real ``AsyncGRPOTrainer`` through the gateway under faults; each run must finish
every step.

In order (the fleet is shared and deliberately keeps each run's adapters for the next):

1. TRL resumed from the happy run's checkpoint over the fleet that still holds that run's
   adapters (numbering continues);
2. a fresh TRL run (v1 again, same ``output_dir``) over the fleet holding the earlier run's
   newest versions;
3. the gateway restarted between two syncs;
4. a replica that hangs (SIGSTOP of its whole process group: it accepts, never answers)
   from just before a sync's ``/pause`` until that sync is over;
5. a replica SIGKILLed just before a sync's ``/pause``, restarted, reconciled, serving again;
6. a replica SIGKILLed while rollouts are in flight (last: it stays dead).

Timing is deterministic: the test's own hooks run inside TRL's control flow, in the
trainer process (``RunSpec.before_pause`` wraps ``VLLMClient.pause``; ``on_step_end`` is a
``TrainerCallback``, which runs before TRL's sync for that step). Nothing on the wire
changes.

TRL's own client timeouts (trl 1.16 ``experimental/async_grpo``): ``/pause``, ``/resume``,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` 1800 s each (``VLLMClient``);
rollouts ``request_timeout`` = 600 s per attempt (aiohttp total), 3 x 30 attempts;
``/health`` 5 s polled every 2 s up to ``vllm_server_timeout``; ``/server_info`` and
``/v1/models`` have none. The hang test asserts the gateway answers well inside them.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from rollout_testbed.trl.harness import (
    Layer,
    RunResult,
    health,
    metric_samples,
    metric_sum,
    replica_adapters,
    run_trl,
    vllm_counters,
    wait_for,
)

from tests.trl.checks import (
    LORA_NAME,
    assert_completed,
    assert_fleet_holds_window,
    assert_loads,
    report,
)

ORDER = 2
# A normal fault run takes 1-3 min. The bound matters: when TRL's rollout child dies,
# TRL's own AsyncRolloutWorker.stop() never returns (mp.Event.set() waits for the dead
# child's watcher thread), so pytest-timeout is what ends such a test.
pytestmark = pytest.mark.timeout(600)

TRL_CONTROL_TIMEOUT_S = 1800  # VLLMClient.pause / resume / load / unload
TRL_ROLLOUT_TIMEOUT_S = 600  # AsyncGRPOConfig.request_timeout (per attempt)
ANSWER_BOUND_S = 60  # what "well inside" means here (gateway broadcast timeout: 30 s)
FAULT_STEPS = 8


def sync_calls(res: RunResult, k: int) -> list[tuple[str, str, float, str | None]]:
    """TRL's control calls of its k-th sync (k = 1: train begin): pause ... (unload)."""
    out: list[tuple[str, str, float, str | None]] = []
    seen = 0
    for c in res.calls:
        if c.method == "pause":
            seen += 1
        if seen == k:
            out.append((c.method, c.arg, round(c.seconds, 3), c.error))
    return out


def checkpoint(layer: Layer) -> tuple[RunResult, Path]:
    """The happy run and its last checkpoint; a short checkpointed run if it did not run."""
    res = layer.results.get("happy")
    if res is None or res.error or not res.spec.save_steps:
        res = run_trl(layer.spec("happy", 4, save_steps=4))
        layer.results["happy"] = res
    ckpts = sorted(res.spec.output_dir.glob("checkpoint-*"), key=lambda p: int(p.name[11:]))
    assert ckpts, f"no checkpoint in {res.spec.output_dir}: {res.error}"
    return res, ckpts[-1]


# --------------------------------------------------------------------------- restarts of TRL


def test_trl_resumes_from_checkpoint_over_fleet_with_earlier_adapters(fleet: Layer) -> None:
    earlier, ckpt = checkpoint(fleet)
    state = json.loads((ckpt / "rollout_state.json").read_text())
    held = {i: sorted(replica_adapters(u)) for i, u in enumerate(fleet.urls)}
    steps = earlier.spec.max_steps + 6 if earlier.spec.max_steps > 4 else 10
    res = run_trl(fleet.spec("resume", steps, output_dir=earlier.spec.output_dir,
                             resume_from_checkpoint=str(ckpt)))  # fmt: skip
    report(res, resumed_from=ckpt.name, rollout_state=state, fleet_before=held)
    assert_completed(res)
    # Numbering continues from the checkpoint's model_version (no name collides).
    assert_loads(res, first_version=state["model_version"] + 1)
    assert all(seen == [True, True] for seen in res.sync_seen.values()), res.sync_seen
    assert_fleet_holds_window(fleet, res, [0, 1])


def test_fresh_trl_run_restarts_at_v1_over_fleet_with_earlier_adapters(fleet: Layer) -> None:
    earlier = fleet.results.get("resume") or fleet.results.get("happy")
    before = {i: replica_adapters(u) for i, u in enumerate(fleet.urls)}
    assert all(before.values()), f"the fleet should still hold an earlier run's adapters: {before}"
    out = earlier.spec.output_dir if earlier else None
    kw = {"output_dir": out} if out else {}
    res = run_trl(fleet.spec("fresh", 5, **kw))  # same output_dir: same names and paths
    report(res, fleet_before={i: sorted(b) for i, b in before.items()})
    assert_completed(res)
    assert_loads(res, first_version=1)
    assert all(seen == [True, True] for seen in res.sync_seen.values()), res.sync_seen
    # The earlier run's newer versions were retired; only this run's window is left.
    assert_fleet_holds_window(fleet, res, [0, 1])


# --------------------------------------------------------------------------- gateway restart


@pytest.mark.workers  # the owner and both workers restart; the registry is rebuilt once
def test_gateway_restarted_between_two_syncs(fleet: Layer) -> None:
    """The gateway process is stopped (SIGTERM) and started again on the same port after
    sync 3. TRL's rollouts in flight meet refused connections and retry (backoff 1 s, 2 s,
    then 1, 2, 4 ... 16 s, identical payload), so a rollout comes back only seconds later,
    still naming the version it started with. Before sync 4 the trainer waits (bounded)
    until the new gateway has answered 16 rollouts (TRL keeps 8 in flight): on this CPU box
    a step takes ~2 s, and with max_staleness 1 two quick syncs evict the version a
    retrying rollout names. Before the gateway served retired versions by the oldest live
    one (docs/adapters.md, "Retired versions") that rollout got 404 on each of its 90
    attempts (~8 min) and TRL's rollout worker died; the wait now only measures how soon
    the retries come back (tests/trainer/test_trl_retired_version.py covers the trap)."""
    info: dict[str, object] = {}
    ok_label = 'route="routed",status_class="2xx"'

    def on_step_end(step: int) -> None:
        if step == 3:  # after sync 3 (v3 live), before sync 4
            info["live_before"] = fleet.gateway.live_adapters()
            info["restart_s"] = round(fleet.gateway.restart(), 2)
            info["live_after"] = fleet.gateway.live_adapters()
            t0 = time.monotonic()
            wait_for(lambda: fleet.gateway_metric("gateway_requests_total", ok_label) >= 16,
                     60, "TRL's retried rollouts to be answered by the new gateway")  # fmt: skip
            info["rollouts_back_after_s"] = round(time.monotonic() - t0, 2)

    res = run_trl(fleet.spec("gateway-restart", FAULT_STEPS, on_step_end=on_step_end))
    info["routed_4xx_after_restart"] = fleet.gateway_metric(
        "gateway_requests_total", 'route="routed",status_class="4xx"'
    )
    report(res, **info)
    assert_completed(res)
    assert "restart_s" in info, "the restart hook did not run"
    # The restarted gateway rebuilt its adapters from the replicas: nothing lost.
    assert info["live_after"] == info["live_before"] == [f"{LORA_NAME}-v2", f"{LORA_NAME}-v3"]
    assert_loads(res, first_version=1)
    assert all(seen == [True, True] for seen in res.sync_seen.values()), res.sync_seen
    assert_fleet_holds_window(fleet, res, [0, 1])


# --------------------------------------------------------------------------- replica faults


def test_replica_hangs_during_a_sync(fleet: Layer) -> None:
    """Replica 1 stops (SIGSTOP of its group) right before sync 3's /pause and continues
    after that sync. The gateway must answer every call of the sync well inside TRL's
    1800 s, no rollout may wait anywhere near TRL's 600 s, and replica 1 must serve again."""
    info: dict[str, float] = {}

    def before_pause(k: int) -> None:
        if k == 3:
            fleet.signal_replica(1, signal.SIGSTOP)
            info["stopped_at"] = time.time()

    def on_step_end(step: int) -> None:
        if step == 3 and "stopped_at" in info:  # sync 3 is over
            fleet.signal_replica(1, signal.SIGCONT)
            info["continued_at"] = time.time()
            info["r1_served_at_cont"] = served(fleet.urls[1])

    slow_before = _routed_slower_than(fleet, ANSWER_BOUND_S)
    try:
        res = run_trl(fleet.spec("hang", FAULT_STEPS, before_pause=before_pause,
                                 on_step_end=on_step_end))  # fmt: skip
    finally:
        fleet.signal_replica(1, signal.SIGCONT)
    calls = sync_calls(res, 3)
    r1_end = vllm_counters(fleet.urls[1])["vllm:request_success_total"]  # 0 if it hangs
    hang_s = info.get("continued_at", 0.0) - info.get("stopped_at", 0.0)
    after_cont = r1_end - info.get("r1_served_at_cont", r1_end)
    report(res, sync3=calls, hang_s=round(hang_s, 1), r1_served_after_cont=after_cont)
    assert "stopped_at" in info, "the hang hook did not run"
    slowest = max((c[2] for c in calls), default=0.0)
    assert slowest < ANSWER_BOUND_S < TRL_CONTROL_TIMEOUT_S, f"sync 3 calls: {calls}"
    assert_completed(res)
    r1_end = served(fleet.urls[1])
    slow = _routed_slower_than(fleet, ANSWER_BOUND_S) - slow_before
    assert slow == 0, f"{slow} rollouts took > {ANSWER_BOUND_S} s (TRL gives up at 600 s)"
    # Replica 1 came back: it serves rollouts again and holds the window.
    assert r1_end > info["r1_served_at_cont"], "replica 1 served nothing after SIGCONT"
    assert_fleet_holds_window(fleet, res, [0, 1])


@pytest.mark.timeout(900)  # includes a replica restart (40-120 s)
def test_replica_killed_just_before_pause(fleet: Layer) -> None:
    """Replica 0 is SIGKILLed right before sync 3's /pause, restarted in the background,
    and must be reconciled by the gateway and serve rollouts again before the run ends."""
    info: dict[str, float] = {}
    restart: dict[str, object] = {}

    def restart_r0() -> None:
        try:
            restart["seconds"] = fleet.restart_replica(0)
        except BaseException as exc:  # reported below
            restart["error"] = repr(exc)

    thread = threading.Thread(target=restart_r0, name="restart-r0", daemon=True)

    def before_pause(k: int) -> None:
        if k == 3:
            # The pause leaves right after the signal, before the gateway can have seen the
            # replica die (from its probes or from the rollouts it has in flight there).
            fleet.kill_replica(0, wait=False)
            info["killed_at"] = time.time()

    def on_step_end(step: int) -> None:
        if step == 3 and "killed_at" in info:  # sync 3 is over: bring replica 0 back
            fleet.wait_dead(0)
            thread.start()
        if step == 6 and thread.ident:
            thread.join(600)  # the trainer waits (bounded) for the restart ...
            assert "seconds" in restart, f"replica 0 restart failed: {restart}"
            t0 = time.monotonic()  # ... and for the gateway to reconcile it
            wait_for(lambda: fleet.reconciled(0), 120, "gateway to reconcile replica 0")
            info["reconciled_after_s"] = round(time.monotonic() - t0, 2)
            info["r0_served_at_rejoin"] = served(fleet.urls[0])

    res = run_trl(fleet.spec("kill-before-pause", 12, before_pause=before_pause,
                             on_step_end=on_step_end))  # fmt: skip
    if thread.ident:
        thread.join(600)
    r0_end = vllm_counters(fleet.urls[0])["vllm:request_success_total"]  # 0 if down
    report(res, sync3=sync_calls(res, 3), restart=restart, **info, r0_served_end=r0_end)
    assert "killed_at" in info, "the kill hook did not run"
    assert_completed(res)
    r0_end = served(fleet.urls[0])
    assert_loads(res, first_version=1)
    # Syncs after the rejoin reached both replicas again.
    assert res.sync_seen[f"{LORA_NAME}-v{res.model_version}"] == [True, True], res.sync_seen
    assert r0_end > info["r0_served_at_rejoin"], "restarted replica 0 served no rollout"
    assert_fleet_holds_window(fleet, res, [0, 1])


@pytest.mark.workers  # the worker that sees the refused connection ejects for both
def test_replica_killed_during_rollouts(fleet: Layer) -> None:
    """Replica 1 is SIGKILLed while it has rollouts in flight (runs last: it stays dead,
    as replica 1 cannot be restarted on its own core). Every step must still finish."""
    info: dict[str, float] = {}

    def running_on_r1() -> float:
        return metric_sum(fleet.urls[1], "vllm:num_requests_running")

    def on_step_end(step: int) -> None:
        if step == 3:
            info["running_at_kill"] = wait_for(running_on_r1, 20, "rollouts in flight on r1", 0.05)
            fleet.kill_replica(1)
            info["killed_at"] = time.time()
            info["r0_served_at_kill"] = served(fleet.urls[0])

    res = run_trl(fleet.spec("kill-during-rollouts", FAULT_STEPS, on_step_end=on_step_end))
    r0_end = vllm_counters(fleet.urls[0])["vllm:request_success_total"]
    report(res, **info, r0_served_end=r0_end, gateway_health=health(fleet.gateway.url),
           ejected=fleet.gateway_metric("gateway_replica_healthy", 'replica="1"') == 0)  # fmt: skip
    assert "killed_at" in info, "the kill hook did not run"
    assert_completed(res)
    assert_loads(res, first_version=1)
    assert health(fleet.urls[1]) is None
    # After the kill, replica 0 served the rest of the run (5 steps x 32 samples at least).
    assert r0_end - info["r0_served_at_kill"] >= (FAULT_STEPS - 3) * 32
    assert_fleet_holds_window(fleet, res, [0])


def _routed_slower_than(layer: Layer, seconds: float) -> float:
    """Routed requests (rollouts) the gateway took longer than ``seconds`` to answer."""
    name = "gateway_request_duration_seconds"
    total = layer.gateway_metric(name + "_count", 'route="routed"')
    fast = sum(
        v
        for n, lab, v in metric_samples(layer.gateway.url)
        if n == name + "_bucket" and 'route="routed"' in lab and f'le="{seconds:.1f}"' in lab
    )
    return total - fast


def served(url: str) -> float:
    """A replica's own ``vllm:request_success_total``; waits (bounded) until it answers."""
    return float(wait_for(lambda: 1 + metric_sum(url, "vllm:request_success_total"), 60,
                          f"{url}/metrics")) - 1  # fmt: skip
