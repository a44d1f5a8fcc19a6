"""The pod `podman kube play` runs, generated from deploy/k8s so the two cannot drift.

deploy/k8s uses kinds podman cannot play (a Job whose pod has a native sidecar, a
StatefulSet behind a headless Service, ServiceMonitors). ``played()`` builds one Pod from
them, changing only what a single podman host cannot provide; every change is listed in
``CHANGES`` (and in deploy/k8s/README.md), and test_kube.py checks that everything else
(env, args, probes, security context, mounts) is the manifests' own.

    python -m tests.container.kube GATEWAY_IMAGE SIM_IMAGE   # print the played YAML
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SIM_PORTS = (8101, 8102)
# The sim replica's flags that stand in for the vLLM flags of the same meaning.
SIM_FLAGS = {
    "--served-model-name": "--model",
    "--max-loras": "--max-loras",
    "--max-lora-rank": "--max-lora-rank",
    "--max-cpu-loras": "--max-cpu-loras",
}
CHANGES = (
    "Job -> its pod template as a Pod (kube play runs Pods); the trainer container is left "
    "out (your TRL image on a GPU): the test plays the trainer's part",
    "the gateway, a native sidecar (initContainer with restartPolicy: Always), is a regular "
    "container: kube play runs init containers to completion before the others",
    "GATEWAY_DISCOVERY_DNS=vllm:8000 (headless Service + cluster DNS) -> GATEWAY_REPLICAS "
    "on the pod's loopback",
    "the StatefulSet's 2 vLLM pods -> 2 sim-replica containers of the same pod: the vLLM "
    "container's env, probes, mounts; its args the sim knows; ports 8101/8102 (one netns); "
    "no GPU resources; the sim image instead of vllm/vllm-openai",
    "images: localhost/ builds instead of ghcr.io/your-org and vllm/vllm-openai",
    "secret volumes -> hostPath directories holding the same files: podman 4.3's kube play "
    "crashes on secret volumes (nil pointer in VolumeFromSecret), and the Secrets it creates "
    "from kind: Secret are not readable by its own secretKeyRef; secretKeyRef env reads a "
    "podman secret the test creates in the form podman expects",
    "names (Pod, PVC, secrets) get a per-run suffix, so runs never share state",
)


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def gateway_container(image: str) -> dict[str, Any]:
    """The trainer Job's rollout-gateway sidecar, as a regular container of the pod."""
    job = one(load("trainer-job.yaml"), "Job")
    init = job["spec"]["template"]["spec"]["initContainers"]
    gw: dict[str, Any] = copy.deepcopy(next(c for c in init if c["name"] == "rollout-gateway"))
    gw.pop("restartPolicy")
    gw["image"] = image
    replicas = ",".join(f"http://127.0.0.1:{p}" for p in SIM_PORTS)
    gw["env"] = [
        {"name": "GATEWAY_REPLICAS", "value": replicas}
        if e["name"] == "GATEWAY_DISCOVERY_DNS"
        else e
        for e in gw["env"]
    ]
    return gw


def sim_container(image: str, index: int) -> dict[str, Any]:
    """The vLLM StatefulSet's container as one simulated replica on SIM_PORTS[index]."""
    sts = one(load("vllm.yaml"), "StatefulSet")
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    port = SIM_PORTS[index]
    args = ["--host", "127.0.0.1", "--port", str(port)]
    for arg in vllm["args"]:
        flag, _, value = arg.partition("=")
        if flag in SIM_FLAGS:
            args += [SIM_FLAGS[flag], value]
    sim: dict[str, Any] = copy.deepcopy(vllm)
    sim.pop("resources")
    sim.update(name=f"vllm-{index}", image=image, args=args)
    sim["ports"] = [{"name": f"http-{index}", "containerPort": port}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        sim[probe]["httpGet"]["port"] = port
    return sim


def played(
    gateway_image: str, sim_image: str, *, suffix: str = "", secret_root: Path | None = None
) -> list[dict[str, Any]]:
    """The documents `podman kube play` gets: the PVC as it is, and the Pod. A secret
    volume becomes the hostPath ``secret_root/<secretName>`` (see CHANGES); secretKeyRef
    names and every other name get ``suffix``."""
    job = one(load("trainer-job.yaml"), "Job")
    sts = one(load("vllm.yaml"), "StatefulSet")
    template = job["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    spec.pop("initContainers")
    spec.pop("restartPolicy")
    spec["containers"] = [gateway_container(gateway_image)] + [
        sim_container(sim_image, i) for i in range(len(SIM_PORTS))
    ]
    # The trainer's volumes, plus the replicas' own (dshm).
    names = {v["name"] for v in spec["volumes"]}
    spec["volumes"] += [
        v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] not in names
    ]
    root = secret_root or Path("/run/rollout-played-secrets")
    for volume in spec["volumes"]:
        if "secret" in volume:
            name = volume.pop("secret")["secretName"]
            volume["hostPath"] = {"path": str(root / name), "type": "Directory"}
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] += suffix
    for container in spec["containers"]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                ref["name"] += suffix
    pvc = copy.deepcopy(one(load("adapters-pvc.yaml"), "PersistentVolumeClaim"))
    pvc["metadata"]["name"] += suffix
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "rollout-played" + suffix, "labels": template["metadata"]["labels"]},
        "spec": spec,
    }
    return [pvc, pod]


def secret_values() -> dict[str, dict[str, str]]:
    """secrets.example.yaml's Secrets: name -> key -> value (the test's values replace them)."""
    return {d["metadata"]["name"]: dict(d["stringData"]) for d in load("secrets.example.yaml")}


if __name__ == "__main__":
    print(yaml.safe_dump_all(played(sys.argv[1], sys.argv[2]), sort_keys=False), end="")
