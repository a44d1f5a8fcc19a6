"""deploy/k8s as far as one podman host runs it: `podman kube play` of the pod that
tests/container/kube.py generates from the manifests (gateway sidecar + 2 sim replicas in
one pod), then a completion and an adapter load through it.

Requests go from inside the pod's network namespace (``podman exec`` into the gateway
container), as the trainer container of the Job would: no host port is published.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container import kube
from tests.container._podman import inspect, podman
from tests.eventually import eventually_sync

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pod(image: str, sim_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube.Pod]:
    with kube.play(image, sim_image, tmp_path_factory.mktemp("kube")) as played:
        yield played


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


def test_pod_serves_a_completion_and_an_adapter_load(pod: kube.Pod) -> None:
    seen: list[tuple[int, str]] = []

    def healthy() -> bool:  # the startupProbe's check: /readyz 200
        seen.append(pod.request("GET", "/readyz"))
        return seen[-1][0] == 200

    def dump() -> None:
        print(seen[-1:], podman("logs", pod.gateway, check=False).stderr[-2000:])

    eventually_sync(healthy, "the pod's /readyz 200", timeout=90, interval=0.5, on_timeout=dump)
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
    assert pod.request("GET", "/v1/models", headers={})[0] == 401


def test_pod_keeps_the_security_context(pod: kube.Pod) -> None:
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


def test_probes_answer_as_the_kubelet_expects(pod: kube.Pod) -> None:
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
