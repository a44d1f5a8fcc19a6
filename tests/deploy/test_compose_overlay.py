"""deploy/compose/compose.cpu.yaml is a small CPU overlay of compose.yaml, nothing more.

The CPU rehearsal (tests/rehearsal) runs compose.yaml with this overlay; what it proves
holds for the GPU deployment only as far as the two are the same. So this test holds the
difference to the keys the overlay documents (its header, deploy/compose/README.md): any
other key (a command, a mount, the gateway's settings) fails here, before the rehearsal.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.test_versions import V

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
REPLICAS = ("vllm-0", "vllm-1")
# The overlay's documented keys, per service: everything it may set.
ALLOWED = {
    "vllm-0": {"image", "deploy", "cpuset", "environment"},
    "vllm-1": {"image", "deploy", "cpuset", "environment"},
    "prometheus": {"image"},
}
# What the overlay may add to a replica's environment: the CPU backend's runtime settings.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"}


class Reset:
    """Compose's ``!reset`` tag: the key is removed from the merged file."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: Reset())


def load(name: str) -> dict[str, Any]:
    doc = yaml.load((COMPOSE / name).read_text(), Loader=_Loader)
    assert isinstance(doc, dict)
    return doc


def merge(base: Any, over: Any) -> Any:
    """Compose's merge for the shapes these files use: mappings merge key by key, anything
    else (lists, scalars) is replaced, ``!reset`` removes the key."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value) if key in base else value
        return out
    return copy.deepcopy(over)


def test_the_overlay_sets_only_its_documented_keys() -> None:
    over = load("compose.cpu.yaml")
    assert set(over) == {"services"}, set(over)
    services = over["services"]
    assert set(services) <= ALLOWED.keys(), set(services) - ALLOWED.keys()
    for name, body in services.items():
        assert set(body) <= ALLOWED[name], (name, set(body) - ALLOWED[name])


def test_the_merged_file_differs_from_the_base_only_there() -> None:
    base, over = load("compose.yaml"), load("compose.cpu.yaml")
    merged = merge(base, over)
    assert set(merged) == set(base)
    for name, body in base["services"].items():
        got = merged["services"][name]
        keep = ALLOWED.get(name, set())
        assert {k: v for k, v in got.items() if k not in keep} == {
            k: v for k, v in body.items() if k not in keep
        }, name
    for name in REPLICAS:
        got, was = merged["services"][name], base["services"][name]
        assert "deploy" not in got  # no GPU reservation left
        env = got["environment"]
        assert {k: v for k, v in env.items() if k in was["environment"]} == was["environment"]
        assert set(env) - set(was["environment"]) <= CPU_ENV
        # the command, the adapter mount and the healthcheck are the GPU file's own
        assert got["command"] == was["command"] and got["volumes"] == was["volumes"]


def test_each_replica_gets_its_own_core_and_the_pinned_cpu_image() -> None:
    services = load("compose.cpu.yaml")["services"]
    cores = [services[n]["cpuset"] for n in REPLICAS]
    assert len(set(cores)) == len(cores)
    for name, core in zip(REPLICAS, cores, strict=True):
        assert services[name]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == core
        # the default is vLLM's CPU release of the tested version; the rehearsal's own
        # build comes in through the variable
        assert services[name]["image"] == f"${{VLLM_CPU_IMAGE:-{V['VLLM_CPU_IMAGE']}}}"
    base = load("compose.yaml")["services"]["prometheus"]["image"]
    assert services["prometheus"]["image"] == f"${{PROMETHEUS_IMAGE:-{base}}}"


def test_the_header_documents_every_key_the_overlay_sets() -> None:
    text = (COMPOSE / "compose.cpu.yaml").read_text()
    header = "\n".join(re.findall(r"^#.*$", text.split("services:")[0], flags=re.M))
    for keys in ALLOWED.values():
        for key in keys:
            assert re.search(rf"\b{key}\b", header), key
    for var in CPU_ENV:
        assert var in header, var


def test_adapters_are_mounted_at_the_same_absolute_path_everywhere() -> None:
    """TRL sends the host path it saved to as lora_path: the gateway (its adapter root)
    and every replica must see the adapter at exactly that path."""
    base = load("compose.yaml")["services"]
    same = "${ADAPTER_DIR:?set ADAPTER_DIR to an absolute host path}:${ADAPTER_DIR}:ro"
    for name in ("gateway", *REPLICAS):
        assert same in base[name]["volumes"], name
    roots = base["gateway"]["environment"]["GATEWAY_ADAPTER_ROOTS"]
    assert roots == "${ADAPTER_DIR:?set ADAPTER_DIR to an absolute host path}"
