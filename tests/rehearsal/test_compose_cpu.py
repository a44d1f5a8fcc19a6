"""deploy/compose run for real: compose.yaml plus the CPU overlay (compose.cpu.yaml) under
podman-compose, with 2 vllm-cpu replicas, the gateway and Prometheus; TRL's own client on
the host drives it with the adapter folder at the same absolute path as in every
container; Prometheus must have scraped the gateway and loaded the alert rules; `down`
must leave nothing behind.

The tests of this module run in order on one project (module fixture ``stack``);
``test_down_leaves_nothing`` is last and brings it down itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rollout_testbed.procs import free_ports

from tests.container._podman import REPO
from tests.eventually import eventually_sync
from tests.rehearsal.adapters import ADAPTER, adapter_dir
from tests.rehearsal.compose import Project
from tests.rehearsal.trl import probe

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Both replicas from cold on 2 cores: 20-45 s each on an idle machine, about 60 s together.
REPLICAS_UP_S = 300
# prometheus.yml scrapes every 15 s: two intervals and slack.
SCRAPED_S = 60


@dataclass
class Stack:
    project: Project
    adapters: Path
    gateway: str
    prometheus: str


@pytest.fixture(scope="module")
def stack(
    tools: None, gateway_image: str, vllm_image: str, prometheus_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:  # fmt: skip
    adapters = adapter_dir(vllm_image)
    gw_port, prom_port, grafana_port = free_ports(3)
    env = {
        "VLLM_CPU_IMAGE": vllm_image,
        "PROMETHEUS_IMAGE": prometheus_image,
        "GATEWAY_IMAGE": gateway_image,
        "MODEL": "/models/tiny",  # baked into the CPU image
        "ADAPTER_DIR": str(adapters),
        "GATEWAY_HOST_PORT": str(gw_port),
        "PROMETHEUS_HOST_PORT": str(prom_port),
        "GRAFANA_HOST_PORT": str(grafana_port),
    }
    project = Project(env, tmp_path_factory.mktemp("compose"))
    try:
        project.up()
        yield Stack(project, adapters, f"http://127.0.0.1:{gw_port}",
                    f"http://127.0.0.1:{prom_port}")  # fmt: skip
    finally:
        project.down()
        if project.leftovers():
            project.force_remove()
        shutil.rmtree(adapters, ignore_errors=True)


def _dump(stack: Stack) -> None:
    for svc in ("gateway", "vllm-0", "vllm-1"):
        print(f"--- {svc}\n{stack.project.logs(svc)[-2500:]}")


def test_the_fleet_comes_up_through_the_gateway(stack: Stack) -> None:
    eventually_sync(
        lambda: httpx.get(stack.gateway + "/health", timeout=5).status_code == 200,
        "the gateway's /health 200 (both vllm-cpu replicas up, found by service name)",
        timeout=REPLICAS_UP_S, interval=1.0, ignore=(httpx.HTTPError,),
        on_timeout=lambda: _dump(stack),
    )  # fmt: skip


def test_trl_client_loads_rolls_out_and_unloads(stack: Stack) -> None:
    """TRL's VLLMClient and rollout loop, lora_path = the host's absolute adapter path."""
    result = probe(stack.gateway, stack.adapters / ADAPTER)
    assert result["adapter_only_sync"] is True
    assert result["data_parallel_size"] == 1
    assert len(result["token_ids"]) == 8 == len(result["logprobs"])
    # The load reached both replicas at the very path TRL sent, and the unload too.
    for svc in ("vllm-0", "vllm-1"):
        log = stack.project.logs(svc)
        assert '"POST /v1/load_lora_adapter HTTP/1.1" 200' in log, svc
        assert '"POST /v1/unload_lora_adapter HTTP/1.1" 200' in log, svc
    models = httpx.get(stack.gateway + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["/models/tiny"], models  # the adapter is gone


def _query(stack: Stack, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(stack.prometheus + "/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def test_prometheus_scrapes_the_gateway_and_the_replicas(stack: Stack) -> None:
    def up(job: str) -> list[str]:
        return sorted(s["value"][1] for s in _query(stack, f'up{{job="{job}"}}'))

    eventually_sync(lambda: up("rollout-gateway") == ["1"], "up{job=rollout-gateway} == 1",
                    timeout=SCRAPED_S, interval=1.0, ignore=(httpx.HTTPError,))  # fmt: skip
    eventually_sync(lambda: up("vllm") == ["1", "1"], "up{job=vllm} == 1 for both replicas",
                    timeout=SCRAPED_S, interval=1.0, ignore=(httpx.HTTPError,))  # fmt: skip
    # the gateway's own series, with the job the alerts expect
    eventually_sync(
        lambda: _query(stack, 'gateway_build_info{job="rollout-gateway"}'),
        "gateway_build_info scraped", timeout=SCRAPED_S, interval=1.0,
        ignore=(httpx.HTTPError,),
    )  # fmt: skip


def test_prometheus_loaded_the_alert_rules(stack: Stack) -> None:
    shipped = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    want = {r["alert"] for g in shipped["groups"] for r in g["rules"] if "alert" in r}
    r = httpx.get(stack.prometheus + "/api/v1/rules", timeout=5)
    r.raise_for_status()
    groups = r.json()["data"]["groups"]
    assert {g["file"] for g in groups} == {"/etc/prometheus/alerts.yml"}
    loaded = {rule["name"] for g in groups for rule in g["rules"] if rule["type"] == "alerting"}
    assert loaded == want and want


def test_down_leaves_nothing(stack: Stack) -> None:
    before = set(stack.project.leftovers())
    assert set(stack.project.containers) <= before  # a positive marker: they existed
    out = stack.project.down()
    assert not stack.project.leftovers(), out
