"""deploy/k8s, deploy/compose and deploy/hf-jobs, checked offline: Kubernetes schemas
(kubernetes-validate, strict), the Prometheus Operator ServiceMonitor shape, and the
cross-file facts the gateway depends on (discovery name = headless Service, adapter volume
at the same path everywhere, max_loras >= max_staleness + 2, every GATEWAY_* variable a
real setting, drain timeout < grace period). The HF Jobs trainer entry script runs for real
against a sim replica."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from rollout_testbed.procs import free_port

from gateway.config import Settings
from tests.deploy._proc import REPO, base_env, sim_replica
from tests.deploy.tools import ensure_tools

# The first test to need promtool/hadolint/... may install them (ensure_tools.sh).
pytestmark = pytest.mark.timeout(600)

K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "deploy" / "compose"
HF = REPO / "deploy" / "hf-jobs"
SETTINGS = {f"GATEWAY_{n.upper()}" for n in Settings.model_fields} | {
    f"GATEWAY_{n.upper()}_FILE" for n in ("upstream_token", "api_key", "admin_key")
} | {"GATEWAY_CONFIG"}  # fmt: skip

SERVICE_MONITOR = {  # the parts of the monitoring.coreos.com/v1 CRD these manifests use
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": {"type": "object"}},
                    "additionalProperties": False,
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scheme": {"enum": ["http", "https"]},
                        },
                    },
                },
            },
        }
    },
}


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    for d in k8s_docs():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError((kind, name))


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_k8s_manifests_validate_strictly() -> None:
    ensure_tools()
    from kubernetes_validate import utils

    version = utils.latest_version()
    kinds = set()
    for doc in k8s_docs():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(doc, SERVICE_MONITOR)
        else:
            utils.validate(doc, version, strict=True)
    assert {"Job", "StatefulSet", "Service", "PersistentVolumeClaim", "ServiceMonitor"} <= kinds


def test_k8s_wiring() -> None:
    svc = find("Service", "vllm")
    sts = find("StatefulSet", "vllm")
    job = find("Job", "rollout-trainer")
    assert svc["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    assert sts["spec"]["serviceName"] == "vllm"
    pod = job["spec"]["template"]["spec"]
    (gw,) = [c for c in pod["initContainers"] if c["name"] == "rollout-gateway"]
    assert gw["restartPolicy"] == "Always"  # native sidecar: the Job still completes
    env = env_of(gw)
    assert set(env) <= SETTINGS, set(env) - SETTINGS
    host, port = env["GATEWAY_DISCOVERY_DNS"].rsplit(":", 1)
    assert host == svc["metadata"]["name"]
    assert int(port) == svc["spec"]["ports"][0]["port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in gw, probe
    assert gw["startupProbe"]["httpGet"]["path"] == "/readyz"
    # never restart the sidecar for a bad replica (tests/test_probes.py runs these paths)
    assert gw["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert int(env["GATEWAY_SHUTDOWN_TIMEOUT_S"]) < pod["terminationGracePeriodSeconds"]
    # The adapter volume: one claim, mounted at the same path in trainer, gateway, vLLM.
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    paths = set()
    for c in [*pod["containers"], gw, vllm]:
        assert c.get("resources", {}).get("requests"), c["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "adapters"]
        paths.add(mount["mountPath"])
    assert paths == {env["GATEWAY_ADAPTER_ROOTS"]}
    claims = {pod["volumes"][0]["persistentVolumeClaim"]["claimName"]}
    claims.add(sts["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"])
    pvc = find("PersistentVolumeClaim", claims.pop())
    assert not claims and "ReadWriteMany" in pvc["spec"]["accessModes"]
    # vLLM: runtime LoRA + dev mode, and room for the staleness window.
    venv = env_of(vllm)
    assert venv["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and venv["VLLM_SERVER_DEV_MODE"] == "1"
    args = dict(a.split("=", 1) for a in vllm["args"] if "=" in a)
    assert "--enable-lora" in vllm["args"]
    assert int(args["--max-loras"]) >= int(env["GATEWAY_MAX_STALENESS"]) + 2
    # Monitoring: the ServiceMonitor selects the Service that selects the trainer pod.
    mon_svc = find("Service", "rollout-gateway")
    assert (
        mon_svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    )
    sm = find("ServiceMonitor", "rollout-gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= mon_svc["metadata"]["labels"].items()
    assert mon_svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "rollout-gateway"  # alerts' job


def load_compose(*files: str) -> dict[str, Any]:
    """Merge compose files the way `docker compose -f a -f b` does (``!reset`` included),
    with ADAPTER_DIR set to an absolute path as compose.yaml requires."""
    from tests.deploy.test_compose_overlay import load, merge

    merged: dict[str, Any] = {}
    for name in files:
        merged = merge(merged, load(name))
    text = yaml.safe_dump({k: v for k, v in merged.items() if not k.startswith("x-")})
    return dict(yaml.safe_load(re.sub(r"\$\{ADAPTER_DIR(:\?[^}]*)?\}", ADAPTER_DIR, text)))


ADAPTER_DIR = "/srv/adapters"


def mount_target(volume: str) -> str:
    return volume.removesuffix(":ro").removesuffix(":rw").rsplit(":", 1)[1]


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")])
def test_compose(files: tuple[str, ...]) -> None:
    doc = load_compose(*files)
    services = doc["services"]
    assert {"gateway", "vllm-0", "vllm-1", "prometheus", "grafana"} <= set(services)
    gw = services["gateway"]
    assert (COMPOSE / gw["build"]["context"] / gw["build"]["dockerfile"]).resolve() == (
        REPO / "Dockerfile"
    )
    env = gw["environment"]
    assert set(env) <= SETTINGS, set(env) - SETTINGS
    assert env["GATEWAY_REPLICAS"].split(",") == ["http://vllm-0:8000", "http://vllm-1:8000"]
    roots = env["GATEWAY_ADAPTER_ROOTS"]
    for name in ("vllm-0", "vllm-1"):
        vllm = services[name]
        assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        assert roots in map(mount_target, vllm["volumes"]), vllm["volumes"]
        args = dict(a.split("=", 1) for a in vllm["command"] if "=" in a)
        assert int(args["--max-loras"]) >= 4 + 2
    assert roots in map(mount_target, gw["volumes"])
    assert roots == ADAPTER_DIR  # the same absolute path in every container
    if "compose.cpu.yaml" in files:
        assert "deploy" not in services["vllm-0"]
        assert services["vllm-0"]["image"].startswith("${VLLM_CPU_IMAGE:-")
    else:
        assert services["vllm-0"]["deploy"]["resources"]["reservations"]["devices"]
    # Mounted files exist.
    for svc in ("prometheus", "grafana"):
        for volume in services[svc]["volumes"]:
            source = volume.removesuffix(":ro").rsplit(":", 1)[0]
            assert (COMPOSE / source).is_file(), volume
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    assert jobs["rollout-gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert set(jobs["vllm"]["static_configs"][0]["targets"]) == {"vllm-0:8000", "vllm-1:8000"}


def test_hf_jobs_trainer_entry_runs_gateway_as_sidecar_process(tmp_path: Path) -> None:
    """The trainer Job's command, run here: the gateway comes up on 127.0.0.1 with the
    injected HF_TOKEN as upstream token, the training command reaches the replica through
    it, the gateway is stopped afterwards and the training command's status is kept."""
    probe = (
        f'{shlex.quote(sys.executable)} -c "import os, httpx; '
        "u = os.environ['VLLM_SERVER_BASE_URL']; "
        "m = httpx.get(u + '/v1/models').json()['data'][0]['id']; "
        "r = httpx.post(u + '/v1/completions', json={'model': m, 'prompt': 'hi', "
        "'max_tokens': 2}); r.raise_for_status(); "
        f"open('{tmp_path}/ok', 'w').write(r.headers['x-gateway-replica'])\" && exit 7"
    )
    with sim_replica() as replica:
        env = base_env({
            "GATEWAY_REPLICAS": replica, "GATEWAY_PORT": str(free_port()),
            "HF_TOKEN": "hf_TESTSECRET_upstream_7Qx9", "TRAIN_CMD": probe,
            "SIDECAR_WAIT_S": "60",
        })  # fmt: skip
        res = subprocess.run(
            ["bash", str(HF / "trainer-entry.sh")], env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
    assert res.returncode == 7, res.stderr[-2000:]
    assert (tmp_path / "ok").read_text() == "0"
    assert "hf_TESTSECRET" not in res.stderr + res.stdout
    gateway_port = env["GATEWAY_PORT"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{gateway_port}/health", timeout=2)
