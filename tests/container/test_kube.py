"""deploy/k8s as far as one podman host runs it: `podman kube play` of the pod that
tests/container/kube.py generates from the manifests (gateway sidecar + 2 sim replicas in
one pod), then a completion and an adapter load through it.

Requests go from inside the pod's network namespace (``podman exec`` into the gateway
container), as the trainer container of the Job would: no host port is published.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.container import kube
from tests.container._podman import RUN_FLAGS, inspect, podman
from tests.eventually import eventually_sync

pytestmark = pytest.mark.timeout(900)

API_KEY = "played-" + uuid.uuid4().hex
# Run inside the gateway container: one HTTP request on the pod's loopback.
REQUEST = """
import json, sys, urllib.error, urllib.request
method, url, body, headers = json.loads(sys.argv[1])
req = urllib.request.Request(url, method=method, headers=headers,
                             data=json.dumps(body).encode() if body is not None else None)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
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

    def request(
        self, method: str, path: str, body: object = None, port: int = 8000
    ) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        arg = json.dumps([method, f"http://127.0.0.1:{port}{path}", body, headers])
        res = podman("exec", self.gateway, "python", "-I", "-c", REQUEST, arg, timeout=30)
        status, text = json.loads(res.stdout.strip().splitlines()[-1])
        return int(status), str(text)


def _containers_conf(path: Path) -> Path:
    """kube play takes no --runtime/--ulimit: the same settings as containers.conf."""
    limits = dict(f.split("=", 1) for f in RUN_FLAGS if "=" in f and ":" in f)
    ulimits = f'default_ulimits = ["nofile={limits["nofile"]}", "nproc={limits["nproc"]}"]'
    path.write_text(f'[containers]\n{ulimits}\n[engine]\nruntime = "runc"\n')
    return path


@pytest.fixture(scope="module")
def pod(image: str, sim_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    suffix = "-" + uuid.uuid4().hex[:8]
    tmp = tmp_path_factory.mktemp("kube")
    secrets = kube.secret_values()
    secrets["hf-token"]["token"] = "hf_" + uuid.uuid4().hex
    secrets["rollout-gateway"]["api-key"] = API_KEY
    root = tmp / "secrets"
    for name, items in secrets.items():
        (root / name).mkdir(parents=True, mode=0o755)
        for key, value in items.items():
            (root / name / key).write_text(value)
            (root / name / key).chmod(0o644)
    for d in (tmp, root, *root.iterdir()):
        d.chmod(0o755)
    docs = kube.played(image, sim_image, suffix=suffix, secret_root=root)
    played = tmp / "played.yaml"
    played.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    env = {"CONTAINERS_CONF": str(_containers_conf(tmp / "containers.conf"))}
    # secretKeyRef env: a podman secret in the form podman 4.3 reads (JSON, base64 values).
    hf = {k: base64.b64encode(v.encode()).decode() for k, v in secrets["hf-token"].items()}
    secret_name = "hf-token" + suffix
    podman("secret", "create", secret_name, str(_write(tmp / "hf.json", json.dumps(hf))))

    def kube_cmd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", "kube", *args, str(played)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={**os.environ, **env},
        )

    try:
        res = kube_cmd("play")
        assert res.returncode == 0, res.stdout + res.stderr
        pod_name = docs[-1]["metadata"]["name"]
        yield Pod(docs[-1], f"{pod_name}-rollout-gateway")
    finally:
        kube_cmd("down")
        podman("volume", "rm", "--force", docs[0]["metadata"]["name"], check=False)
        podman("secret", "rm", secret_name, check=False)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_played_spec_is_the_manifests_own() -> None:
    """Drift check: apart from kube.CHANGES, the played containers are the manifests'."""
    job = kube.one(kube.load("trainer-job.yaml"), "Job")["spec"]["template"]["spec"]
    vllm = kube.one(kube.load("vllm.yaml"), "StatefulSet")["spec"]["template"]["spec"]
    docs = kube.played("gw", "sim", suffix="-x", secret_root=Path("/s"))
    spec = docs[-1]["spec"]
    assert spec["securityContext"] == job["securityContext"]
    assert spec["terminationGracePeriodSeconds"] == job["terminationGracePeriodSeconds"]
    sidecar = next(c for c in job["initContainers"] if c["name"] == "rollout-gateway")
    gw = spec["containers"][0]
    for key in sidecar.keys() - {"image", "env", "restartPolicy"}:
        assert gw[key] == sidecar[key], key
    env = {e["name"]: e for e in gw["env"]}
    want = {e["name"]: e for e in sidecar["env"]}
    assert env.pop("GATEWAY_REPLICAS")["value"] == "http://127.0.0.1:8101,http://127.0.0.1:8102"
    want.pop("GATEWAY_DISCOVERY_DNS")
    assert env == want
    for i, sim in enumerate(spec["containers"][1:]):
        base = vllm["containers"][0]
        assert sim["volumeMounts"] == base["volumeMounts"]
        assert [e["name"] for e in sim["env"]] == [e["name"] for e in base["env"]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            got, ref = sim[probe], base[probe]
            assert got["httpGet"] == {**ref["httpGet"], "port": kube.SIM_PORTS[i]}
            assert {k: v for k, v in got.items() if k != "httpGet"} == {
                k: v for k, v in ref.items() if k != "httpGet"
            }
        assert "--max-loras" in sim["args"]
    # every volume the containers mount exists, and no Secret volume is left for podman
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in spec["containers"]:
        assert {m["name"] for m in c["volumeMounts"]} <= volumes.keys()
    assert not [v for v in volumes.values() if "secret" in v]


def test_pod_serves_a_completion_and_an_adapter_load(pod: Pod) -> None:
    seen: list[tuple[int, str]] = []

    def healthy() -> bool:  # the startupProbe's check: /health 200
        seen.append(pod.request("GET", "/health"))
        return seen[-1][0] == 200

    def dump() -> None:
        print(seen[-1:], podman("logs", pod.gateway, check=False).stderr[-2000:])

    eventually_sync(healthy, "the pod's /health 200", timeout=90, interval=0.5, on_timeout=dump)
    status, text = pod.request("GET", "/v1/models")
    assert status == 200, text
    model = json.loads(text)["data"][0]["id"]
    assert model == "Qwen/Qwen2.5-1.5B-Instruct", model  # the manifest's --served-model-name
    status, text = pod.request(
        "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4}
    )
    assert status == 200, text
    status, text = pod.request(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "policy-1", "lora_path": "/adapters/policy-1"},
    )
    assert status == 200, text
    status, text = pod.request(
        "POST", "/v1/completions", {"model": "policy-1", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, text
    # GATEWAY_API_KEY_FILE from the mounted secret: no key, no service
    arg = json.dumps(["GET", "http://127.0.0.1:8000/v1/models", None, {}])
    res = podman("exec", pod.gateway, "python", "-I", "-c", REQUEST, arg)
    assert json.loads(res.stdout.strip().splitlines()[-1])[0] == 401


def test_pod_keeps_the_security_context(pod: Pod) -> None:
    """runAsUser/runAsGroup, readOnlyRootFilesystem, drop ALL, no privilege escalation."""
    for container in pod.spec["spec"]["containers"]:
        name = f"{pod.spec['metadata']['name']}-{container['name']}"
        meta = inspect(name)
        assert meta["Config"]["User"].split(":")[0] == "10001", (name, meta["Config"]["User"])
        host = meta["HostConfig"]
        if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
            assert host["ReadonlyRootfs"] is True, name
            assert "no-new-privileges" in host["SecurityOpt"], name
            assert "CAP_NET_RAW" in host["CapDrop"] and "CAP_SETUID" in host["CapDrop"], name
            assert not host.get("CapAdd"), name
    status = podman("exec", pod.gateway, "cat", "/proc/1/status").stdout
    uid = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
    assert set(uid) == {"10001"}, uid


def test_probes_answer_as_the_kubelet_expects(pod: Pod) -> None:
    """kube play turns only livenessProbe into a podman healthcheck, with curl/nc that the
    images do not carry; so each probe of the spec is done here as the kubelet would do it
    (httpGet 200-399, tcpSocket connects), from inside the pod."""
    for container in pod.spec["spec"]["containers"]:
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if "httpGet" in probe:
                port = probe["httpGet"]["port"]
                port = ports.get(port, port)
                status, _ = pod.request("GET", probe["httpGet"]["path"], port=int(port))
                assert 200 <= status < 400, (container["name"], kind, status)
            else:
                port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
                script = f"import socket; socket.create_connection(('127.0.0.1', {port}), 3)"
                podman("exec", pod.gateway, "python", "-I", "-c", script)
