"""The pod `podman kube play` runs, generated from deploy/k8s so the two cannot drift.

deploy/k8s uses kinds podman cannot play (a Job whose pod has a native sidecar, a
StatefulSet behind a headless Service, ServiceMonitors). ``played()`` builds one Pod from
them, changing only what a single podman host cannot provide; every change is listed in
``CHANGES`` (and in deploy/k8s/README.md), and test_kube.py checks that everything else
(env, args, probes, security context, mounts) is the manifests' own.

``played(..., replicas="vllm-cpu")`` is the rehearsal's variant (tests/rehearsal): the
same pod with real vLLM CPU replicas, the StatefulSet's container changed only by
``CPU_OVERLAY`` (image, resources, the args and CPU settings the tiny model needs).
``play`` runs either under `podman kube play` and always takes it down.

    python -m tests.container.kube GATEWAY_IMAGE SIM_IMAGE [sim|vllm-cpu]   # print the YAML
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.container._podman import RUN_FLAGS, podman

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
    "the dshm emptyDir (medium: Memory) -> a hostPath directory of mode 1777: kube play makes "
    "an emptyDir a root-owned volume that the pod's runAsUser 10001 cannot write, and vLLM "
    "puts its shared-memory queues there",
)


# The rehearsal's CPU overlay of the StatefulSet's vLLM container (the k8s counterpart of
# deploy/compose/compose.cpu.yaml): everything else is the manifest's own, and
# tests/rehearsal/test_kube_vllm.py checks that.
CPU_MODEL = "/models/tiny"  # baked into the vLLM CPU image (scripts/build-rehearsal-image.sh)
CPU_SERVED_NAME = "tiny-base"
CPU_ARGS = {"--model": CPU_MODEL, "--served-model-name": CPU_SERVED_NAME}
CPU_DROPPED_ARGS = ("--gpu-memory-utilization",)
CPU_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
CPU_RESOURCES = {"requests": {"cpu": "1", "memory": "3Gi"}}
CPU_OVERLAY = (
    "image: the vLLM CPU image of the rehearsal instead of vllm/vllm-openai",
    "resources: 1 CPU and a few GiB, no nvidia.com/gpu",
    "args: --model/--served-model-name the tiny model baked into the image; --port one per "
    "replica (one pod, one netns); --gpu-memory-utilization dropped (no GPU)",
    "env: + VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), VLLM_CPU_OMP_THREADS_BIND (one core each)",
)


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def gateway_container(image: str) -> dict[str, Any]:
    """The trainer Job's rollout-gateway sidecar, as a regular container of the pod
    (replicas on SIM_PORTS of the pod's loopback, whichever kind they are)."""
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


def cpu_container(image: str, index: int) -> dict[str, Any]:
    """The vLLM StatefulSet's container as one real vLLM CPU replica on SIM_PORTS[index]:
    the manifest's container with CPU_OVERLAY applied, nothing else."""
    sts = one(load("vllm.yaml"), "StatefulSet")
    vllm: dict[str, Any] = copy.deepcopy(sts["spec"]["template"]["spec"]["containers"][0])
    port = SIM_PORTS[index]
    args = []
    for arg in vllm["args"]:
        flag, _, _value = arg.partition("=")
        if flag in CPU_DROPPED_ARGS:
            continue
        if flag in CPU_ARGS:
            arg = f"{flag}={CPU_ARGS[flag]}"
        elif flag == "--port":
            arg = f"--port={port}"
        args.append(arg)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(index)}
    vllm.update(name=f"vllm-{index}", image=image, args=args, resources=CPU_RESOURCES)
    vllm["env"] = vllm["env"] + [{"name": k, "value": v} for k, v in env.items()]
    vllm["ports"] = [{"name": f"http-{index}", "containerPort": port}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        vllm[probe]["httpGet"]["port"] = port
    return vllm


def played(
    gateway_image: str,
    replica_image: str,
    *,
    suffix: str = "",
    secret_root: Path | None = None,
    shm_dir: Path | None = None,
    replicas: str = "sim",
) -> list[dict[str, Any]]:
    """The documents `podman kube play` gets: the PVC as it is, and the Pod. A secret
    volume becomes the hostPath ``secret_root/<secretName>`` (see CHANGES); secretKeyRef
    names and every other name get ``suffix``; the dshm emptyDir becomes the hostPath
    ``shm_dir``. ``replicas``: ``sim`` (sim_container) or
    ``vllm-cpu`` (cpu_container)."""
    replica = {"sim": sim_container, "vllm-cpu": cpu_container}[replicas]
    job = one(load("trainer-job.yaml"), "Job")
    sts = one(load("vllm.yaml"), "StatefulSet")
    template = job["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    spec.pop("initContainers")
    spec.pop("restartPolicy")
    spec["containers"] = [gateway_container(gateway_image)] + [
        replica(replica_image, i) for i in range(len(SIM_PORTS))
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
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            volume.pop("emptyDir")
            shm = shm_dir or Path("/run/rollout-played-shm")
            volume["hostPath"] = {"path": str(shm), "type": "Directory"}
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


# --------------------------------------------------------------------------- playing it

# Run inside the gateway container: one HTTP request on the pod's loopback.
REQUEST = """
import json, sys, urllib.error, urllib.request
method, url, body, headers, timeout = json.loads(sys.argv[1])
req = urllib.request.Request(url, method=method, headers=headers,
                             data=json.dumps(body).encode() if body is not None else None)
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
except OSError as e:
    print(json.dumps([0, repr(e)]))
"""


@dataclass
class Pod:
    spec: dict[str, Any]
    gateway: str  # the gateway container's name
    api_key: str

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        port: int = 8000,
        headers: dict[str, str] | None = None,
        timeout: float = 10,
    ) -> tuple[int, str]:
        """One request from inside the pod (as the Job's trainer container would), with the
        API key unless ``headers`` says otherwise."""
        if headers is None:
            headers = {"Authorization": f"Bearer {self.api_key}"}
        headers = {"Content-Type": "application/json", **headers}
        arg = json.dumps([method, f"http://127.0.0.1:{port}{path}", body, headers, timeout])
        res = podman("exec", self.gateway, "python", "-I", "-c", REQUEST, arg, timeout=timeout + 30)
        status, text = json.loads(res.stdout.strip().splitlines()[-1])
        return int(status), str(text)

    def logs(self, container: str) -> str:
        res = podman("logs", f"{self.spec['metadata']['name']}-{container}", check=False)
        return res.stdout + res.stderr

    def leftovers(self) -> list[str]:
        """What of this pod still exists after ``play`` ended, asked by name: the pod, its
        containers, the PVC's volume, the podman secret."""
        spec, pod = self.spec["spec"], self.spec["metadata"]["name"]
        names = [("pod", pod)] + [("container", f"{pod}-{c['name']}") for c in spec["containers"]]
        names += [("volume", v["persistentVolumeClaim"]["claimName"])
                  for v in spec["volumes"] if "persistentVolumeClaim" in v]  # fmt: skip
        names += [("secret", e["valueFrom"]["secretKeyRef"]["name"])
                  for c in spec["containers"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
        found = []
        for kind, name in dict.fromkeys(names):
            if kind == "secret":
                there = podman("secret", "inspect", name, check=False).returncode == 0
            else:
                there = podman(kind, "exists", name, check=False).returncode == 0
            if there:
                found.append(f"{kind} {name}")
        return found

    def restarts(self, container: str) -> int:
        """How often the container was restarted: kube play restarts what exits (Always),
        so a replica that crashes at start shows here, not as a stopped container."""
        name = f"{self.spec['metadata']['name']}-{container}"
        out = podman("inspect", "--format", "{{.RestartCount}}", name, check=False).stdout
        return int(out.strip() or 0)


def _containers_conf(path: Path) -> Path:
    """kube play takes no --runtime/--ulimit: the same settings as containers.conf."""
    limits = dict(f.split("=", 1) for f in RUN_FLAGS if "=" in f and ":" in f)
    ulimits = f'default_ulimits = ["nofile={limits["nofile"]}", "nproc={limits["nproc"]}"]'
    path.write_text(f'[containers]\n{ulimits}\n[engine]\nruntime = "runc"\n')
    return path


@contextlib.contextmanager
def play(
    gateway_image: str, replica_image: str, tmp: Path, *, replicas: str = "sim"
) -> Iterator[Pod]:
    """`podman kube play` the played pod (a fresh suffix, the test's own secret values);
    yields it; `kube down`, and its volume and podman secret removed by name, whatever
    happened."""
    suffix = "-" + uuid.uuid4().hex[:8]
    api_key = "played-" + uuid.uuid4().hex
    secrets = secret_values()
    secrets["hf-token"]["token"] = "hf_" + uuid.uuid4().hex
    secrets["rollout-gateway"]["api-key"] = api_key
    root = tmp / "secrets"
    for name, items in secrets.items():
        (root / name).mkdir(parents=True, mode=0o755)
        for key, value in items.items():
            (root / name / key).write_text(value)
            (root / name / key).chmod(0o644)
    for d in (tmp, root, *root.iterdir()):
        d.chmod(0o755)
    shm = tmp / "dshm"
    shm.mkdir()
    shm.chmod(0o1777)  # as a tmpfs /dev/shm
    docs = played(gateway_image, replica_image, suffix=suffix, secret_root=root, shm_dir=shm,
                  replicas=replicas)  # fmt: skip
    path = tmp / "played.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    env = {**os.environ, "CONTAINERS_CONF": str(_containers_conf(tmp / "containers.conf"))}
    # secretKeyRef env: a podman secret in the form podman 4.3 reads (JSON, base64 values).
    hf = {k: base64.b64encode(v.encode()).decode() for k, v in secrets["hf-token"].items()}
    secret_name = "hf-token" + suffix
    (tmp / "hf.json").write_text(json.dumps(hf))
    podman("secret", "create", secret_name, str(tmp / "hf.json"))

    def kube(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman", "kube", *args, str(path)], capture_output=True,
                              text=True, timeout=180, check=False, env=env)  # fmt: skip

    try:
        res = kube("play")
        assert res.returncode == 0, res.stdout + res.stderr
        pod_name = docs[-1]["metadata"]["name"]
        yield Pod(docs[-1], f"{pod_name}-rollout-gateway", api_key)
    finally:
        kube("down")
        podman("volume", "rm", "--force", docs[0]["metadata"]["name"], check=False)
        podman("secret", "rm", secret_name, check=False)


if __name__ == "__main__":
    kind = sys.argv[3] if len(sys.argv) > 3 else "sim"
    docs = played(sys.argv[1], sys.argv[2], replicas=kind)
    print(yaml.safe_dump_all(docs, sort_keys=False), end="")
