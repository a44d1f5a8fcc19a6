"""Real vLLM: a shared fleet you can operate (issue 29). A second gateway, in multi-run
mode, in front of the session's replicas:

* a run loads its adapter through a symlink inside its root; the replicas are sent, and
  report, the resolved path;
* FORWARDED paths are scoped: the run's ``/tokenize`` naming its adapter reaches vLLM
  under its prefix; another run naming it (or the prefixed name) gets vLLM's 404 shape;
* a scoped ``/pause?mode=abort`` answers a held rollout with a complete 503.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import BASE_MODEL, E2E, GatewayServer
from tests.eventually import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUNS = ("team-a", "team-b")


def test_a_shared_fleet_scopes_forwarded_and_lora_paths_and_answers_aborts(
    vllm_gw: E2E, tmp_path: Path
) -> None:
    env = vllm_gw
    runs = []
    for name in RUNS:
        (tmp_path / name).mkdir()
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1})  # fmt: skip
    real = tmp_path / "team-a" / "gen1" / "trl-policy-v1"
    shutil.copytree(env.adapter_dir(1), real)
    (tmp_path / "team-a" / "current").symlink_to(real.parent)
    gateway = GatewayServer(env.urls, runs=runs, lora_slots_per_replica=6)
    gateway.start()
    try:
        a = httpx.Client(base_url=gateway.url, auth=("team-a", "key-team-a"), timeout=120)
        b = httpx.Client(base_url=gateway.url, auth=("team-b", "key-team-b"), timeout=120)
        with a, b:
            given = tmp_path / "team-a" / "current" / "trl-policy-v1"
            r = a.post("/v1/load_lora_adapter",
                       json={"lora_name": "trl-policy-v1", "lora_path": str(given)})  # fmt: skip
            assert r.status_code == 200, r.text
            roots = {
                m["root"]
                for url in env.urls
                for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]
                if m["id"] == "team-a~trl-policy-v1"
            }
            assert roots == {str(real)}  # what vLLM itself was asked to read

            tok = a.post("/tokenize", json={"model": "trl-policy-v1", "prompt": "hello"})
            assert tok.status_code == 200, tok.text
            assert tok.json()["count"] > 0
            base = b.post("/tokenize", json={"model": BASE_MODEL, "prompt": "hello"})
            assert base.status_code == 200 and base.json()["tokens"] == tok.json()["tokens"]
            for model in ("trl-policy-v1", "team-a~trl-policy-v1"):
                r = b.post("/tokenize", json={"model": model, "prompt": "hello"})
                assert r.status_code == 404, r.text
                assert r.json()["error"]["message"] == f"The model `{model}` does not exist."
            r = b.post("/tokenize", content=b"{nope", headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"

            assert a.post("/pause", params={"mode": "keep"}).status_code == 200
            held: list[httpx.Response] = []
            body = {"model": "trl-policy-v1", "prompt": [5, 6, 7], "max_tokens": 4}
            sender = threading.Thread(target=lambda: held.append(a.post("/v1/completions",
                                                                        json=body)))  # fmt: skip
            sender.start()
            tenant = gateway.gateway.tenancy.tenants["team-a"]
            eventually_sync(lambda: tenant.in_flight == 1, "the rollout held at the gateway")
            with httpx.Client(base_url=gateway.url, auth=("team-a", "key-team-a"),
                              timeout=60) as control:  # fmt: skip
                assert control.post("/pause", params={"mode": "abort"}).status_code == 200
            sender.join(30)
            assert held and held[0].status_code == 503, held
            assert held[0].headers["retry-after"] == "1"
            assert "paused with mode=abort" in held[0].json()["error"]["message"]
            assert a.post("/resume").status_code == 200
            again = a.post("/v1/completions", json=body)
            assert again.status_code == 200 and again.json()["model"] == "trl-policy-v1"
    finally:
        gateway.stop()
