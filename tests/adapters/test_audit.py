"""The periodic audit of healthy replicas (``AdapterRegistry.audit``): strays go, missing
live versions come back, and nothing changes when the replica holds what it should."""

from __future__ import annotations

import httpx

from gateway.adapters.state import (
    AdapterPolicy,
    AdapterRegistry,
    ListedAdapter,
    LoadOnReplica,
    ReplicaState,
    UnloadOnReplica,
    audit_drift,
)
from tests.adapters._fake import FakeReplica, drive
from tests.cluster import cluster
from tests.eventually import eventually

POLICY = AdapterPolicy(
    max_staleness=2, load_deadline_s=10.0, retry_initial_s=0.5, retry_max_s=2.0, unload_grace_s=0.0
)


def make(n: int = 2) -> tuple[AdapterRegistry, list[FakeReplica]]:
    core = AdapterRegistry(POLICY, range(n), epoch="e")
    core.set_base_models(["base"])
    fakes = [FakeReplica() for _ in range(n)]
    for r in range(n):
        drive(core, fakes, core.observe(r, [], 0.0), 0.0)
    for v in (1, 2):
        drive(core, fakes, core.request_load(f"p-v{v}", f"/r/p-v{v}", inplace=False, now=0.0), 0.0)
    return core, fakes


def test_drift_kinds() -> None:
    believed: dict[str, str | None] = {"a": "/a", "b": "/b", "c": None}
    listing = [ListedAdapter("a", "/a"), ListedAdapter("c", "/c"), ListedAdapter("x", "/x")]
    assert audit_drift(believed, listing) == {"stray": ["x"], "missing": ["b"], "moved": ["c"]}
    assert audit_drift({"a": "/a"}, [ListedAdapter("a", "/a")]) == {}


def test_a_replica_that_holds_what_it_should_is_left_alone() -> None:
    core, fakes = make()
    salts = core.salts("p-v1")
    mark = core.audit_mark(1)
    assert core.audit(1, fakes[1].listing(), mark, 1.0) == ({}, [])
    assert core.replica_state(1) is ReplicaState.UP and core.salts("p-v1") == salts
    assert not any(k.startswith("audit.") for k in core.counts)


def test_a_late_stray_is_unloaded_and_the_replica_readmitted() -> None:
    core, fakes = make()
    fakes[1].held["p-v9"] = "/r/p-v9"  # a load applied late, after it was left out
    kept = core.salt("p-v1", 1)
    drift, actions = core.audit(1, fakes[1].listing(), core.audit_mark(1), 1.0)
    assert drift == {"stray": ["p-v9"]}
    assert core.replica_state(1) is ReplicaState.SYNCING
    assert core.candidates("p-v1") == frozenset({0})  # out of adapter traffic meanwhile
    assert [(type(a), a.name) for a in actions] == [(UnloadOnReplica, "p-v9")]
    drive(core, fakes, actions, 1.0)
    assert "p-v9" not in fakes[1].held and core.replica_state(1) is ReplicaState.UP
    assert core.counts["audit.stray"] == 1
    assert core.salt("p-v1", 1) == kept  # unchanged weights keep their KV


def test_a_missing_live_version_is_replayed() -> None:
    core, fakes = make()
    del fakes[0].held["p-v2"]  # a replica restarted between two health probes
    drift, actions = core.audit(0, fakes[0].listing(), core.audit_mark(0), 1.0)
    assert drift == {"missing": ["p-v2"]}
    assert [(type(a), a.name) for a in actions] == [(LoadOnReplica, "p-v2")]
    drive(core, fakes, actions, 1.0)
    assert fakes[0].held["p-v2"] == "/r/p-v2" and core.replica_state(0) is ReplicaState.UP
    assert core.counts["audit.missing"] == 1


def test_a_listing_older_than_a_change_is_ignored() -> None:
    core, fakes = make()
    mark = core.audit_mark(1)
    listing = fakes[1].listing()  # asked for before the next publish
    drive(core, fakes, core.request_load("p-v3", "/r/p-v3", inplace=False, now=1.0), 1.0)
    assert core.audit(1, listing, mark, 2.0) == ({}, [])  # it lacks p-v3, but is old
    assert core.replica_state(1) is ReplicaState.UP


async def test_the_gateway_audits_healthy_replicas_on_its_own() -> None:
    async with (
        cluster(2, adapter_audit_interval_s=0.2) as c,
        httpx.AsyncClient(base_url=c.url) as client,
    ):
        body = {"lora_name": "p-v1", "lora_path": "/r/p-v1"}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
        stray = {"lora_name": "manual", "lora_path": "/r/manual"}
        async with httpx.AsyncClient() as direct:  # behind the gateway's back
            r = await direct.post(c.replica_urls[1] + "/v1/load_lora_adapter", json=stray)
            assert r.status_code == 200
            r = await direct.post(c.replica_urls[0] + "/v1/unload_lora_adapter",
                                  json={"lora_name": "p-v1"})  # fmt: skip
            assert r.status_code == 200
        await eventually(lambda: "manual" not in c.sim(1).adapters, "the stray unloaded")
        await eventually(lambda: "p-v1" in c.sim(0).adapters, "p-v1 replayed")
        metrics = (await client.get("/metrics")).text
        assert 'gateway_adapter_drift_total{kind="stray"} 1.0' in metrics
        assert 'gateway_adapter_drift_total{kind="missing"} 1.0' in metrics
