"""The local launcher's replicas themselves (``rollout_testbed.local.replicas``): pinned,
serving, loading a LoRA, counting prefix-cache hits, reported by the status CLI.

They run on the e2e session's pair, first (``E2E_ORDER``), while the replicas are as
started, and with the session's gateway stopped: the launcher is what is under test, and
the gateway would otherwise see adapters it never loaded. This pair is the only one these
checks need; a pair of their own cost CI a second cold start (about 90 s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_testbed.local import replicas as R

from tests.e2e.conftest import E2E, vllm_counter
from tests.eventually import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
E2E_ORDER = -1  # first: the replicas as the launcher started them (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def replica_set(e2e_session: E2E) -> Iterator[R.ReplicaSet]:
    """The session's replicas, with its gateway stopped until the module is done."""
    e2e_session.gateway.stop()
    try:
        yield e2e_session.replicas
    finally:
        for r in e2e_session.replicas.replicas:  # what the LoRA test loaded
            R.http_post_json(r.url + "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"})
        e2e_session.restart_gateway()


def test_replicas_are_healthy_and_pinned(replica_set: R.ReplicaSet) -> None:
    assert len(replica_set.replicas) == 2
    assert replica_set.max_loras == 6
    for r in replica_set.replicas:
        assert R.health(r.url) == 200
        members = R.owned_group_members(r.pgid, replica_set.run_id)
        assert len(members) >= 2, "api server + engine core expected"
        allowed = Path(f"/proc/{r.pid}/status").read_text()
        line = next(x for x in allowed.splitlines() if x.startswith("Cpus_allowed_list"))
        assert line.split()[-1] == str(r.core)
    assert [r.core for r in replica_set.replicas] == [0, 1 % (os.cpu_count() or 1)]
    state = json.loads(Path(replica_set.state_file).read_text())
    assert [x["pid"] for x in state["replicas"]] == [r.pid for r in replica_set.replicas]


def test_models_lists_base(replica_set: R.ReplicaSet) -> None:
    for r in replica_set.replicas:
        status, body = R.http_get(r.url + "/v1/models")
        assert status == 200
        ids = [m["id"] for m in json.loads(body)["data"]]
        assert ids[0] == "tiny-base"


def test_lora_load_on_both_replicas(replica_set: R.ReplicaSet) -> None:
    assert replica_set.model_dir
    path = str(Path(replica_set.model_dir) / "adapters" / "trl-policy-v1")
    for r in replica_set.replicas:
        status, body = R.http_post_json(
            r.url + "/v1/load_lora_adapter",
            {"lora_name": "trl-policy-v1", "lora_path": path, "load_inplace": False},
        )
        assert status == 200, body
        status, body = R.http_get(r.url + "/v1/models")
        models = {m["id"]: m for m in json.loads(body)["data"]}
        assert "trl-policy-v1" in models
        assert models["trl-policy-v1"]["parent"] == "tiny-base"
        req = {
            "model": "trl-policy-v1",
            "prompt": "The adapter says",
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 1,
        }
        status, body = R.http_post_json(r.url + "/v1/completions", req)
        assert status == 200, body
        lora_text = json.loads(body)["choices"][0]["text"]
        status, body = R.http_post_json(r.url + "/v1/completions", {**req, "model": "tiny-base"})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] != lora_text, "LoRA changed nothing"


def test_prefix_cache_counters_increase(replica_set: R.ReplicaSet) -> None:
    r = replica_set.replicas[0]
    prompt = "hello there friend, " * 15  # ~150 tokens: several 32-token blocks, < 512
    before = vllm_counter(r.url, "vllm:prefix_cache_hits_total")
    cached = []
    for _ in range(2):
        body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        status, raw = R.http_post_json(r.url + "/v1/completions", body)
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        assert 64 <= usage["prompt_tokens"] < 500, usage
        details = usage.get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens") or 0)
    # vLLM publishes its counters a moment later: wait until they moved, then check how far.
    after = eventually_sync(
        lambda: (hits := vllm_counter(r.url, "vllm:prefix_cache_hits_total")) > before and hits,
        "vllm:prefix_cache_hits_total to increase",
        interval=0.5,
    )
    assert after >= before + 32, (before, after)
    assert cached[1] >= 32, cached


def test_status_cli_reports_rss(replica_set: R.ReplicaSet) -> None:
    rows = R.replica_status(replica_set)
    assert [row["health"] for row in rows] == [200, 200]
    for row in rows:
        assert row["rss_mib"] > 100
