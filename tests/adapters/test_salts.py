"""Load generations (``AdapterRegistry.salt``): a request never meets KV cached under
another load of the same name, and shares it with every request of its own load."""

from __future__ import annotations

from gateway.adapters.state import (
    AdapterPolicy,
    AdapterRegistry,
    AdapterState,
    Outcome,
    ReplicaState,
)
from tests.adapters._fake import FakeReplica, drive

POLICY = AdapterPolicy(
    max_staleness=2, load_deadline_s=10.0, retry_initial_s=0.5, retry_max_s=2.0, unload_grace_s=0.0
)


def make(n: int = 2, epoch: str = "e1") -> tuple[AdapterRegistry, list[FakeReplica]]:
    core = AdapterRegistry(POLICY, range(n), epoch=epoch)
    core.set_base_models(["base"])
    fakes = [FakeReplica() for _ in range(n)]
    for r in range(n):
        drive(core, fakes, core.observe(r, [], 0.0), 0.0)
    return core, fakes


def load(core: AdapterRegistry, fakes: list[FakeReplica], name: str, path: str, now: float) -> None:
    inplace = core.is_live(name)
    drive(core, fakes, core.request_load(name, path, inplace=inplace, now=now), now)
    assert core.adapter_state(name) is AdapterState.LIVE


def salts(core: AdapterRegistry, name: str, n: int = 2) -> list[str | None]:
    return [core.salt(name, r) for r in range(n)]


def test_every_copy_of_a_load_has_a_salt_and_the_base_model_none() -> None:
    core, fakes = make()
    load(core, fakes, "p-v1", "/r/p-v1", 0.0)
    first = salts(core, "p-v1")
    assert all(s and s.startswith("e1.") for s in first)
    assert core.salts("p-v1") == dict(enumerate(first))
    assert core.salt("base", 0) is None and core.salt("unknown", 0) is None
    assert core.salt("p-v1", 7) is None  # no such replica


def test_a_reload_in_place_at_the_same_path_changes_every_salt() -> None:
    core, fakes = make()
    load(core, fakes, "trl-policy-v1", "/r/trl-policy-v1", 0.0)
    before = salts(core, "trl-policy-v1")
    load(core, fakes, "trl-policy-v1", "/r/trl-policy-v1", 1.0)  # same name, same path
    after = salts(core, "trl-policy-v1")
    assert all(after) and not set(before) & set(after)


def test_a_name_unloaded_then_loaded_again_gets_a_new_salt() -> None:
    """TRL restarted at v1 in the same folder, after v1 had been unloaded: vLLM may still
    hold blocks cached under the first load."""
    core, fakes = make()
    load(core, fakes, "trl-policy-v1", "/r/trl-policy-v1", 0.0)
    before = salts(core, "trl-policy-v1")
    drive(core, fakes, core.request_unload("trl-policy-v1", 1.0), 1.0)
    drive(core, fakes, core.tick(2.0), 2.0)
    assert core.adapter_state("trl-policy-v1") is AdapterState.GONE
    load(core, fakes, "trl-policy-v1", "/r/trl-policy-v1", 3.0)
    assert not set(before) & set(salts(core, "trl-policy-v1"))


def test_a_failed_reload_leaves_unknown_weights_under_a_new_salt() -> None:
    core, fakes = make(1)
    load(core, fakes, "p-v1", "/r/a", 0.0)
    (before,) = salts(core, "p-v1", 1)
    fakes[0].load_faults = [Outcome.FAILED]
    drive(core, fakes, core.request_load("p-v1", "/r/b", inplace=True, now=1.0), 1.0)
    (after,) = salts(core, "p-v1", 1)
    assert after is not None and after != before


def test_a_lost_replica_rejoins_with_new_salts() -> None:
    """It may have been restarted, and reloaded at the same paths, while it was away."""
    core, fakes = make()
    load(core, fakes, "p-v1", "/r/p-v1", 0.0)
    before = core.salt("p-v1", 1)
    core.replica_lost(1, 1.0)
    drive(core, fakes, core.observe(1, fakes[1].listing(), 2.0), 2.0)
    assert core.salt("p-v1", 1) not in (None, before)
    assert core.salt("p-v1", 0) is not None


def test_a_reconcile_without_loss_keeps_the_salt_of_weights_it_vouches_for() -> None:
    """A failed unload sends a replica back to reconciliation (its view may be wrong),
    but what it held all along at the same path keeps its generation and its KV."""
    core, fakes = make()
    load(core, fakes, "p-v1", "/r/p-v1", 0.0)
    load(core, fakes, "p-v2", "/r/p-v2", 0.0)
    kept, moved = core.salt("p-v1", 1), core.salt("p-v2", 1)
    fakes[1].unload_faults = [Outcome.FAILED]
    drive(core, fakes, core.request_unload("p-v2", 1.0), 1.0)
    drive(core, fakes, core.tick(2.0), 2.0)
    assert core.replica_state(1) is ReplicaState.SYNCING and core.salt("p-v1", 1) == kept
    fakes[1].held["p-v2"] = "/elsewhere/p-v2"
    drive(core, fakes, core.observe(1, fakes[1].listing(), 3.0), 3.0)
    assert core.salt("p-v1", 1) == kept
    assert core.salt("p-v2", 1) != moved


def test_a_restarted_gateway_salts_every_adopted_copy_anew() -> None:
    core, fakes = make(epoch="first")
    load(core, fakes, "p-v1", "/r/p-v1", 0.0)
    old = set(salts(core, "p-v1"))
    restarted = AdapterRegistry(POLICY, range(2), epoch="second")
    drive(
        restarted, fakes, restarted.rebuild({r: f.listing() for r, f in enumerate(fakes)}, 5.0), 5.0
    )
    new = salts(restarted, "p-v1")
    assert all(s and s.startswith("second.") for s in new) and not old & set(new)
